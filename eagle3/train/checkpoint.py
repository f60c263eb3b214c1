"""Checkpoints that resume a run exactly: model, optimizer, scheduler, data position, RNG, config.

Layout: <out>/checkpoints/step-00000123/{model.safetensors, state.pt, meta.json}. A checkpoint is
built in a temp dir and renamed into place, and `meta.json` (with the sha256 of the other two
files) is written last inside it, so a directory without a valid meta.json is never loaded.
"""
from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3.atomic import atomic_dir, atomic_write_json, sha256_file

log = logging.getLogger("eagle3.train")

CKPT_DIR = "checkpoints"
BEST = "best"


def rng_state() -> dict[str, Any]:
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save(root: Path, name: str, model_state: dict[str, torch.Tensor], state: dict[str, Any], meta: dict[str, Any]) -> Path:
    """Write checkpoint `name` under root/checkpoints atomically; returns its dir."""
    base = root / CKPT_DIR
    base.mkdir(parents=True, exist_ok=True)
    final = base / name
    with atomic_dir(final) as tmp:
        save_file({k: v.contiguous() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
        torch.save(state, tmp / "state.pt")
        meta = dict(meta, files={f: sha256_file(tmp / f) for f in ("model.safetensors", "state.pt")})
        atomic_write_json(tmp / "meta.json", meta)
    return final


def problem(d: Path) -> str | None:
    """Why checkpoint dir `d` is unusable (naming the file), or None: complete, checksums match."""
    m = d / "meta.json"
    if not m.is_file():
        return f"{m} is missing (an unfinished save)"
    try:
        meta = json.loads(m.read_text())
        for f, h in meta["files"].items():
            if sha256_file(d / f) != h:
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
    meta = json.loads((d / "meta.json").read_text())
    return load_file(str(d / "model.safetensors")), torch.load(d / "state.pt", weights_only=False), meta


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
