"""On-policy training data: ShareGPT's prompts answered by the target itself, ready for the trainer.

Runs `eagle3 regenerate` (greedy, batched; `--backend hf` or the vLLM engine) on the first `--limit` ShareGPT
conversations, then `prepare` (the demo's settings) on the regenerated JSONL, `extract` and `verifier`, each as
its own process with `--threads` torch threads, and prints each stage's wall and CPU seconds (the process
tree's; on a shared machine wall time also measures the neighbours) and token counts, so the lever's
total compute can be set against the baseline's extraction + training (benchmarks/experiments/levers.py trains
on `--root/extract` with `--regen-extract`). With `--mixed`, also the original conversations and the
regenerated ones together (`--root/mixed/data`: the source's first `--limit` records as JSONL, then the
regenerated JSONL), prepared, extracted and given a verifier under `--root/mixed/` (`--mixed-extract` of
levers.py). Stages already done are not redone. Last line: one JSON object.

    .venv/bin/python -m benchmarks.experiments.onpolicy --limit 400 --max-new-tokens 256 --batch-size 64 \\
        --root runs/onpolicy --threads 1 [--backend vllm] [--mixed]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from benchmarks.experiments.levers import eagle3, run

REPO = Path(__file__).resolve().parents[2]


def mixed_source(data: str, limit: int, regenerated: Path, out: Path) -> Path:
    """out/data: the source's first `limit` records, one JSON object per line as read (0-original.jsonl), and a
    copy of the regenerated JSONL (1-regenerated.jsonl); prepare reads a directory's files in sorted order.
    Unreadable records of the source are left out here as prepare would skip them; written temp-then-rename."""
    from eagle3.data.readers import Raw, ReadStats, iter_source, resolve_source

    d = out / "data"
    if d.is_dir():
        return d
    tmp = out / "data.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(tmp / "0-original.jsonl", "w") as f:
        for n, rec in enumerate(iter_source(resolve_source(data), ReadStats())):
            if n >= limit:
                break
            if isinstance(rec, Raw):
                f.write(json.dumps(rec.obj, ensure_ascii=False) + "\n")
    shutil.copyfile(regenerated, tmp / "1-regenerated.jsonl")
    tmp.rename(d)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--limit", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024, help="prepare: sample length (the demo's)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--val-fraction", type=float, default=0.03)
    ap.add_argument("--root", default="runs/onpolicy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="regenerate's backend")
    ap.add_argument("--mixed", action="store_true", help="also the original and regenerated data together")
    a = ap.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "log.txt"
    timing_path = root / "timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}

    def stage(name: str, cmd: list[str], done: Path) -> None:
        if name in timing and done.is_file():
            return
        wall, cpu = run(cmd, log, a.threads)
        timing[name] = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}
        timing_path.write_text(json.dumps(timing, indent=1))
        print(f"{name}: {wall:.0f} s wall, {cpu:.0f} CPU s", flush=True)

    stage("regenerate", eagle3("regenerate", "--model", a.model, "--data", a.data, "--limit", str(a.limit),
                               "--max-new-tokens", str(a.max_new_tokens), "--batch-size", str(a.batch_size),
                               "--max-len", str(a.max_len), "--threads", str(a.threads), "--backend", a.backend,
                               "--out", str(root / "regen")),
          root / "regen" / "manifest.json")

    def data_stages(tag: str, data: Path, d: Path) -> None:
        stage(f"{tag}prepare", eagle3("prepare", "--model", a.model, "--data", str(data), "--max-len", str(a.max_len),
                                      "--draft-vocab", str(a.draft_vocab), "--val-fraction", str(a.val_fraction),
                                      "--out", str(d / "prepare")), d / "prepare" / "manifest.json")
        stage(f"{tag}extract", eagle3("extract", "--model", a.model, "--prepared", str(d / "prepare"),
                                      "--out", str(d / "extract")), d / "extract" / "manifest.json")
        stage(f"{tag}verifier", eagle3("verifier", "--model", a.model, "--prepared", str(d / "prepare"),
                                       "--out", str(d / "verifier")), d / "verifier" / "manifest.json")

    data_stages("", root / "regen" / "regenerated.jsonl", root)
    if a.mixed:
        data_stages("mixed_", mixed_source(a.data, a.limit, root / "regen" / "regenerated.jsonl", root / "mixed"),
                    root / "mixed")
    regen = json.loads((root / "regen" / "manifest.json").read_text())
    prep = json.loads((root / "prepare" / "manifest.json").read_text())
    res = {"limit": a.limit, "max_new_tokens": a.max_new_tokens, "batch_size": a.batch_size, "threads": a.threads,
           "records": regen["records_written"], "turns": regen["turns_written"],
           "tokens_generated": regen["stats"]["tokens_generated"], "prompt_tokens": regen["stats"]["prompt_tokens"],
           "regen_tokens_per_second": regen["stats"]["tokens_per_second"],
           "train_tokens": sum(s["num_tokens"] for s in prep["splits"]["train"]),
           "trainable_tokens": sum(s["num_trainable_tokens"] for s in prep["splits"]["train"]),
           "timing": timing, "cpu_s": round(sum(t["cpu_s"] for t in timing.values()), 1)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
