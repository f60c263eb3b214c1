"""The longest silences of a run's log: where a user watching `make demo` saw nothing for a while.

    .venv/bin/python -m benchmarks.log_gaps demo.log [--over 60] [--top 5]

Reads Prefect's console lines (`HH:MM:SS.mmm | LEVEL | ...`; a run past midnight wraps), attributes each gap
to the stage that was running (the last "<stage>: started" line before it), and prints the largest gap per
stage, the `--top` gaps overall with the lines around them, and how many exceed `--over` seconds. Exits 1
when any does, so a script can gate on it.
"""
from __future__ import annotations

import argparse
import re
import sys

STAMP = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \| ")
STARTED = re.compile(r"\b(regenerate|prepare|extract|verifier|train|eval|produce)\b[^:|]*: (\d+ ranges )?started")


def gaps(lines: list[str]) -> list[tuple[float, str, str, str]]:
    """(seconds, stage, line before, line after) for every pair of consecutive stamped lines."""
    out, prev, prev_line, stage, day = [], None, "", "(before the stages)", 0.0
    for line in lines:
        m = STAMP.match(line)
        if not m:
            continue
        h, mi, s, ms = map(int, m.groups())
        t = h * 3600 + mi * 60 + s + ms / 1000 + day
        if prev is not None and t < prev - 12 * 3600:  # past midnight
            day += 86400
            t += 86400
        if prev is not None:
            out.append((t - prev, stage, prev_line, line.rstrip()))
        if st := STARTED.search(line):
            stage = st.group(1)
        prev, prev_line = t, line.rstrip()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--over", type=float, default=60.0, help="a gap longer than this fails (seconds)")
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args(argv)
    with open(a.log, encoding="utf-8", errors="replace") as f:
        g = gaps(f.read().splitlines())
    if not g:
        print(f"{a.log}: no stamped lines")
        return 1
    worst: dict[str, float] = {}
    for sec, stage, _, _ in g:
        worst[stage] = max(worst.get(stage, 0.0), sec)
    print("largest gap per stage: " + ", ".join(f"{k} {v:.1f} s" for k, v in worst.items()))
    for sec, stage, before, after in sorted(g, reverse=True)[: a.top]:
        print(f"\n{sec:.1f} s in {stage}:\n  {before[:160]}\n  {after[:160]}")
    over = [x for x in g if x[0] > a.over]
    print(f"\n{len(over)} gap(s) over {a.over:g} s in {len(g) + 1} stamped lines")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
