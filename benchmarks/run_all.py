"""Run every benchmark and write benchmarks/RESULTS.md: figures, machine, date and commit.

    .venv/bin/python -m benchmarks.run_all [--only prepare train ...] [--quick]

Each benchmark is its own process; its last stdout line is one JSON object, copied into the
results verbatim (flattened into a table), next to the command that produced it. With --only,
the sections of the other benchmarks are kept from the existing file, each stamped with the
date and commit it ran at; sections no script here writes are kept as they are, after them.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# section name in RESULTS.md: the module that prints its figures (run as `python -m` from the repo root)
BENCHES = {
    "prepare": "benchmarks.speed.prepare",
    "extract": "benchmarks.speed.extract",
    "ttt_attention": "benchmarks.speed.ttt_attention",
    "train": "benchmarks.speed.train",
    "regenerate": "benchmarks.speed.regenerate",
    "cpu_linear": "benchmarks.speed.cpu_linear",
    "heap": "benchmarks.speed.heap",
    "faults": "benchmarks.drills.faults",
    "families": "benchmarks.drills.families",
    "verify_on_read": "benchmarks.speed.verify_on_read",
    "load": "benchmarks.drills.load",
    "online": "benchmarks.speed.online",
    "extract_workers": "benchmarks.speed.extract_workers",
}
QUICK = {  # smaller settings for a smoke run of this script itself
    "prepare": ["--limit", "200"],
    "verify_on_read": ["--gib", "0.3", "--ranks", "4", "--repeats", "1"],
    "train": ["--vocab", "8192", "--k", "3", "--pack", "512", "--steps", "1"],
    "heap": ["--only", "train", "--steps", "1", "--warmup", "1", "--repeats", "1"],
    "online": ["--limit", "100", "--spool-fraction", "0.1"],
    "extract_workers": ["--limit", "40"],
}


def flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, obj


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        mem = f", {int(open('/proc/meminfo').readline().split()[1]) / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs{mem}{gpu}; Python {platform.python_version()}"


def earlier_sections(path: Path) -> dict[str, str]:
    """Sections of an existing results file by benchmark name, each stamped with its run."""
    if not path.is_file():
        return {}
    text = path.read_text()
    # files written before sections carried their own stamp: the header's date and commit
    old = re.search(r"Date: (.+?); commit `(\w+)`", text)
    out = {}
    for part in re.split(r"(?m)^## ", text)[1:]:
        name, _, rest = part.partition("\n")
        if old and not rest.lstrip().startswith("Ran "):
            rest = f"\nRan {old.group(1)} at commit `{old.group(2)}`. " + rest.lstrip("\n")
        out[name.strip()] = f"## {name}\n{rest.rstrip()}\n"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    now = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"
    stamp = f"Ran {now} at commit `{commit}`{' (quick settings)' if a.quick else ''}."
    kept = earlier_sections(Path(a.out))
    sections = {}
    for name, module in BENCHES.items():
        if a.only and name not in a.only:
            continue
        cmd = [sys.executable, "-m", module, *(QUICK.get(name, []) if a.quick else [])]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - t0
        shown = " ".join([".venv/bin/python", *cmd[1:]])
        if p.returncode:
            sections[name] = (f"## {name}\n\n{stamp} `{shown}` failed (exit {p.returncode}):\n\n"
                              f"```\n{p.stderr[-1500:]}\n```\n")
            print(f"{name}: FAILED", flush=True)
            continue
        figs = json.loads(p.stdout.strip().splitlines()[-1])
        rows = "\n".join(f"| {k} | {v} |" for k, v in flatten(figs))
        human = "\n".join(p.stdout.strip().splitlines()[:-1][-12:])
        sections[name] = (f"## {name}\n\n{stamp} `{shown}` ({wall:.0f} s)\n\n```\n{human}\n```\n\n"
                          f"| figure | value |\n|---|---|\n{rows}\n")
        print(f"{name}: done in {wall:.0f} s", flush=True)
    head = (f"# Benchmark results\n\nMachine: {machine()}\n\n"
            f"Written {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC. Every figure below is printed by the "
            "script named above it; ratios are measured side by side in one process where the script says so.\n")
    # the scripts' own sections first; then every other section of the file (hand-run experiments, dated
    # runs) as it was, in its order: a rerun never drops figures it did not produce
    order = [n for n in BENCHES if n in sections or n in kept] + [n for n in kept if n not in BENCHES]
    body = [sections.get(n) or kept[n] for n in order]
    from eagle3.storage.atomic import atomic_write_text

    atomic_write_text(Path(a.out), head + "\n" + "\n".join(body))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
