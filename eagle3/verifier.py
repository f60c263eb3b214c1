"""Stage 3a: the target's embedding, final norm and lm_head, read tensor by tensor from safetensors.

The draft needs exactly these target tensors: the frozen embedding, and the final norm + lm_head
that turn stored final states into the loss targets (plus the lm_head rows of the draft vocab,
which initialize the draft's own lm_head). They are read with `safe_open(...).get_tensor`, one
tensor at a time, through `model.safetensors.index.json` or a single `model.safetensors`, so the
memory used is the size of these tensors, never the whole model.

Output: `<out>/verifier.safetensors` with
    embed_tokens [V, H], norm [H], lm_head [V, H], lm_head_draft [Vd, H], d2t [Vd] int64, t2d [V] bool
and `<out>/manifest.json` (`VerifierWeights`): shapes, dtypes, source names and the source
files' sha256.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3.artifacts import PreparedData, TensorInfo, VerifierWeights
from eagle3.atomic import atomic_path, sha256_file, sha256_json

OUT_FILE = "verifier.safetensors"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# Where the text model and lm_head live, by the kind of architecture in config.json.
# (text-model prefix, lm_head prefix) pairs, tried in order.
_CAUSAL_LM = [("model.", ""), ("model.model.", "model.")]
_WRAPPED = [  # VLMs and other wrappers: transformers >= 4.52 layout first, then the older one
    ("model.language_model.", ""),
    ("language_model.model.", "language_model."),
    ("model.language_model.model.", "model.language_model."),
]


def candidate_prefixes(architecture: str) -> list[tuple[str, str]]:
    """(text-model prefix, lm_head prefix) candidates for an architecture name, most likely first.

    `*ForCausalLM` (Llama, Qwen, Mistral, DeepseekV3 / Kimi-K2, ...) keep `model.embed_tokens`;
    `*ForConditionalGeneration` and other wrappers (Llava, Qwen2-VL, Mistral3, Kimi-VL, ...)
    nest the language model under `model.language_model.` or `language_model.model.`.
    """
    if architecture.endswith("ForCausalLM"):
        return _CAUSAL_LM + _WRAPPED
    return _WRAPPED + _CAUSAL_LM


def weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the index or by listing a single file."""
    index = model_dir / INDEX
    if index.is_file():
        try:
            wmap = dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from None
        missing = sorted({f for f in wmap.values() if not (model_dir / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{index} points at {len(missing)} missing file(s): {', '.join(missing[:3])}")
        return wmap
    single = model_dir / SINGLE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return {k: SINGLE for k in f.keys()}
    raise FileNotFoundError(f"{model_dir}: neither {INDEX} nor {SINGLE} (expected an HF safetensors model dir)")


def _read(model_dir: Path, wmap: dict[str, str], name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(model_dir / wmap[name], "pt") as f:
        return f.get_tensor(name)


def resolve_names(model_dir: Path, config: dict, wmap: dict[str, str]) -> dict[str, str | None]:
    """Source names of embed / norm / lm_head (lm_head None when tied). Errors name what was searched."""
    arch = (config.get("architectures") or ["?"])[0]
    files = sorted(set(wmap.values())) or [SINGLE]
    for text, head in candidate_prefixes(arch):
        if f"{text}embed_tokens.weight" in wmap:
            break
    else:
        tried = [f"{t}embed_tokens.weight" for t, _ in candidate_prefixes(arch)]
        raise ValueError(
            f"{model_dir}: embedding not found for architecture {arch}: tried {tried} in {files}"
        )
    names: dict[str, str | None] = {"embed_tokens": f"{text}embed_tokens.weight", "norm": f"{text}norm.weight"}
    if names["norm"] not in wmap:
        raise ValueError(f"{model_dir}: final norm {names['norm']!r} not found in {files}")
    tc = _text_config(config)
    tie = tc.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    head_name = f"{head}lm_head.weight"
    if tie:
        names["lm_head"] = None
    elif head_name in wmap:
        names["lm_head"] = head_name
    elif tie is None:  # not said either way and no lm_head stored: the embedding is the head
        names["lm_head"] = None
    else:
        raise ValueError(
            f"{model_dir}: lm_head {head_name!r} not found in {files} (config says tie_word_embeddings=false)"
        )
    return names


def _text_config(config: dict) -> dict:
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(config.get(key), dict) and "hidden_size" in config[key]:
            return config[key]
    return config


def load_vocab_map(prepared_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, PreparedData]:
    """(d2t [Vd] int64, t2d [V] bool, manifest) from a prepare stage's output."""
    from safetensors.torch import load_file

    prep = PreparedData.read(prepared_dir)
    if prep.vocab_map is None:
        raise ValueError(f"{prepared_dir}: the prepare manifest has no vocab_map")
    path = Path(prepared_dir) / prep.vocab_map.file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: vocab map named by the prepare manifest is missing")
    if sha256_file(path) != prep.vocab_map.sha256:
        raise ValueError(f"{path}: sha256 does not match the prepare manifest (corrupt or replaced)")
    t = load_file(path)
    for key in ("d2t", "t2d"):
        if key not in t:
            raise ValueError(f"{path}: missing tensor {key!r}")
    return t["d2t"].long(), t["t2d"].bool(), prep


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Validate the map against the target vocab; returns the target id of each draft id [Vd].

    A wrong d2t silently ruins acceptance in serving, so any inconsistency is an error.
    """
    if t2d.shape != (vocab_size,):
        raise ValueError(f"t2d has shape {tuple(t2d.shape)}, but the target vocab (embedding rows) is {vocab_size}")
    ids = torch.arange(d2t.shape[0]) + d2t  # target = draft + d2t[draft]
    if ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"d2t maps draft ids outside the target vocab [0, {vocab_size})")
    if ids.unique().numel() != ids.numel():
        raise ValueError("d2t maps two draft ids to the same target id")
    if not bool(t2d[ids].all()) or int(t2d.sum()) != ids.numel():
        raise ValueError("t2d does not mark exactly the target ids that d2t maps to")
    return ids


def extract_verifier(model_dir: str | Path, prepared_dir: str | Path, out_dir: str | Path) -> VerifierWeights:
    """Write `verifier.safetensors` + manifest for a target model and a prepared draft vocab."""
    from safetensors.torch import save_file

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected an HF model dir)")
    config = json.loads(cfg_path.read_text())
    tc = _text_config(config)
    wmap = weight_map(model_dir)
    names = resolve_names(model_dir, config, wmap)
    d2t, t2d, prep = load_vocab_map(prepared_dir)

    embed = _read(model_dir, wmap, names["embed_tokens"])  # [V, H]
    norm = _read(model_dir, wmap, names["norm"])  # [H]
    lm_head = embed.clone() if names["lm_head"] is None else _read(model_dir, wmap, names["lm_head"])  # [V, H]
    V, H = embed.shape
    if lm_head.shape != (V, H) or norm.shape != (H,):
        raise ValueError(
            f"{model_dir}: inconsistent shapes: embed {tuple(embed.shape)}, lm_head {tuple(lm_head.shape)}, "
            f"norm {tuple(norm.shape)}"
        )
    try:
        target_ids = check_vocab_map(d2t, t2d, V)
    except ValueError as e:
        raise ValueError(f"{Path(prepared_dir) / prep.vocab_map.file}: {e}") from None
    tensors = {
        "embed_tokens": embed.contiguous(),
        "norm": norm.contiguous(),
        "lm_head": lm_head.contiguous(),
        "lm_head_draft": lm_head[target_ids].contiguous(),  # [Vd, H], rows of the draft vocab
        "d2t": d2t.contiguous(),
        "t2d": t2d.contiguous(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_dir / OUT_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})

    used = {"config.json"} | {wmap[n] for n in names.values() if n is not None}
    if (model_dir / INDEX).is_file():
        used.add(INDEX)
    source_files = {f: sha256_file(model_dir / f) for f in sorted(used)}
    source = {
        "embed_tokens": names["embed_tokens"],
        "norm": names["norm"],
        "lm_head": names["lm_head"] or f"{names['embed_tokens']} (tied)",
        "lm_head_draft": "lm_head rows arange(Vd) + d2t",
        "d2t": f"{prep.vocab_map.file} (prepare)",
        "t2d": f"{prep.vocab_map.file} (prepare)",
    }
    man = VerifierWeights(
        config={"model": str(model_dir), "prepared": str(prepared_dir)},
        inputs={"prepared": prep.fingerprint, "model": sha256_json(source_files)},
        model_dir=str(model_dir),
        architecture=(config.get("architectures") or ["?"])[0],
        file=OUT_FILE,
        sha256=sha256_file(out_dir / OUT_FILE),
        tensors={
            k: TensorInfo(shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."), source=source[k])
            for k, v in tensors.items()
        },
        source_files=source_files,
        tied_embeddings=names["lm_head"] is None,
        hidden_size=H,
        vocab_size=V,
        draft_vocab_size=int(d2t.shape[0]),
        rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)),
    )
    man.write(out_dir)
    return man
