"""The prepared samples extraction reads: every split's token ids and loss masks, checked against the target's
vocabulary, in the order the shard plan cuts them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.storage.manifests import PreparedData


# ---------------------------------------------------------------- prepared samples
@dataclass
class Samples:
    """All prepared samples of the chosen splits, in manifest order (split, shard file, row)."""

    split: list[str]
    sample_id: list[str]
    input_ids: list[Any]  # pyarrow list scalars, materialized per shard
    loss_mask: list[Any]
    length: list[int]

    def tensors(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(self.input_ids[row].values.to_numpy(zero_copy_only=False), dtype=torch.int64)
        mask = torch.tensor(self.loss_mask[row].values.to_numpy(zero_copy_only=False), dtype=torch.int8)
        return ids, mask



def load_samples(prepared_dir: str | Path, prep: PreparedData, splits: Sequence[str],
                 rows: int | None = None) -> Samples:
    """The prepared samples of `splits`, each shard checked against its checksum, each sample's ids against its
    mask and, given the target's embedding `rows`, every id against them: an id the target has no row for
    would fail deep in its forward pass (or read another row on an engine), so it is refused here, by record."""
    import pyarrow.compute as pc

    from eagle3.storage.shards import read_shard

    s = Samples([], [], [], [], [])
    for split in splits:
        if split not in prep.splits:
            continue  # e.g. no val split in a tiny dataset
        for info in prep.splits[split]:
            path = Path(prepared_dir) / info.file
            t = read_shard(prepared_dir, info, columns=["sample_id", "input_ids", "loss_mask"])
            n_ids = pc.list_value_length(t["input_ids"]).to_pylist()
            n_mask = pc.list_value_length(t["loss_mask"]).to_pylist()
            sids = t["sample_id"].to_pylist()
            for sid, a, b in zip(sids, n_ids, n_mask, strict=True):
                if not a or a != b:
                    raise ValueError(f"{path}: sample {sid}: {a} input ids but {b} loss-mask values")
            if rows is not None and t.num_rows:
                lo, hi = pc.min_max(pc.list_flatten(t["input_ids"])).values()
                if lo.as_py() < 0 or hi.as_py() >= rows:
                    bad = next(i for i, ids in enumerate(t["input_ids"].to_pylist())
                               if min(ids) < 0 or max(ids) >= rows)
                    ids = t["input_ids"][bad].as_py()
                    tok = next(x for x in ids if x < 0 or x >= rows)
                    raise ValueError(f"{path}: sample {sids[bad]}: token id {tok} is outside the target's {rows} "
                                     "embedding rows (prepared with another tokenizer or model?)")
            s.split += [split] * t.num_rows
            s.sample_id += sids
            s.input_ids += list(t["input_ids"])
            s.loss_mask += list(t["loss_mask"])
            s.length += n_ids
    if not s.sample_id:
        raise ValueError(f"{prepared_dir}: no samples in splits {list(splits)}")
    return s



def check_engine_length(samples: Samples, limit: int) -> None:
    """vLLM refuses a prompt (and an engine whose max_model_len is) past the model's context: say so up
    front, naming the samples, instead of failing after the engine started. +1: the one sampled token."""
    over = [(sid, n) for sid, n in zip(samples.sample_id, samples.length, strict=True) if n + 1 > limit]
    if over:
        named = (", ".join(f"{sid} ({n} tokens)" for sid, n in over[:5])
                 + (f" and {len(over) - 5} more" if len(over) > 5 else ""))
        raise ValueError(
            f"extract --backend vllm: {len(over)} sample(s) longer than the engine allows "
            f"(max_position_embeddings {limit}, one position kept for the sampled token): {named}; "
            "prepare with a smaller max_len"
        )
