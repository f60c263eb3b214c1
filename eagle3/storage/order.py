"""The order the trainer reads samples in: whole documents packed into rows, shuffled per epoch.

Each epoch shuffles the sample order with (seed, epoch), then packs greedily in that order into
rows of at most `pack_tokens` tokens (a longer sample is cut to `pack_tokens`). The pack list is
a pure function of (lengths, seed, epoch, pack_tokens), so a resumed run rebuilds it exactly and
skips to its saved position, and an online producer (eagle3.storage.spool) knows, before the
trainer starts, which samples each optimizer step will read.

Optimizer step s of an epoch consumes packs [s*G, (s+1)*G), G = world * grad_accum; rank r takes
micro-batches s*G + a*world + r for a in range(grad_accum). With the same G, 1 process x 2
micro-batches and 2 processes x 1 see the same packs per step. The last global batch of an
epoch is filled by wrapping around to the first packs (torch's DistributedSampler does the same).
"""
from __future__ import annotations

from typing import Sequence

import torch


def pack(lengths: Sequence[int], order: Sequence[int], pack_tokens: int) -> list[list[int]]:
    """Greedy packing in `order`: a new row starts when the next sample would overflow."""
    rows: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        n = min(int(lengths[i]), pack_tokens)
        if cur and used + n > pack_tokens:
            rows.append(cur)
            cur, used = [], 0
        cur.append(int(i))
        used += n
    if cur:
        rows.append(cur)
    return rows


def epoch_packs(lengths: Sequence[int], seed: int, epoch: int, pack_tokens: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    return pack(lengths, order, pack_tokens)


def steps_per_epoch(n_packs: int, world: int, grad_accum: int) -> int:
    G = world * grad_accum
    return -(-n_packs // G)


def micro_packs(packs: list[list[int]], step: int, rank: int, world: int, grad_accum: int) -> list[list[int]]:
    """The packs rank `rank` trains on in optimizer step `step` of the epoch."""
    G = world * grad_accum
    return [packs[(step * G + a * world + rank) % len(packs)] for a in range(grad_accum)]


def val_packs(lengths: Sequence[int], seed: int, pack_tokens: int, max_packs: int | None) -> list[list[int]]:
    """The packs every validation reads: one fixed shuffle (epoch -1), the first `max_packs` of them (all: None).
    The trainer validates on them and an online producer keeps exactly their samples."""
    return epoch_packs(lengths, seed, -1, pack_tokens)[:max_packs]
