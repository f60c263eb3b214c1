"""Every EAGLE-3 head layout, written and read in one place: our final/ (vLLM's native layout) and
speculators'. `export` writes a trained draft as a directory vLLM serves as is; `load_draft` reads
ours, other tools' native dirs (EAGLE, SpecForge) and speculators dirs back into an `Eagle3Draft`.

`vllm` (native EAGLE-3, what vLLM's `LlamaForCausalLMEagle3` loads): config.json with architectures
["LlamaForCausalLMEagle3"], model_type "llama", num_hidden_layers 1, the target's vocab_size,
and at the top level draft_vocab_size, target_hidden_size, the 3 aux ids as
eagle_aux_hidden_state_layer_ids and the four norm switches written explicitly. Weights keep
Eagle3Draft's names, which are vLLM's (no `model.` prefix): fc, input_norm (norm_before_fc), fc_norm.0..2,
midlayer.*, norm, lm_head, d2t; t2d is kept for our own tools (vLLM skips it); embed_tokens is
left out (vLLM shares the target's).

An MLA draft layer (`DraftConfig.layer == "mla"`) is written for vLLM's `Eagle3DeepseekV3ForCausalLM`
(`deepseek_eagle3.py`): architectures ["Eagle3DeepseekV3ForCausalLM"], model_type "deepseek_v2", the target's
MLA widths (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim) and its RoPE (YaRN
included), the same top-level EAGLE-3 keys less norm_before_fc (that draft has no norm over fc's input), and
DeepSeek's tensor names under `midlayer.self_attn.` (q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj; vLLM renames `midlayer.` to `layers.0.` and fuses q_a_proj with
kv_a_proj_with_mqa, gate_proj with up_proj, itself). speculators has no MLA draft: that export refuses it.

`speculators`: the same tensors with the decoder layer under `layers.0.` and the speculators
config (speculators_model_type, transformer_layer_config, speculators_config with the proposal's
speculative_tokens and the verifier's name_or_path).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3.model.draft import DraftConfig, Eagle3Draft
from eagle3.model.target import Target, default_aux_ids
from eagle3.storage.atomic import atomic_dir, atomic_write_json, read_json_object

WEIGHTS = "model.safetensors"
SKIP = ("embed_tokens.weight",)


def _layer_config(c) -> dict[str, Any]:
    """The draft layer as a Llama config dict (what vLLM's LlamaConfig reads)."""
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "rope_parameters": c.rope_parameters,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _eagle_fields(c) -> dict[str, Any]:
    """The EAGLE-3 keys both formats carry at the top level (the norm switches always explicit)."""
    return {
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
    }


def _mla_config(c) -> dict[str, Any]:
    """An MLA draft layer as the DeepSeek-V3 config dict vLLM's Eagle3DeepseekV3ForCausalLM reads."""
    return {
        "architectures": ["Eagle3DeepseekV3ForCausalLM"],
        # not "deepseek_v3": vLLM turns a speculative model of that type into DeepSeek's own MTP layer
        # (SpeculativeConfig.hf_config_override) whatever its architectures say. DeepseekV2Config reads the same
        # MLA fields, and Eagle3DeepseekV2ForCausalLM is the class Eagle3DeepseekV3ForCausalLM names.
        "model_type": "deepseek_v2",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta,
        "rope_scaling": c.rope_scaling,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def vllm_config(c, k: int) -> dict[str, Any]:
    if c.layer == "mla":
        fields = {key: v for key, v in _eagle_fields(c).items() if key != "norm_before_fc"}
        return {**_mla_config(c), **fields, "num_speculative_tokens": k, "torch_dtype": "float32"}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_config(c),
        **_eagle_fields(c),
        "num_speculative_tokens": k,
        "torch_dtype": "float32",
    }


def speculators_config(c, k: int, verifier: str) -> dict[str, Any]:
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _layer_config(c),
        **_eagle_fields(c),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }


