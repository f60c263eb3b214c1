"""Load drill on a real Prefect server: three pipeline runs of different configs and a nightly run,
submitted at once with the `gpus` limit at 1, then each run again alone.

    python -m benchmarks.drills.load [--timeout 3600]

The service is the one docs/service.md sets up (tests/helpers/prefect_service.py): `prefect server start` with
basic auth on, deployments/setup.py (`--gpus 1`: a one-GPU host), deployments/prefect.yaml deployed,
a process worker per pool; every stage runs in its run's process on the cpu worker and holds one
slot while it uses the "GPU". Target: the real SmolLM2-135M-Instruct; data: real ShareGPT
conversations; eval: MT-Bench questions. While the first run holds its run dir, a second run on the
same dir is submitted and must be refused, naming the holder.

Prints, from the server's API: each run's state and wall time, the GPU stages' intervals (from the
`eagle3.gpus.start` / `.end` events) and any overlap between them, how long each GPU stage queued
for the limit (task run start to `eagle3.gpus.start`), and whether each run's outputs (manifest
checksums: shards, vocab map, verifier, weights, eval figures) equal the same run done alone. Ends
with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import tests.helpers.prefect_service as ps

REPO = Path(__file__).resolve().parents[2]

PIPELINE = "eagle3-pipeline/eagle3-pipeline"
NIGHTLY = "eagle3-nightly/eagle3-nightly"
LOCAL = {"env": {"EAGLE3_GPU_DEPLOYMENT": ""}}  # every stage in the run's own process, one `gpus` slot


def configs(root: Path, model: Path) -> dict[str, tuple[str, dict]]:
    """Three small pipelines that differ in data, storage, vocab, k and seeds; and a first nightly."""
    from eagle3.config import EvalConfig, ExtractConfig, PipelineConfig, PrepareConfig, TrainConfig
    from eagle3.data.readers import ReadStats, iter_source, resolve_source

    def pipe(name: str, prepare: dict, extract: dict, train: dict, k: int) -> PipelineConfig:
        return PipelineConfig(
            model=str(model), run_dir=str(root / "runs" / name),
            prepare=PrepareConfig(**{"data": "sharegpt", "max_len": 256, "val_fraction": 0.15, **prepare}),
            extract=ExtractConfig(**{"shard_bytes": 4 << 20, "batch_tokens": 2048, **extract}),
            train=TrainConfig(**{"max_steps": 6, "pack_tokens": 512, "threads": 1, "val_every": 3, "ckpt_every": 3,
                                 "warmup_steps": 1, "lr": 1e-3, **train}),
            eval=EvalConfig(prompts="mt-bench", limit=2, k=k, max_new_tokens=16, threads=1))

    p1 = pipe("p1", {"limit": 24, "draft_vocab": 2048}, {}, {"ttt_steps": 2}, 2)
    p2 = pipe("p2", {"limit": 32, "draft_vocab": 2048}, {"storage": "fp8"}, {"ttt_steps": 3}, 3)
    p3 = pipe("p3", {"limit": 24, "draft_vocab": 4096, "seed": 1}, {"storage": "fp8-aux"},
              {"ttt_steps": 2, "seed": 1}, 2)
    inbox = root / "conversations"  # what arrived for the first night: ShareGPT records 100-129
    inbox.mkdir(parents=True, exist_ok=True)
    raw = (x for x in iter_source(resolve_source("sharegpt"), ReadStats()) if hasattr(x, "obj"))
    recs = [r.obj for _, r in zip(range(130), raw, strict=False)][100:]
    (inbox / "day1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    base = pipe("nightly-base", {"draft_vocab": 2048}, {}, {"ttt_steps": 2}, 2)
    night = {"conversations": str(inbox), "root": str(root / "runs" / "nightly"), "margin": 0.05,
             "base": base.model_dump(mode="json")}
    return {"p1": (PIPELINE, {"config": p1.model_dump(mode="json")}),
            "p2": (PIPELINE, {"config": p2.model_dump(mode="json")}),
            "p3": (PIPELINE, {"config": p3.model_dump(mode="json")}),
            "nightly": (NIGHTLY, {"config": night})}


def moved(params: dict, tag: str) -> dict:
    """The same parameters writing under another dir (`run_dir`, or a nightly's `root`)."""
    c = dict(params["config"])
    key = "root" if "root" in c else "run_dir"
    c[key] = f"{c[key]}-{tag}"
    return {"config": c}


def out_dir(params: dict) -> Path:
    """A pipeline's run dir, or the one night under a nightly root."""
    c = params["config"]
    if "run_dir" in c:
        return Path(c["run_dir"])
    (night,) = [p for p in Path(c["root"]).iterdir() if p.is_dir()]
    return night


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the concurrent phase")
    ap.add_argument("--keep", action="store_true", help="keep the run dirs and the server's home (printed)")
    a = ap.parse_args()
    from eagle3.assets import materialize_smollm2

    t_all = time.time()
    root = Path(tempfile.mkdtemp(prefix="eagle3-load-"))
    os.environ["EAGLE3_CACHE_DIR"] = str(root / "sha256-stamps")  # every process of the drill; none left behind
    model = materialize_smollm2(REPO / "assets" / "smollm2")
    runs = configs(root, model)
    home = root / "prefect"
    home.mkdir()
    with ps.service(home, gpus=1) as svc, svc.client() as c:
        print(f"service up in {svc.seconds['ready']:.0f} s (basic auth on, `gpus` = 1); runs under {root}", flush=True)
        since = datetime.now(timezone.utc)
        t0 = time.time()
        subs = {n: ps.submit(c, dep, params, LOCAL) for n, (dep, params) in runs.items()}
        first = Path(runs["p1"][1]["config"]["run_dir"]) / ".eagle3.lock"
        while not (first.is_file() and first.read_text()):
            time.sleep(0.2)
        holder = json.loads(first.read_text())
        dup = ps.submit(c, PIPELINE, runs["p1"][1], LOCAL)
        done = dict(zip([*subs, "duplicate"], ps.wait(c, [*subs.values(), dup], a.timeout), strict=True))
        wall = time.time() - t0
        states = {n: r.state.name for n, r in done.items()}
        print(f"concurrent phase: {wall:.0f} s; states {states}", flush=True)
        refused = done["duplicate"].state.message or ""
        named = f"is in use by pid {holder['pid']} on {holder['host']}" in refused
        print(f"second run on {runs['p1'][1]['config']['run_dir']}: {done['duplicate'].state.name}, holder named: "
              f"{named}\n  {refused[:300]}", flush=True)

        by_flow = {f"prefect.flow-run.{r.id}": n for n, r in done.items()}
        spans = ps.gpu_intervals(c, since, expect=12)
        bad = ps.overlaps(spans)
        waits: dict[str, list[float]] = {}
        print(f"\nGPU stages ({len(spans)}), in order; queued = task run start -> eagle3.gpus.start:")
        for i in spans:
            tr = c.read_task_run(i.task_run.removeprefix("prefect.task-run."))
            q = (i.start - tr.start_time).total_seconds()
            waits.setdefault(by_flow.get(i.flow_run, "?"), []).append(q)
            print(f"  {by_flow.get(i.flow_run, '?'):<8} {tr.name.rsplit('-', 1)[0]:<8} "
                  f"{(i.start - since).total_seconds():7.1f} -> {(i.end - since).total_seconds():7.1f} s  "
                  f"held {(i.end - i.start).total_seconds():6.1f} s  queued {q:6.1f} s  slots {i.slots}", flush=True)
        busy = sum((i.end - i.start).total_seconds() for i in spans)
        print(f"overlapping pairs: {len(bad)}; GPU busy {busy:.0f} s of {wall:.0f} s ({busy / wall:.0%})", flush=True)

        alone: dict[str, float] = {}
        equal: dict[str, bool] = {}
        for n, (dep, params) in runs.items():
            again = moved(params, "alone")
            t1 = time.time()
            r = ps.trigger(c, dep, again, LOCAL, timeout=a.timeout)
            alone[n] = time.time() - t1
            equal[n] = r.state.is_completed() and done[n].state.is_completed() and \
                ps.checksums(out_dir(params)) == ps.checksums(out_dir(again))
            print(f"alone {n:<8} {r.state.name:<10} {alone[n]:6.0f} s; outputs equal to the concurrent run: {equal[n]}",
                  flush=True)
        run_s = {n: (r.end_time - r.start_time).total_seconds() for n, r in done.items() if n != "duplicate"}
    seq = sum(alone.values())
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nconcurrent {wall:.0f} s vs one after another {seq:.0f} s ({wall / seq:.2f}x); "
          f"GPU stages overlapping: {len(bad)}; outputs equal to alone: {sum(equal.values())}/{len(equal)}")
    print(json.dumps({
        "bench": "load", "gpus_limit": 1, "runs": list(runs), "states": states,
        "concurrent_wall_s": round(wall, 1), "alone_wall_s": {n: round(v, 1) for n, v in alone.items()},
        "alone_sum_s": round(seq, 1), "concurrent_over_sequential": round(wall / seq, 3),
        "run_wall_s_concurrent": {n: round(v, 1) for n, v in run_s.items()},
        "gpu_stages": len(spans), "gpu_overlapping_pairs": len(bad), "gpu_busy_share": round(busy / wall, 3),
        "queued_s": {n: {"total": round(sum(v), 1), "max": round(max(v), 1)} for n, v in waits.items()},
        "outputs_equal_alone": equal, "duplicate_refused": done["duplicate"].state.is_failed() and named,
        "seconds": round(time.time() - t_all, 1)}))
    return 0 if not bad and all(equal.values()) and named else 1


if __name__ == "__main__":
    sys.exit(main())
