"""The preflight's host probe (eagle3/probe.py): its raw rates, run by run, and this host's speed against
the reference host's, so the probe's own noise is seen next to what it measures.

    .venv/bin/python -m benchmarks.speed.probe [--runs 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    from eagle3.probe import REFERENCE, rates

    runs = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        r = rates()
        runs.append({**{k: round(v, 1) for k, v in r.items()}, "seconds": round(time.perf_counter() - t0, 2)})
        print(json.dumps(runs[-1]), flush=True)
    med = {k: statistics.median(r[k] for r in runs) for k in REFERENCE}
    spread = {k: round((max(r[k] for r in runs) - min(r[k] for r in runs)) / med[k], 3) for k in REFERENCE}
    print(json.dumps({"cpu": _cpu(), "loadavg": os.getloadavg()[0], "median": med, "spread": spread,
                      "speed_vs_reference": {k: round(med[k] / REFERENCE[k], 3) for k in REFERENCE}}))


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


if __name__ == "__main__":
    main()
