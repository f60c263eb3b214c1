"""Effect of the draft's norm switches (norm_before_fc, norm_output) on simulated acceptance.

Prepares and extracts a slice of real ShareGPT with SmolLM2 once (cached in --work), then trains
one draft per switch setting with identical data, seed and budget, and prints the validation
simulated tau and per-step top-1 of each. Last line: one JSON object.

    .venv/bin/python benchmarks/norm_switches.py [--limit 150] [--max-len 512] [--epochs 2] [--k 3]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/eagle3-norm-switches")
    ap.add_argument("--limit", type=int, default=150)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    from eagle3.assets import materialize_smollm2
    from eagle3.config import ExtractConfig, PrepareConfig, TrainConfig
    from eagle3.data.prepare import prepare
    from eagle3.extract import run_extract
    from eagle3.train.loop import train
    from eagle3.verifier import extract_verifier

    w = Path(a.work)
    model = materialize_smollm2(REPO / "assets" / "smollm2")
    prepare(model, w / "prepare", PrepareConfig(data="sharegpt", limit=a.limit, max_len=a.max_len,
                                                draft_vocab=a.draft_vocab, val_fraction=0.1), progress=False)
    run_extract(model, w / "prepare", w / "extract", ExtractConfig(), show_progress=False)
    extract_verifier(model, w / "prepare", w / "verifier")
    results = {}
    for fc, out in itertools.product([True, False], [True, False]):
        name = f"norm_before_fc={fc},norm_output={out}"
        cfg = TrainConfig(ttt_steps=a.k, epochs=a.epochs, pack_tokens=2048, lr=a.lr, warmup_steps=5,
                          norm_before_fc=fc, norm_output=out, val_every=10_000, ckpt_every=10_000,
                          threads=a.threads)
        t0 = time.perf_counter()
        m = train(cfg, w / "extract", w / "verifier", w / f"train-{int(fc)}{int(out)}", progress=False)
        v = m.val
        results[name] = {"sim_tau": round(m.best_sim_tau, 4), "val_acc": [round(x, 4) for x in v["acc"]],
                         "val_loss": round(v["loss"], 4), "steps": m.steps, "seconds": round(time.perf_counter() - t0)}
        print(f"{name}: sim tau {m.best_sim_tau:.4f}, val top-1 {results[name]['val_acc']}, "
              f"{m.steps} steps in {results[name]['seconds']} s", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
