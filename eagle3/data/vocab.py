"""The draft vocabulary: the most frequent target tokens where loss_mask == 1.

Stored as vLLM reads it (its EAGLE-3 loader takes `d2t`; `t2d` is ignored there):
- d2t [Vd] int64 offsets, target_id = draft_id + d2t[draft_id];
- t2d [V] bool, True where a target id is in the draft vocab.
Draft ids are assigned in increasing target-id order, so d2t is non-negative and
non-decreasing, and t2d.nonzero() lists the same ids in the same order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3.storage.atomic import atomic_path


def select_draft_tokens(counts: np.ndarray, draft_vocab: int) -> np.ndarray:
    """Target ids of the draft vocab, ascending. counts: int64 [V] over loss-masked tokens.

    Ranked by count, ties (including never-seen tokens, used only when fewer than
    `draft_vocab` distinct tokens were seen) broken by lower id, so the choice is deterministic.
    """
    V = len(counts)
    if not 1 <= draft_vocab <= V:
        raise ValueError(f"draft vocab {draft_vocab} must be in [1, target vocab {V}]")
    order = np.lexsort((np.arange(V), -counts))  # primary: count desc; secondary: id asc
    return np.sort(order[:draft_vocab])


def build_maps(target_ids: np.ndarray, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.as_tensor(np.asarray(target_ids), dtype=torch.int64)
    d2t = ids - torch.arange(len(ids), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def check_maps(d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    """Raise ValueError unless d2t and t2d describe the same draft vocab."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"d2t must be int64 and t2d bool (got {d2t.dtype}, {t2d.dtype})")
    tgt = torch.arange(len(d2t)) + d2t
    if len(d2t) != int(t2d.sum()):
        raise ValueError(f"d2t has {len(d2t)} entries but t2d marks {int(t2d.sum())} target ids")
    if (tgt < 0).any() or (tgt >= len(t2d)).any():
        raise ValueError("d2t maps a draft id outside the target vocab")
    if not bool(t2d[tgt].all()) or not torch.equal(tgt, t2d.nonzero().flatten()):
        raise ValueError("d2t and t2d disagree: draft + d2t[draft] is not the ordered set t2d marks")


def save_maps(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    check_maps(d2t, t2d)
    with atomic_path(path) as tmp:
        save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp))


def load_maps(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(str(path))
    if "d2t" not in t or "t2d" not in t:
        raise ValueError(f"{path}: needs tensors `d2t` and `t2d` (has {sorted(t)})")
    check_maps(t["d2t"], t["t2d"])
    return t["d2t"], t["t2d"]
