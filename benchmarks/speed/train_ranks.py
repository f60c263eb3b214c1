"""The trainer on one CPU host: one process on every core against one process per core (torchrun, gloo DDP, one
thread each), on a real extracted store, run in turn in fresh processes.

On a 2-core host two one-thread processes run torch's kernels faster together than one process runs them on two
threads (small matrices scale poorly across threads; `python -m benchmarks.speed.probe` shows the same for the
forward and the decode). A DDP step of two ranks x one pack of P/2 tokens reads as many tokens as one pack of P,
in as many optimizer steps, so it keeps the one-process run's schedule.

    .venv/bin/python -m benchmarks.speed.train_ranks --hidden runs/demo/extract --verifier runs/demo/verifier \
        [--config examples/smollm2-sharegpt.yaml] [--steps 40] [--rounds 1]

Each setting trains the preset's train section for --steps optimizer steps (no replay set, no validation or
checkpoint before the end) into its own temp dir. Prints each setting's train tokens/s per logged window
(metrics.jsonl, 10 steps each) and their median past the first window; last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

SETTINGS = {  # name -> train overrides
    "1 proc x 2 threads, pack 2048": {"nproc_per_node": 1, "threads": None, "pack_tokens": 2048},
    "2 procs x 1 thread, pack 1024": {"nproc_per_node": 2, "threads": 1, "pack_tokens": 1024},
}


def run(hidden: str, verifier: str, cfg, steps: int, over: dict) -> dict:
    from eagle3.train.launch import command

    tc = cfg.train.model_copy(update={"max_steps": steps, "val_every": 10 * steps, "ckpt_every": 10 * steps,
                                      "replay_prompts": 0, "log_every": 10, **over})
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        # torchrun for both, so both pay the same start-up
        subprocess.run(command(hidden, verifier, out, tc), check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - t0
        recs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in recs if r.get("split") == "train"]
    return {"tokens_per_s": [round(x, 1) for x in rates], "median": round(statistics.median(rates[1:] or rates), 1),
            "wall_s": round(wall, 1)}


def main() -> None:
    from eagle3.config import PipelineConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", required=True)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "examples/smollm2-sharegpt.yaml"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    cfg = PipelineConfig.from_file(a.config)
    res: dict[str, list[dict]] = {k: [] for k in SETTINGS}
    for _ in range(a.rounds):
        for name, over in SETTINGS.items():
            r = run(a.hidden, a.verifier, cfg, a.steps, over)
            res[name].append(r)
            print(f"{name}: median {r['median']:,.0f} tok/s, windows {r['tokens_per_s']}, wall {r['wall_s']} s",
                  flush=True)
    base = statistics.median(r["median"] for r in res[next(iter(SETTINGS))])
    summary = {k: {"median_tokens_per_s": statistics.median(r["median"] for r in v),
                   "ratio": round(statistics.median(r["median"] for r in v) / base, 3), "runs": v}
               for k, v in res.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
