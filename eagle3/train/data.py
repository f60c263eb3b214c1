"""Training data: one packed row of whole documents from a hidden-state store, no padding.

Which samples go in which row, and in which step, is `eagle3.storage.order` (re-exported here).
"""
from __future__ import annotations

import torch

from eagle3.storage.order import epoch_packs, micro_packs, pack, steps_per_epoch, val_packs

__all__ = ["collate", "epoch_packs", "micro_packs", "pack", "steps_per_epoch", "val_packs"]


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
