"""Training data: stored hidden states packed into rows of whole documents, no padding.

Each epoch shuffles the sample order with (seed, epoch), then packs greedily in that order into
rows of at most `pack_tokens` tokens (a longer sample is cut to `pack_tokens`). The pack list is
a pure function of (lengths, seed, epoch, pack_tokens), so a resumed run rebuilds it exactly and
skips to its saved position.

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


def collate(store, idx: list[int], pack_tokens: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One packed row [1, L] from samples `idx` of a hidden-state store.

    Returns input_ids, loss_mask, position_ids (restart at 0 per document), doc (document index
    within the row), aux [1, L, 3, H] and final [1, L, H] as fp32.
    """
    ids, mask, pos, doc, aux, fin = [], [], [], [], [], []
    for j, i in enumerate(idx):
        s = store[i]
        n = min(len(s["input_ids"]), pack_tokens)
        ids.append(torch.as_tensor(s["input_ids"][:n]).long())
        mask.append(torch.as_tensor(s["loss_mask"][:n]).long())
        pos.append(torch.arange(n))
        doc.append(torch.full((n,), j, dtype=torch.long))
        aux.append(s["aux_hidden_states"][:n].float())
        fin.append(s["final_hidden_states"][:n].float())
    out = {
        "input_ids": torch.cat(ids)[None],
        "loss_mask": torch.cat(mask)[None],
        "position_ids": torch.cat(pos)[None],
        "doc": torch.cat(doc)[None],
        "aux": torch.cat(aux)[None],
        "final": torch.cat(fin)[None],
    }
    return {k: v.to(device) for k, v in out.items()}
