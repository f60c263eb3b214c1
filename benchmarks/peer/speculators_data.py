"""Hand eagle3's prepared and extracted data to speculators, so its trainer reads the very tokens, masks and hidden
states eagle3's trainer reads (the peer row of benchmarks/experiments/levers.py).

Runs in eagle3's venv (it reads eagle3's store). Writes, under --out:
- hidden_states/hs_{i}.safetensors: `hidden_states` [T, n_aux + 1, H] (the aux layers in order, then the last
  layer before the final norm, as speculators' vLLM extraction stores them), bf16 (speculators' default dtype for
  stored states), and `token_ids` [T] int64;
- samples.parquet: one row per sample, in the same order: sample_id, input_ids, loss_mask, seq_len (speculators'
  dataset columns; benchmarks/peer/speculators_train.py turns it into its Arrow dataset);
- d2t.npy / t2d.npy: the prepared draft vocabulary (d2t int64 offsets, target = draft + d2t[draft]; t2d bool over
  the target vocab), the layout both tools share;
- meta.json: the aux layer ids, the sample and token counts.

The train split comes first, then the val split: speculators holds out the tail of its dataset for validation
(meta.json's `train_samples` gives the boundary), so both tools train on the same samples and validate on the same
held-out ones. Files are written temp-then-rename, and a finished dir (meta.json present) is left as it is.

    .venv/bin/python -m benchmarks.peer.speculators_data --prepare runs/demo/prepare --extract runs/demo/extract \\
        --out runs/peer/data
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", type=Path, required=True)
    ap.add_argument("--extract", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if (a.out / "meta.json").is_file():
        print(f"{a.out}: already written")
        return
    write(a.prepare, a.extract, a.out)


def write(prepare: Path, extract: Path, out: Path) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from eagle3.data.vocab import load_maps
    from eagle3.prepare.run import VOCAB_FILE
    from eagle3.storage.atomic import atomic_path, atomic_write_json, write_safetensors
    from eagle3.storage.store import open_store

    stores = [open_store(extract, "train"), open_store(extract, "val")]
    hs = out / "hidden_states"
    hs.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"sample_id": [], "input_ids": [], "loss_mask": [], "seq_len": []}
    tokens = 0
    samples = ((store, j) for store in stores for j in range(len(store)))
    for i, (store, j) in enumerate(samples):
        s = store[j]
        ids = s["input_ids"].to(torch.int64).contiguous()  # [T]
        states = torch.cat([s["aux_hidden_states"], s["final_hidden_states"][:, None]], dim=1)  # [T, n_aux + 1, H]
        path = hs / f"hs_{i}.safetensors"
        if not path.is_file():
            with atomic_path(path) as tmp:
                write_safetensors(tmp, {"hidden_states": states.to(torch.bfloat16).contiguous(), "token_ids": ids})
        rows["sample_id"].append(s["sample_id"])
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(s["loss_mask"].to(torch.bool).tolist())
        rows["seq_len"].append(len(ids))
        tokens += len(ids)
    d2t, t2d = load_maps(prepare / VOCAB_FILE)
    for name, arr in (("d2t", d2t.numpy().astype(np.int64)), ("t2d", t2d.numpy().astype(bool))):
        with atomic_path(out / f"{name}.npy") as tmp, open(tmp, "wb") as f:
            np.save(f, arr)
    with atomic_path(out / "samples.parquet") as tmp:
        pq.write_table(pa.table(rows), tmp)
    meta = {"samples": len(rows["seq_len"]), "train_samples": len(stores[0]), "tokens": tokens,
            "train_tokens": sum(stores[0].lengths), "aux_layer_ids": list(stores[0].aux_layer_ids),
            "draft_vocab": len(d2t), "source": {"prepare": str(prepare), "extract": str(extract)}}
    atomic_write_json(out / "meta.json", meta)  # last: its presence marks the dir finished
    print(json.dumps(meta))
    return meta


if __name__ == "__main__":
    main()
