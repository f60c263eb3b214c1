"""Prepare throughput on real data: 2,000 ShareGPT conversations with the SmolLM2 tokenizer.

Prints conversations/s and tokens/s of `eagle3 prepare` (end to end: read, normalize, render,
batched fast tokenization, mask, Parquet, vocab map), and, side by side in the same process,
a naive baseline that calls `apply_chat_template(tokenize=True)` once per conversation
(no mask at all), so the ratio is robust to machine noise. Last line: one JSON object.

    .venv/bin/python -m benchmarks.speed.prepare [--limit 2000] [--model assets/smollm2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from eagle3.assets import materialize_smollm2
from eagle3.config import PrepareConfig
from eagle3.data.normalize import conversations
from eagle3.data.readers import ReadStats, iter_source, resolve_source
from eagle3.model.target import Target
from eagle3.prepare import prepare

REPO = Path(__file__).resolve().parents[2]


def naive(model: Path, limit: int, max_len: int) -> tuple[float, int, int]:
    tok = Target.open(model).tokenizer()
    t0, n, toks = time.perf_counter(), 0, 0
    for _, msgs in conversations(iter_source(resolve_source("sharegpt"), ReadStats())):
        if n >= limit:
            break
        n += 1
        if msgs is None:
            continue
        ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"][:max_len]
        toks += len(ids)
    return time.perf_counter() - t0, n, toks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=2000)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    a = ap.parse_args()
    model = materialize_smollm2(a.model) if Path(a.model).name == "smollm2" else Path(a.model)
    cfg = PrepareConfig(data="sharegpt", limit=a.limit, max_len=a.max_len)
    with tempfile.TemporaryDirectory() as tmp:
        Target.open(model).tokenizer()  # warm the file cache for both contenders
        t0 = time.perf_counter()
        m = prepare(model, Path(tmp) / "out", cfg, progress=False)
        dt = time.perf_counter() - t0
    bt, bn, btok = naive(model, a.limit, a.max_len)
    figs = {
        "conversations": m.records_read,
        "kept": m.records_kept,
        "tokens": m.num_tokens,
        "seconds": round(dt, 3),
        "conversations_per_s": round(m.records_read / dt, 1),
        "tokens_per_s": round(m.num_tokens / dt),
        "baseline_tokens_per_s": round(btok / bt),
        "speedup_vs_naive_apply_chat_template": round((m.num_tokens / dt) / (btok / bt), 2),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
    }
    print(f"prepare: {figs['conversations']} conversations ({figs['kept']} kept), {figs['tokens']:,} tokens "
          f"in {dt:.2f}s = {figs['conversations_per_s']} conv/s, {figs['tokens_per_s']:,} tok/s")
    print(f"naive per-conversation apply_chat_template (no mask): {figs['baseline_tokens_per_s']:,} tok/s "
          f"-> eagle3 is {figs['speedup_vs_naive_apply_chat_template']}x")
    print(json.dumps(figs))


if __name__ == "__main__":
    main()
