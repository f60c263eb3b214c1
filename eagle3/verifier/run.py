"""Stage 3a: the target's embedding, final norm and lm_head, read tensor by tensor from safetensors.

The draft needs exactly these target tensors: the frozen embedding, and the final norm + lm_head
that turn stored final states into the loss targets (plus the lm_head rows of the draft vocab,
which initialize the draft's own lm_head). They are read with `safe_open(...).get_tensor`, one
tensor at a time, through `model.safetensors.index.json` or a single `model.safetensors`, so the
memory used is the size of these tensors, never the whole model. `Target.weight_names()` finds
them in any layout: a plain `*ForCausalLM` (`model.embed_tokens`), or a VLM wrapper such as
Kimi-K2.5's (`language_model.model.embed_tokens`, `language_model.lm_head`; vision tensors are
never read).

Output: `<out>/verifier.safetensors` with
    embed_tokens [V, H], norm [H], lm_head [V, H], lm_head_draft [Vd, H], d2t [Vd] int64, t2d [V] bool
and `<out>/manifest.json` (`VerifierWeights`): shapes, dtypes, source names and the source
files' sha256.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3.model.target import INDEX, Target
from eagle3.storage.atomic import atomic_path, clean_temp_files
from eagle3.storage.hashing import sha256_file, sha256_file_cached
from eagle3.storage.manifests import PreparedData, TensorInfo, VerifierWeights

OUT_FILE = "verifier.safetensors"


def load_vocab_map(prepared_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor, PreparedData]:
    """(d2t [Vd] int64, t2d [V] bool, manifest) from a prepare stage's output."""
    from safetensors.torch import load_file

    prep = PreparedData.read(prepared_dir)
    if prep.vocab_map is None:
        raise ValueError(f"{prepared_dir}: the prepare manifest has no vocab_map")
    path = Path(prepared_dir) / prep.vocab_map.file
    if not path.is_file():
        raise FileNotFoundError(f"{path}: vocab map named by the prepare manifest is missing")
    if sha256_file_cached(path) != prep.vocab_map.sha256:
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


def inputs(model_dir: str | Path, prepared_dir: str | Path) -> dict[str, str]:
    """What the verifier tensors depend on: the target's and the prepared data's content. The stage's
    "already done" check and the Prefect task's cache key are both this dict."""
    return {"model": Target.open(model_dir).fingerprint(), "prepared": PreparedData.read(prepared_dir).fingerprint}


def extract_verifier(model_dir: str | Path, prepared_dir: str | Path, out_dir: str | Path) -> VerifierWeights:
    """Write `verifier.safetensors` + manifest for a target model and a prepared draft vocab."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    fp = inputs(model_dir, prepared_dir)
    if VerifierWeights.exists(out_dir):
        done = VerifierWeights.read(out_dir)
        if done.inputs == fp and (out_dir / OUT_FILE).is_file() and sha256_file(out_dir / OUT_FILE) == done.sha256:
            return done
    target = Target.open(model_dir)
    names = target.weight_names()  # where the text model's tensors sit (VLM wrappers resolved)
    d2t, t2d, prep = load_vocab_map(prepared_dir)
    tensors = _tensors(target, names, d2t, t2d, Path(prepared_dir) / prep.vocab_map.file)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_temp_files(out_dir)  # a killed run's temp file (this stage writes nothing else that could be half done)
    with atomic_path(out_dir / OUT_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    man = _manifest(target, names, tensors, fp, prepared_dir, prep.vocab_map.file, sha256_file(out_dir / OUT_FILE))
    man.write(out_dir)
    return man


def _tensors(target: Target, names: dict[str, str | None], d2t: torch.Tensor, t2d: torch.Tensor,
             vocab_file: Path) -> dict[str, torch.Tensor]:
    """The verifier's tensors, read from the target's shards and checked: embed_tokens [V, H], norm [H], lm_head
    [V, H] (the embedding's copy where tied), lm_head_draft [Vd, H] (the rows of the draft vocab), d2t and t2d."""
    embed = target.read(names["embed_tokens"])  # [V, H]
    norm = target.read(names["norm"])  # [H]
    lm_head = embed.clone() if names["lm_head"] is None else target.read(names["lm_head"])  # [V, H]
    V, H = embed.shape
    if lm_head.shape != (V, H) or norm.shape != (H,):
        raise ValueError(
            f"{target.path}: inconsistent shapes: embed {tuple(embed.shape)}, lm_head {tuple(lm_head.shape)}, "
            f"norm {tuple(norm.shape)}"
        )
    if V != target.vocab_rows:
        raise ValueError(f"{target.path}: the embedding has {V} rows but config.json says vocab_size "
                         f"{target.vocab_rows}")
    try:
        target_ids = check_vocab_map(d2t, t2d, V)
    except ValueError as e:
        raise ValueError(f"{vocab_file}: {e}") from None
    return {
        "embed_tokens": embed.contiguous(),
        "norm": norm.contiguous(),
        "lm_head": lm_head.contiguous(),
        "lm_head_draft": lm_head[target_ids].contiguous(),  # [Vd, H], rows of the draft vocab
        "d2t": d2t.contiguous(),
        "t2d": t2d.contiguous(),
    }


def _manifest(target: Target, names: dict[str, str | None], tensors: dict[str, torch.Tensor], fp: dict,
              prepared_dir: str | Path, vocab_file: str, sha256: str) -> VerifierWeights:
    """The stage's manifest: each tensor's shape, dtype and source, and the hash of every target file read."""
    wmap = target.weight_map
    used = {"config.json"} | {wmap[n] for n in names.values() if n is not None}
    if (target.path / INDEX).is_file():
        used.add(INDEX)
    source_files = {f: sha256_file(target.path / f) for f in sorted(used)}
    source = {
        "embed_tokens": names["embed_tokens"],
        "norm": names["norm"],
        "lm_head": names["lm_head"] or f"{names['embed_tokens']} (tied)",
        "lm_head_draft": "lm_head rows arange(Vd) + d2t",
        "d2t": f"{vocab_file} (prepare)",
        "t2d": f"{vocab_file} (prepare)",
    }
    V, H = tensors["embed_tokens"].shape
    return VerifierWeights(
        config={"model": str(target.path), "prepared": str(prepared_dir)},
        inputs=fp,
        model_dir=str(target.path),
        architecture=target.architecture,
        file=OUT_FILE,
        sha256=sha256,
        tensors={
            k: TensorInfo(shape=list(v.shape), dtype=str(v.dtype).removeprefix("torch."), source=source[k])
            for k, v in tensors.items()
        },
        source_files=source_files,
        tied_embeddings=names["lm_head"] is None,
        hidden_size=H,
        vocab_size=V,
        draft_vocab_size=int(tensors["d2t"].shape[0]),
        rms_norm_eps=float(target.text.get("rms_norm_eps", 1e-6)),
    )
