"""Export a trained draft as a directory vLLM serves as is.

`vllm` (native EAGLE-3, REFERENCE §2): config.json with architectures
["LlamaForCausalLMEagle3"], model_type "llama", num_hidden_layers 1, the target's vocab_size,
and at the top level draft_vocab_size, target_hidden_size, the 3 aux ids as
eagle_aux_hidden_state_layer_ids and the three norm switches written explicitly. Weights keep
Eagle3Draft's names, which are vLLM's (no `model.` prefix): fc, input_norm (norm_before_fc),
midlayer.*, norm, lm_head, d2t; t2d is kept for our own tools (vLLM skips it); embed_tokens is
left out (vLLM shares the target's).

`speculators`: the same tensors with the decoder layer under `layers.0.` and the speculators
config (speculators_model_type, transformer_layer_config, speculators_config with the proposal's
speculative_tokens and the verifier's name_or_path).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3.atomic import atomic_dir, atomic_write_json

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
        "norm_output": c.norm_output,
    }


def vllm_config(c, k: int) -> dict[str, Any]:
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
    out = Path(out)
    d2t = state["d2t"]
    if d2t.numel() > 1 and not bool(d2t.any()) and config.draft_vocab_size < config.vocab_size:
        raise ValueError("refusing to export an all-zero d2t with a reduced draft vocab (the vocab map was never loaded)")
    cfg = vllm_config(config, k) if fmt == "vllm" else speculators_config(config, k, verifier)
    if extra:
        cfg["eagle3"] = extra
    with atomic_dir(out) as tmp:
        save_file(export_state(state, fmt), str(tmp / WEIGHTS), metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", cfg)
    return out
