"""Every linear layer of SmolLM2-135M (210 + the tied lm_head), one pass per row count, per kernel.

The kernels: stock (torch's F.linear on the [out, in] weight, MKL sgemm), gemv (`x @ W^T` on a
contiguous transposed copy) and onednn (`eagle3.decoding.cpu_linear.PackedLinear`, oneDNN-prepacked weight).
Rows 1..6 are a decode step (1) and verify passes (k+1); 16-64 batched decoding; 400 a prefill.
Printed: median ms of `--repeats` passes per (rows, kernel), the kernels timed alternately so that
load hits each alike, and each kernel's ratio to stock at that row count. What matters for
speculative decoding is the verify cost against a 1-row step: the row "vs 1 row" prints it per kernel.
Last line: one JSON object.

    .venv/bin/python -m benchmarks.speed.cpu_linear [--threads 1] [--rows 1,2,3,4,5,6,16,32,64,400] [--repeats 9]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from eagle3.decoding.cpu_linear import PackedLinear, available
from eagle3.model.target import Target

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,3,4,5,6,16,32,64,400")
    ap.add_argument("--repeats", type=int, default=9)
    a = ap.parse_args()
    if not available():
        sys.exit("this torch build has no oneDNN linear ops (torch.ops.mkldnn._linear_pointwise)")
    torch.set_num_threads(a.threads)
    model = Target.open(a.model).load_model(head=True, device="cpu")
    lins = [m for m in model.modules() if type(m) is torch.nn.Linear]
    packed = [PackedLinear(m) for m in lins]
    res = {"model": a.model, "layers": len(lins), "threads": a.threads, "loadavg_start": os.getloadavg()[0], "ms": {}}
    for rows in map(int, a.rows.split(",")):
        xs = {n: torch.randn(rows, n) for n in {m.in_features for m in lins}}
        for p in packed:
            p.kernel_for = {rows: "gemv"}
        kernels = {
            "stock": lambda xs=xs: [m(xs[m.in_features]) for m in lins],
            "gemv": lambda xs=xs: [p(xs[p.linear.in_features]) for p in packed],
            "onednn": lambda xs=xs: [
                torch.ops.mkldnn._linear_pointwise(xs[p.linear.in_features], p.packed, None, "none", [], "")
                for p in packed
            ],
        }
        if rows > 8:
            del kernels["gemv"]  # a GEMV per row would re-read every weight `rows` times
        ts: dict[str, list[float]] = {k: [] for k in kernels}
        with torch.inference_mode():
            for i in range(a.repeats + 1):
                for name, fn in kernels.items():
                    t = time.perf_counter()
                    fn()
                    if i:  # pass 0 warms caches and oneDNN's primitive cache
                        ts[name].append(time.perf_counter() - t)
        ms = {k: round(1000 * sorted(v)[len(v) // 2], 2) for k, v in ts.items()}
        res["ms"][rows] = ms
        print(f"rows {rows:4d}  " + "  ".join(f"{k} {v:8.2f} ms ({v / ms['stock']:.2f}x stock)" for k, v in ms.items()),
              flush=True)
    print_verify_ratios(res["ms"])
    print(json.dumps(res | {"loadavg_end": os.getloadavg()[0]}))


def print_verify_ratios(ms: dict[int, dict[str, float]]) -> None:
    """A verify pass of 2-6 rows against a 1-row step: stock vs stock, and packed vs the fastest 1-row kernel."""
    one = ms.get(1)
    for rows, m in ms.items():
        if one and 2 <= rows <= 6:
            print(f"vs 1 row   rows {rows}: stock {m['stock'] / one['stock']:.2f}x a stock 1-row pass; "
                  f"onednn {m['onednn'] / min(one.values()):.2f}x the fastest 1-row pass", flush=True)


if __name__ == "__main__":
    main()