def export_state(state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """Trainer state dict -> the tensors of the export format."""
    out = {}
    for k, v in state.items():
        if k in SKIP:
            continue
        if fmt == "speculators" and k.startswith("midlayer."):
            k = "layers.0." + k[len("midlayer."):]
        out[k] = v.detach().to("cpu").contiguous()
    if out["d2t"].dtype != torch.int64:
        raise AssertionError("d2t must be int64")
    return out


def export(state: dict[str, torch.Tensor], config, k: int, out: str | Path, fmt: str = "vllm",
           verifier: str = "", extra: dict[str, Any] | None = None) -> Path:
    """Write `out/` (config.json + model.safetensors) atomically, replacing an older export."""
    if fmt not in ("vllm", "speculators"):
        raise ValueError(f"unknown export format {fmt!r} (vllm or speculators)")
    if fmt == "speculators" and config.layer == "mla":
        raise ValueError("the speculators format has no MLA draft layer: export an MLA head as vllm (native)")
    if fmt == "speculators" and config.fc_norm:
        raise ValueError("the speculators format has no per-layer fc norm: export an fc_norm head as vllm (native)")
    out = Path(out)
    d2t = state["d2t"]
    if d2t.numel() > 1 and not bool(d2t.any()) and config.draft_vocab_size < config.vocab_size:
        raise ValueError("refusing to export an all-zero d2t with a reduced draft vocab "
                         "(the vocab map was never loaded)")
    cfg = vllm_config(config, k) if fmt == "vllm" else speculators_config(config, k, verifier)
    if extra:
        cfg["eagle3"] = extra
    with atomic_dir(out) as tmp:
        save_file(export_state(state, fmt), str(tmp / WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", cfg)
    return out


# ---------------------------------------------------------------- reading any layout
def _read_weights(d: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a draft dir: *.safetensors, else pytorch_model*.bin. Returns (tensors, file list)."""
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if files:
        t: dict[str, torch.Tensor] = {}
        for f in files:
            t.update(load_file(f))
        return t, ", ".join(f.name for f in files)
    files = sorted(d.glob("pytorch_model*.bin"))
    if files:
        t = {}
        for f in files:
            t.update(torch.load(f, map_location="cpu", weights_only=True))
        return t, ", ".join(f.name for f in files)
    raise ValueError(f"{d}: no weights (*.safetensors or pytorch_model*.bin)")


def draft_name(name: str) -> str:
    """Any tool's EAGLE-3 tensor name -> Eagle3Draft's (vLLM native) name."""
    if name.startswith("model."):
        name = name[len("model.") :]  # vLLM-internal / some exporters
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]  # speculators (and vLLM after its own remap)
    if name == "draft_id_to_target_id":
        name = "d2t"
    return name


def draft_format(cfg: dict[str, Any]) -> str:
    """'speculators' or 'vllm' (native EAGLE-3: ours, EAGLE official, SpecForge)."""
    if cfg.get("speculators_model_type") is not None:
        if cfg["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators_model_type {cfg['speculators_model_type']!r} is not an EAGLE-3 head")
        return "speculators"
    return "vllm"


def _flag(cfg: dict[str, Any], name: str, default: bool) -> bool:
    """A switch as vLLM reads it: top level, else inside `eagle_config`, else the default."""
    if cfg.get(name) is not None:
        return bool(cfg[name])
    ec = cfg.get("eagle_config")
    if isinstance(ec, dict) and ec.get(name) is not None:
        return bool(ec[name])
    return default


def load_draft(
    draft_dir: str | Path, target_dir: str | Path, target_embedding: torch.Tensor | None = None
) -> tuple[Eagle3Draft, str]:
    """(Eagle3Draft, format) from a native vLLM EAGLE-3 dir (ours, other tools') or a speculators dir.

    Tolerated variants: a `model.` prefix; `layers.0.` for `midlayer.`; embed_tokens absent (the
    target's embedding is used, as vLLM shares it); t2d present or absent; d2t absent when the
    draft vocab is the full vocab, or derivable from t2d. Switches default as vLLM's loader
    does: absent means off (norm_before_fc is on when the weights hold `input_norm.weight`).
    """
    d = Path(draft_dir)
    cpath = d / "config.json"
    if not cpath.is_file():
        raise ValueError(f"{d}: no config.json (expected an EAGLE-3 draft dir)")
    cfg = read_json_object(cpath, "a draft config (a JSON object)")
    fmt = draft_format(cfg)
    tensors, files = _read_weights(d)
    t = {draft_name(k): v for k, v in tensors.items()}
    model = Eagle3Draft(_draft_config(cfg, fmt, t, cpath, target_dir))
    state = _draft_state(t, model.state_dict(), f"{d} ({files})", target_embedding, model.config.vocab_size,
                         model.config.draft_vocab_size)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return model.eval(), fmt


def _draft_config(cfg: dict, fmt: str, t: dict[str, torch.Tensor], cpath: Path, target_dir: str | Path) -> DraftConfig:
    """The draft's config from its config.json (`cfg`, in format `fmt`) and the target's: the layer's shape, the
    aux layer ids (vLLM's default where absent), and the switches (absent means off, as vLLM's loader reads
    them; norm_before_fc and fc_norm on where the weights `t` hold theirs)."""
    tgt = Target.open(target_dir).text
    layer = dict(cfg.get("transformer_layer_config") or {}) if fmt == "speculators" else dict(cfg)
    kind = "mla" if layer.get("kv_lora_rank") is not None else "llama"  # DeepSeek's MLA draft (vLLM's key)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if key not in layer:
            raise ValueError(f"{cpath}: missing {key!r}"
                             + (" in transformer_layer_config" if fmt == "speculators" else ""))
    V = int(layer.get("vocab_size") or tgt["vocab_size"])
    if V != tgt["vocab_size"]:
        raise ValueError(f"{cpath}: vocab_size {V} differs from the target's {tgt['vocab_size']} ({target_dir})")
    Vd = int(cfg.get("draft_vocab_size") or V)
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None and isinstance(cfg.get("eagle_config"), dict):
        aux = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    N = tgt["num_hidden_layers"]
    aux = list(aux) if aux else default_aux_ids(N)  # vLLM's default for the target
    if len(aux) == 4 and aux[-1] == N:
        aux = aux[:3]  # some tools list the final layer too; the draft consumes 3
    switches = {
        "norm_before_fc": _flag(cfg, "norm_before_fc", "input_norm.weight" in t),
        "fc_norm": _flag(cfg, "fc_norm", "fc_norm.0.weight" in t),
        "norm_output": _flag(cfg, "norm_output", False),
        "norm_before_residual": _flag(cfg, "norm_before_residual", False),
    }
    # The draft layer's own shape, with the target's depth so the aux ids validate against it.
    if kind == "mla":
        switches.pop("norm_before_fc")  # vLLM's MLA draft has none
    c = DraftConfig.from_target({**layer, "num_hidden_layers": N, "vocab_size": V}, Vd, aux, layer=kind, **switches)
    th = int(cfg.get("target_hidden_size") or tgt["hidden_size"])
    if th != c.target_hidden_size:
        c = DraftConfig(**{**c.model_dump(), "target_hidden_size": th})
    return c


def _draft_state(t: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str,
                 target_embedding: torch.Tensor | None, V: int, Vd: int) -> dict[str, torch.Tensor]:
    """The weights `t` checked against the draft's own (`want`: names and shapes), with what a dir may leave out
    filled in: the embedding (the target's, as vLLM shares it), d2t (from t2d, or the identity for a full draft
    vocab) and t2d (from d2t)."""
    optional = {"embed_tokens.weight", "t2d", "d2t"}
    ignored = {k for k in t if k.startswith(("verifier_", "rotary_emb")) or k == "mask_hidden"}
    missing = sorted(set(want) - set(t) - optional)
    extra = sorted(set(t) - set(want) - ignored)
    if missing or extra:
        raise ValueError(f"{where}: not an EAGLE-3 draft of this shape; missing {missing[:6]}, unexpected {extra[:6]}")
    for k, v in t.items():
        if k in want and tuple(v.shape) != tuple(want[k].shape):
            raise ValueError(f"{where}: {k} has shape {tuple(v.shape)}, config.json implies {tuple(want[k].shape)}")
    state = {k: v for k, v in t.items() if k in want}
    if "embed_tokens.weight" not in state:
        if target_embedding is None:
            raise ValueError(f"{where}: no embed_tokens.weight and no target embedding given")
        state["embed_tokens.weight"] = target_embedding.detach().float().cpu()
    if "d2t" not in state:
        if "t2d" in state:
            tid = torch.nonzero(state["t2d"].bool()).flatten()  # the target ids of the draft vocab, in order
            if tid.numel() != Vd:
                raise ValueError(f"{where}: t2d marks {tid.numel()} ids, draft_vocab_size is {Vd}")
            state["d2t"] = tid - torch.arange(Vd)
        elif Vd == V:
            state["d2t"] = torch.zeros(Vd, dtype=torch.long)  # identity, as vLLM does without d2t
        else:
            raise ValueError(f"{where}: no d2t (nor t2d) to map a {Vd}-token draft vocab into the target's {V}")
    if "t2d" not in state:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.arange(Vd) + state["d2t"].long()] = True
        state["t2d"] = t2d
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    return state


def dir_fingerprint(d: str | Path) -> str:
    """sha256 over config.json and the weight files of a dir."""
    from eagle3.storage.hashing import sha256_file

    d = Path(d)
    files = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    return hashlib.sha256("".join(f"{p.name}:{sha256_file(p)}\n" for p in files).encode()).hexdigest()
