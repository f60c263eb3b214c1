"""Extraction over 2 workers against 1 on this host: SmolLM2, real ShareGPT, the hf backend.

Runs, in this order, in one invocation (so both see the same machine):
- one worker: `eagle3 extract` with every core (torch's default threads);
- two workers: `eagle3 extract --workers 2 --part 0` and `--part 1` as two processes at once, one thread each
  (two hosts' worth of work sharing this host's cores), then `--commit`.

Prints
- equal: whether the committed store's shards, index and manifest fingerprint are the one worker's, byte for byte
  (fp32 states: the hf backend's batches are cut per shard, so each shard's bytes follow from its samples);
- wall_ratio: the two workers' wall time (both ranges and the commit) / the one worker's. On a 2-core host the
  two workers share the cores the one worker had, so this is their overhead, not a speedup; on N hosts the
  ranges run on N hosts' devices (the preflight plans that);
- commit_s: the commit's own wall time (renames, index, manifest: no shard is copied or read).
Last line: one JSON object.

    .venv/bin/python -m benchmarks.speed.extract_workers [--limit 120] [--max-len 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3.assets import materialize_smollm2
from eagle3.config import PrepareConfig
from eagle3.prepare import prepare
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import HiddenStates

REPO = Path(__file__).resolve().parents[2]


def extract(model: Path, prep: Path, out: Path, *extra: str, threads: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "eagle3.cli", "extract", "--model", str(model), "--prepared", str(prep),
           "--out", str(out), "--storage", "fp32", "--shard-bytes", str(16 << 20), *extra]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> None:
    err = p.communicate()[1]
    if p.returncode:
        raise SystemExit(f"eagle3 extract failed ({p.returncode}): {err[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=120)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    a = ap.parse_args()
    model = materialize_smollm2(a.model) if Path(a.model).name == "smollm2" else Path(a.model)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prep = tmp / "prep"
        prepare(model, prep, PrepareConfig(data="sharegpt", limit=a.limit, max_len=a.max_len), progress=False)

        t0 = time.perf_counter()
        finish(extract(model, prep, tmp / "one"))
        one_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        ranges = [extract(model, prep, tmp / "two", "--workers", "2", "--part", str(k), threads=1) for k in (0, 1)]
        for p in ranges:
            finish(p)
        t1 = time.perf_counter()
        finish(extract(model, prep, tmp / "two", "--workers", "2", "--commit"))
        two_s, commit_s = time.perf_counter() - t0, time.perf_counter() - t1

        one, two = HiddenStates.read(tmp / "one"), HiddenStates.read(tmp / "two")
        equal = ([(s.file, s.sha256) for s in one.shards] == [(s.file, s.sha256) for s in two.shards]
                 and one.fingerprint == two.fingerprint
                 and sha256_file(tmp / "one" / "index.parquet") == sha256_file(tmp / "two" / "index.parquet")
                 and all(sha256_file(tmp / "two" / s.file) == s.sha256 for s in two.shards))
        res = {"host": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "conversations": a.limit, "tokens": one.num_tokens, "shards": len(one.shards), "equal": equal,
               "one_worker_s": round(one_s, 1), "two_workers_s": round(two_s, 1), "commit_s": round(commit_s, 1),
               "wall_ratio": round(two_s / one_s, 3),
               "range_tok_per_s": [r["tokens_per_second"] for r in two.stats["ranges"]],
               "one_worker_tok_per_s": one.stats["tokens_per_second"]}
        print(f"equal {equal}; 1 worker {one_s:.1f} s, 2 workers {two_s:.1f} s (commit {commit_s:.1f} s): "
              f"wall ratio {res['wall_ratio']:.3f} ({one.num_tokens:,} tokens, {len(one.shards)} shards)")
        print(json.dumps(res))


if __name__ == "__main__":
    main()
