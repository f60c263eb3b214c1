"""Checkpoints that resume a run exactly: model, optimizer, scheduler, data position, RNG, config.

Layout: <out>/checkpoints/step-00000123/{model.safetensors, state.pt, meta.json}. A checkpoint is
built in a temp dir and renamed into place, and `meta.json` (with the sha256 of the other two
files) is written last inside it, so a directory without a valid meta.json is never loaded.

No pickled Python object is ever read back: `state.pt` (optimizer, scheduler, data position, RNG)
holds only tensors and plain containers of numbers and strings, and is loaded with
`torch.load(weights_only=True)`, whose unpickler builds nothing else. A run dir may be shared by
many people; a full unpickler would run the code a tampered `state.pt` carries, as the trainer
(rewriting meta.json's checksum is no obstacle to whoever can write the dir).
"""
from __future__ import annotations

import json
import logging
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from eagle3.storage.atomic import atomic_dir, atomic_write_json, write_safetensors, write_torch
from eagle3.storage.hashing import sha256_file, sha256_file_cached

log = logging.getLogger("eagle3.train")

CKPT_DIR = "checkpoints"
BEST = "best"
# 2: state.pt holds tensors and plain containers only (format 1 pickled numpy's RNG state)
FORMAT = 2


def rng_state() -> dict[str, Any]:
    """Every RNG the trainer may draw from, as tensors and numbers (nothing weights_only refuses)."""
    version, mt, gauss = random.getstate()  # (3, 625 ints: Mersenne Twister words + position, float | None)
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # ('MT19937', uint32 [624], int, int, float)
    s = {"python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss},
         "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
         "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    py, nps = s["python"], s["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    np.random.set_state((nps["kind"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached_gaussian"]))
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


_PLAIN = (torch.Tensor, int, float, str, bool, type(None))


def _plain(x: Any, where: str = "state") -> None:
    """Refuse to write what weights_only cannot read back: only tensors, numbers, strings, None and
    dicts / lists / tuples of them (a checkpoint that cannot be resumed is found at save time)."""
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} of type {type(k).__name__} in a checkpoint")
            _plain(v, f"{where}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _plain(v, f"{where}[{i}]")
    elif not isinstance(x, _PLAIN):
        raise TypeError(f"{where}: a {type(x).__module__}.{type(x).__name__} in a checkpoint; store tensors, "
                        f"numbers or strings (the file is read with weights_only=True)")


def save(root: Path, name: str, model_state: dict[str, torch.Tensor], state: dict[str, Any],
         meta: dict[str, Any]) -> Path:
    """Write checkpoint `name` under root/checkpoints atomically; returns its dir."""
    base = root / CKPT_DIR
    base.mkdir(parents=True, exist_ok=True)
    final = base / name
    _plain(state)
    with atomic_dir(final) as tmp:
        write_safetensors(tmp / "model.safetensors", {k: v.contiguous() for k, v in model_state.items()})
        write_torch(tmp / "state.pt", state)
        meta = dict(meta, format=FORMAT, files={f: sha256_file(tmp / f) for f in ("model.safetensors", "state.pt")})
        atomic_write_json(tmp / "meta.json", meta)
    return final


def problem(d: Path, rehash: bool = False) -> str | None:
    """Why checkpoint dir `d` is unusable (naming the file), or None: complete, checksums match
    (hashed once per file identity on this host; `rehash` reads every byte again)."""
    m = d / "meta.json"
    if not m.is_file():
        return f"{m} is missing (an unfinished save)"
    try:
        meta = json.loads(m.read_text())
        for f, h in meta["files"].items():
            if sha256_file_cached(d / f, rehash) != h:
                return f"{d / f} does not match its checksum in meta.json (corrupt or truncated)"
    except (OSError, ValueError, KeyError) as e:
        return f"{d}: unreadable ({e})"
    return None


def step_dirs(root: Path) -> list[Path]:
    base = root / CKPT_DIR
    return sorted(p for p in base.glob("step-*") if p.is_dir()) if base.is_dir() else []


def latest(root: Path) -> Path | None:
    """Newest valid step checkpoint; a corrupt newer one is skipped with a warning that names it."""
    for d in reversed(step_dirs(root)):
        why = problem(d)
        if why is None:
            return d
        log.warning("checkpoint %s skipped: %s", d.name, why)
    return None


def load(d: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, state, meta) of checkpoint dir `d`. ValueError, in one line naming the file, for a
    checkpoint of another format or a state.pt that carries pickled objects (never executed)."""
    meta = json.loads((d / "meta.json").read_text())
    if meta.get("format", 1) != FORMAT:
        raise ValueError(f"{d}: checkpoint format {meta.get('format', 1)}, this eagle3 reads format {FORMAT} "
                         f"(no pickled objects); resume it with the eagle3 that wrote it, or delete {d.parent} "
                         f"to start over")
    try:
        state = torch.load(d / "state.pt", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{d / 'state.pt'}: refused, it carries pickled Python objects ({_global(e)}); eagle3 "
                         f"never runs code from a run dir: delete this checkpoint if you did not write it") from None
    return load_file(str(d / "model.safetensors")), state, meta


def _global(e: Exception) -> str:
    """The line of torch's (multi-line) weights_only error that names the refused global."""
    lines = [ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln]
    return lines[0].rstrip(".") if lines else "not loadable with weights_only=True"


def prune(root: Path, keep: int) -> None:
    """Keep the newest `keep` step checkpoints (the best one lives apart, under `best`)."""
    base = root / CKPT_DIR
    for p in base.glob(".*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
    for d in step_dirs(root)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def clear(root: Path, also: list[str]) -> None:
    """Remove every checkpoint and the named run files (a run of other inputs)."""
    shutil.rmtree(root / CKPT_DIR, ignore_errors=True)
    for name in also:
        p = root / name
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.unlink()
