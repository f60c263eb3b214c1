"""The Prefect server, or the worker running a stage, SIGKILLed mid-stage, on the real service.

    python -m benchmarks.drills.restart [--down-s 10] [--stage train] [--fault server|worker]

The service is docs/service.md's (tests/helpers/prefect_service.py): `prefect server start` with basic auth, the
pools and the `gpus` limit, the deployments, a process worker per pool. A pipeline run of the tiny random
Llama (SmolLM2's tokenizer) on 24 real ShareGPT conversations runs alone first (the reference). The same
run into another dir is started; once its `--stage` is under way (its first checkpoint, or its first
shard), the server's process group is SIGKILLed, left down `--down-s` seconds, and started again on the
same port and database (leases of the `gpus` slots in the server's memory, Prefect's default, or on disk,
docs/service.md's setting). The drill waits for the run to end and prints: its state, the stages that ran
again (task runs per stage), the `gpus` slots still held, the seconds from the kill until the run ended,
and whether its outputs (manifest checksums) equal the reference's. Ends with one JSON line.

`--fault worker`: the GPU stages run on the gpu pool's worker (a hop per stage, training with 2 ranks), and
once the stage is under way that worker is SIGKILLed with every process it started, as a host that dies,
and started again at once (the host came back). The server marks the silent flow run Crashed (no heartbeat
for 90 s), the pipeline's hop retries the stage, and the retry resumes from what was committed.

`--fault worker-term`: the same hop, but the worker gets one SIGTERM (a service manager stopping it). The
drill prints the seconds until the worker and every process it started are gone, whether the stage's lock
and any temp file are left in the run dir, then starts the worker again and waits for the run as above.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import tests.helpers.prefect_service as ps

PIPELINE = "eagle3-pipeline/eagle3-pipeline"
LOCAL = {"env": {"EAGLE3_GPU_DEPLOYMENT": ""}}  # every stage in the run's own process on the cpu worker


def config(model: Path, run_dir: Path, ranks: int = 1) -> dict:
    from eagle3.config import EvalConfig, ExtractConfig, PipelineConfig, PrepareConfig, TrainConfig

    return PipelineConfig(
        model=str(model), run_dir=str(run_dir),
        prepare=PrepareConfig(data="sharegpt", limit=24, max_len=128, val_fraction=0.15, draft_vocab=256),
        extract=ExtractConfig(aux_layer_ids=[1, 3, 4], shard_bytes=1 << 16, batch_tokens=128),
        train=TrainConfig(max_steps=60, epochs=30, ttt_steps=2, pack_tokens=128, threads=1, val_every=20,
                          ckpt_every=5, warmup_steps=1, lr=1e-3, nproc_per_node=ranks),
        eval=EvalConfig(prompts=str(run_dir.parent / "prompts.jsonl"), k=2, max_new_tokens=8, threads=1),
    ).model_dump(mode="json")


def under_way(run_dir: Path, stage: str) -> bool:
    if stage == "train":
        return any((run_dir / "train" / "checkpoints").glob("step-*"))
    return any((run_dir / "extract" / "shards").glob("*.safetensors"))


def holder(run_dir: Path, stage: str) -> int | None:
    """The pid holding the stage's output lock (in the worker's flow run), once it is under way."""
    from eagle3.storage.lock import LOCK_NAME

    d = run_dir / stage
    try:
        return json.loads((d / LOCK_NAME).read_text())["pid"] if under_way(run_dir, stage) else None
    except (OSError, ValueError, KeyError):
        return None


def term_worker(svc: ps.Service, pid: int, stage_dir: Path) -> dict:
    """SIGTERM the gpu worker running the stage whose lock `pid` holds; wait for its whole tree to go; start the
    worker again. What was seen: seconds until the tree was gone, processes still alive, lock and temp files."""
    import fcntl

    import psutil

    from eagle3.storage.lock import LOCK_NAME

    def locked(f: Path) -> bool:  # the kernel's flock, as eagle3's RunLock takes it
        with open(f) as h:
            try:
                fcntl.flock(h, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    found = ps.worker_of(svc, pid)
    assert found, f"no gpu worker runs the stage (pid {pid})"
    name, tree = found
    t0 = time.time()
    os.kill(tree[0].pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=60)
    gone_s = round(time.time() - t0, 1)
    svc.workers[name].wait(5)
    temps = [str(f) for f in stage_dir.rglob("*") if ".tmp" in f.name]
    seen = {"tree": len(tree), "tree_gone_s": gone_s, "still_alive": [p.pid for p in alive],
            "lock_held": locked(stage_dir / LOCK_NAME), "temp_files_left": temps}
    print(f"worker {name} sent SIGTERM with the stage under way: its {len(tree)} processes gone in {gone_s} s, "
          f"{len(alive)} still alive, lock held {seen['lock_held']}, temp files left {len(temps)}; started again",
          flush=True)
    svc.restart(name)
    return seen


def held_slots(client) -> int:
    return client.read_global_concurrency_limit_by_name("gpus").active_slots


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--down-s", type=float, default=10.0, help="seconds the server stays down")
    ap.add_argument("--stage", choices=["extract", "train"], default="train", help="the stage the kill lands in")
    ap.add_argument("--fault", choices=["server", "worker", "worker-term"], default="server",
                    help="what is SIGKILLed (worker-term: the worker is sent SIGTERM)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--lease-storage", choices=["filesystem", "memory"], default="filesystem",
                    help="where the server keeps concurrency leases (Prefect's default is memory)")
    a = ap.parse_args()
    ps.LEASES = f"prefect.server.concurrency.lease_storage.{a.lease_storage}"
    from benchmarks.drills.faults import tiny_llama

    root = Path(tempfile.mkdtemp(prefix="eagle3-restart-"))
    model = tiny_llama(root / "tiny-llama")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "What is 2 plus 2?"}) + "\n")
    out: dict = {"bench": "restart", "fault": a.fault, "stage": a.stage, "lease_storage": a.lease_storage}
    worker = a.fault.startswith("worker")
    ranks, jobs = (2, None) if worker else (1, LOCAL)  # a worker fault: the stages hop to the gpu pool
    (root / "home").mkdir()
    with ps.service(root / "home", gpus=8) as svc:
        with svc.client() as c:
            t0 = time.time()
            ref = ps.trigger(c, PIPELINE, {"config": config(model, root / "ref", ranks)}, jobs, timeout=a.timeout)
            out["reference"] = {"state": ref.state.name, "seconds": round(time.time() - t0, 1)}
            print(f"reference run: {ref.state.name} in {out['reference']['seconds']} s", flush=True)
            run = ps.submit(c, PIPELINE, {"config": config(model, root / "run", ranks)}, jobs)
        deadline = time.time() + a.timeout
        while (pid := holder(root / "run", a.stage)) is None:
            assert time.time() < deadline, f"{a.stage} never got under way"
            time.sleep(0.05)
        if a.fault == "worker-term":
            out.update(term_worker(svc, pid, root / "run" / a.stage))
            killed = time.time()
        elif worker:
            name = ps.kill_worker_of(svc, pid)
            assert name, f"no gpu worker runs the {a.stage} stage (pid {pid})"
            killed = time.time()
            svc.restart(name)
            print(f"worker {name} SIGKILLed with its processes, {a.stage} under way; started again", flush=True)
        else:
            out["down_s"] = a.down_s
            svc.kill_server()
            killed = time.time()
            print(f"server SIGKILLed with {a.stage} under way; down for {a.down_s} s", flush=True)
            time.sleep(a.down_s)
            out["server_start_s"] = round(svc.start_server(), 1)
        with svc.client() as c:
            (end,) = ps.wait(c, [run], a.timeout)
            out["after_kill_s"] = round(time.time() - killed, 1)
            out["state"], out["message"] = end.state.name, (end.state.message or "")[:300]
            out["task_runs"] = ps.task_counts(c, end)
            if worker:  # the stage's flow runs on the gpu pool: the killed one, then its retry
                out["stage_flow_runs"] = {r.name: r.state.name for r in ps.subflows(c, end)}
            time.sleep(5)
            out["gpus_slots_held"] = held_slots(c)
            out["equal"] = end.state.is_completed() and ps.checksums(root / "run") == ps.checksums(root / "ref")
    back = (f"stage flow runs {out['stage_flow_runs']}" if worker
            else f"server back in {out['server_start_s']} s")
    print(f"run after the {a.fault} kill: {out['state']} ({out['message']}), {out['after_kill_s']} s after the kill; "
          f"{back}; task runs per stage {out['task_runs']}; `gpus` slots held {out['gpus_slots_held']}; outputs "
          f"equal the reference: {out['equal']}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
