"""Effect of the draft's norm switches (norm_before_fc, norm_output) on simulated acceptance.

Prepares and extracts a slice of real ShareGPT with SmolLM2 once (cached in --work), or reuses
existing stages (--hidden/--verifier, e.g. a demo run's), then trains one draft per setting of
(norm_before_fc, norm_output) with identical data, seed and budget, plus one run flipping
norm_before_residual on the best of the four, and prints the validation simulated tau and
per-step top-1 of each. Last line: one JSON object.

    .venv/bin/python -m benchmarks.experiments.norm_switches [--limit 150] [--max-len 512] [--epochs 2] [--k 3]
    .venv/bin/python -m benchmarks.experiments.norm_switches --hidden runs/demo/extract --verifier runs/demo/verifier \\
        --max-steps 80
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
    ap.add_argument("--max-steps", type=int, default=None, help="optimizer steps per run (default: --epochs)")
    ap.add_argument("--hidden", help="reuse this extract dir instead of preparing + extracting")
    ap.add_argument("--verifier", help="the verifier dir that goes with --hidden")
    a = ap.parse_args()
    from eagle3.assets import materialize_smollm2
    from eagle3.config import ExtractConfig, PrepareConfig, TrainConfig
    from eagle3.extract import run_extract
    from eagle3.prepare import prepare
    from eagle3.train.loop import train
    from eagle3.verifier import extract_verifier

    w = Path(a.work)
    if a.hidden:
        hidden, verifier = Path(a.hidden), Path(a.verifier)
    else:
        model = materialize_smollm2(REPO / "assets" / "smollm2")
        prepare(model, w / "prepare", PrepareConfig(data="sharegpt", limit=a.limit, max_len=a.max_len,
                                                    draft_vocab=a.draft_vocab, val_fraction=0.1), progress=False)
        run_extract(model, w / "prepare", w / "extract", ExtractConfig(), show_progress=False)
        extract_verifier(model, w / "prepare", w / "verifier")
        hidden, verifier = w / "extract", w / "verifier"
    results = {}

    def run(fc: bool, out: bool, res: bool) -> float:
        name = f"norm_before_fc={fc},norm_output={out},norm_before_residual={res}"
        cfg = TrainConfig(ttt_steps=a.k, epochs=a.epochs, max_steps=a.max_steps, pack_tokens=2048, lr=a.lr,
                          warmup_steps=5, norm_before_fc=fc, norm_output=out, norm_before_residual=res,
                          val_every=10_000, ckpt_every=10_000, threads=a.threads)
        t0 = time.perf_counter()
        m = train(cfg, hidden, verifier, w / f"train-{int(fc)}{int(out)}{int(res)}", progress=False)
        v = m.val
        results[name] = {"sim_tau": round(m.best_sim_tau, 4), "val_acc": [round(x, 4) for x in v["acc"]],
                         "val_loss": round(v["loss"], 4), "steps": m.steps, "seconds": round(time.perf_counter() - t0)}
        print(f"{name}: sim tau {m.best_sim_tau:.4f}, val top-1 {results[name]['val_acc']}, "
              f"{m.steps} steps in {results[name]['seconds']} s", flush=True)
        return m.best_sim_tau

    res0 = TrainConfig().norm_before_residual
    taus = {(fc, out): run(fc, out, res0) for fc, out in itertools.product([True, False], [True, False])}
    fc, out = max(taus, key=taus.get)
    run(fc, out, not res0)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
