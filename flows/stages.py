"""Every stage as its own flow, so that a deployment can place it on another work pool.

`run_stage` is how the pipeline and the nightly flow call a stage: in their own process by
default (`eagle3 run`), or, when EAGLE3_GPU_DEPLOYMENT names a suffix (deployments/prefect.yaml
sets `gpu` for the flows on the `cpu` pool), the GPU stages hop to the deployment
`eagle3-<stage>/<stage>-<suffix>` on the `gpu` pool. Both pools must see the same run dirs.

A hop is a task of the calling flow, named after the stage, that starts the stage's flow run
(`extract · <run name>`, linked as a subflow), copies its log lines into the caller's log and
waits for it. The hop carries the stage's retry policy: a failed attempt is retried by a new
flow run, which resumes from what the last one committed (this also covers a worker that died
mid-stage), and the stage's run count shows on the caller's own task run.

Online (`run_online`), extraction and training are one step: the producer (`produce`, not a
registered stage: it has no store of its own) and the trainer run as two tasks submitted side by
side, each hopping to its own deployment (`eagle3-produce/produce-<suffix>`, `eagle3-train/...`)
when the GPU stages hop, and the step ends when both have.
"""
from __future__ import annotations

import importlib
import os
import time
from typing import Any, Callable, NamedTuple

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext
from prefect.deployments import run_deployment
from pydantic import BaseModel

from eagle3.config import SPOOL_WAIT_S, EvalConfig, ExtractConfig, PrepareConfig, RegenConfig, TrainConfig
from eagle3.registry import STAGES as LIBRARY
from eagle3.runtime.heap import PeakRSS
from eagle3.runtime.progress import hms
from eagle3.runtime.stop import on_unwind
from eagle3.storage.manifests import (
    EvalReport,
    HiddenRange,
    HiddenStates,
    PreparedData,
    RegeneratedData,
    SpooledStates,
    TrainedDraft,
    VerifierWeights,
)
from tasks._failures import Final, PartnerGone, end_failed, failure, raise_for
from tasks._gpus import split_devices
from tasks._online import OnlineSource, pair_done, producer_inputs, reset_spool
from tasks.extract import (
    commit_task,
    extract_range_task,
    produce_label,
    produce_task,
    publish_range,
    publish_spool,
    range_headline,
    range_label,
    spool_headline,
)


class StageTask(NamedTuple):
    """A stage as a flow runs it: its Prefect task, manifest, artifacts and log line (the library's face of the
    stage is eagle3.stage.Stage)."""

    task: Any                                # the Prefect task that runs the stage: tasks.<name>.<name>_task
    manifest: type                           # what it writes last, and returns
    publish: Callable[[Any, str], None]      # its artifacts, made by the flow that ran it: tasks.<name>.publish
    headline: Callable[[Any], str]           # its key figures in one line, for the log


def _stage(name: str) -> StageTask:
    t = importlib.import_module(f"tasks.{name}")
    return StageTask(getattr(t, f"{name}_task"), LIBRARY[name].manifest, t.publish, LIBRARY[name].headline)


STAGES = {name: _stage(name) for name in LIBRARY}  # every registered stage, in pipeline order
GPU_STAGES = tuple(name for name, s in LIBRARY.items() if s.gpu)
ONLINE = {"produce": StageTask(produce_task, SpooledStates, publish_spool, spool_headline)}  # runs beside train
TABLE = {**STAGES, **ONLINE}  # what a hop or a stage flow may run


Times = dict[str, dict[str, Any]]  # stage -> its wall time and peak memory, in the order the stages ended


def _record(times: Times | None, stage: str, seconds: float, how: str, peak: PeakRSS | None) -> None:
    """Note a stage's figures in the run's `times` (the pipeline's closing table): seconds, how ("done",
    "cached ..."), peak_rss (this process's, per stage; None where the stage hopped to another process) and
    subprocesses_rss (the largest child's, None when none beat an earlier one)."""
    if times is not None:
        times[stage] = {"seconds": seconds, "how": how, "peak_rss": peak.own if peak else None,
                        "subprocesses_rss": peak.children if peak else None}


def fresh(task, manifest_cls, out):
    """A cached result whose output dir is gone must rerun, not return a dangling manifest."""
    return task if manifest_cls.exists(out) else task.with_options(refresh_cache=True)


def run_stage(name: str, out: str, wait_for=None, times: Times | None = None, **inputs):
    """Run stage `name` into `out`, log its start and end with its key figures, publish its artifacts, note its
    figures in `times`. Training on several nodes (cfg.nnodes > 1) is one task per node, started together."""
    stage, log = STAGES[name], get_run_logger()
    suffix = os.environ.get("EAGLE3_GPU_DEPLOYMENT")
    nnodes = inputs["cfg"].nnodes if name == "train" else 1
    on = f" on {nnodes} nodes" if nnodes > 1 else ""
    t0, peak = time.monotonic(), None
    if name == "extract" and inputs["cfg"].workers > 1:
        m, how, mem, peak = run_ranges(out, wait_for, **inputs)
    elif suffix and name in GPU_STAGES:
        deployment = f"eagle3-{name}/{name}-{suffix}"
        log.info("%s: started%s on deployment %s, output %s", name, on, deployment, out)
        params = as_params({**inputs, "out": out})
        if nnodes == 1:
            hop_task(name)(name, deployment, params, wait_for=wait_for)
        else:  # one flow run per node, each on a gpu worker (a GPU host) of its own
            labels = [node_name(name, k) for k in range(nnodes)]
            wait_all(name, [hop_task(name).submit(lb, deployment, {**params, "node_rank": k}, wait_for=wait_for)
                            for k, lb in enumerate(labels)], labels)
        m, how = stage.manifest.read(out), "done"  # the stage dir is on storage both pools share
        mem = ""  # the stage ran in the deployment's process
    else:
        log.info("%s: started%s, output %s", name, on, out)
        task = fresh(stage.task, stage.manifest, out)
        with PeakRSS() as peak:  # stages run one at a time here: each gets its own peak
            if nnodes == 1:
                states = [task(out=out, wait_for=wait_for, return_state=True, **inputs)]
            else:  # every node's torchrun under this process (the nodes share this host)
                labels = [node_name(name, k) for k in range(nnodes)]
                states = wait_all(name, [task.with_options(task_run_name=lb).submit(
                    out=out, wait_for=wait_for, node_rank=k, **inputs) for k, lb in enumerate(labels)], labels)
        m = states[0].result()  # every node task returns the manifest global rank 0 wrote
        how = "cached (inputs unchanged)" if all(s.name == "Cached" for s in states) else "done"
        mem = f", {peak.line()}"
    stage.publish(m, out)
    log.info("%s: %s in %s%s: %s", name, how, hms(time.monotonic() - t0), mem, stage.headline(m))
    _record(times, name, time.monotonic() - t0, how, peak)
    return m


def run_ranges(out: str, wait_for=None, **inputs) -> tuple[HiddenStates, str, str, PeakRSS | None]:
    """Extraction over cfg.workers: one task per range of the shard plan, submitted at once, each hopping to the
    extract deployment when the GPU stages hop (its flow run goes to whichever GPU worker takes it), else run
    here on its own devices; then the commit, here (it renames files on the storage both pools share). A failed
    range is retried alone (it resumes); the commit waits for all. Returns (manifest, how, memory line, peak:
    None where the ranges hopped)."""
    log, cfg = get_run_logger(), inputs["cfg"]
    n, suffix = cfg.workers, os.environ.get("EAGLE3_GPU_DEPLOYMENT")
    labels = [range_label(k, n) for k in range(n)]
    if suffix:
        deployment = f"eagle3-extract/extract-{suffix}"
        log.info("extract: %d ranges started on deployment %s, output %s", n, deployment, out)
        futures = [hop_task("extract", label).submit(label, deployment, as_params({**inputs, "out": out, "part": k}),
                                                     wait_for=wait_for) for k, label in enumerate(labels)]
        mem, peak = "", None
    else:
        log.info("extract: %d ranges started, output %s", n, out)
        engine = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
        devices = split_devices(*[engine] * n) or [None] * n
        with PeakRSS() as peak:
            futures = [fresh_range(out, k, n).submit(out=out, part=k, devices=d, wait_for=wait_for, **inputs)
                       for k, d in enumerate(devices)]
            for f in futures:
                f.wait()
        mem = f", {peak.line()}"
    cached = all(s.name == "Cached" for s in wait_all("extract", futures, labels))
    state = fresh(commit_task, HiddenStates, out)(out=out, return_state=True, **inputs)
    how = "cached (inputs unchanged)" if cached and state.name == "Cached" else f"done over {n} workers"
    return state.result(), how, mem, peak


def fresh_range(out: str, k: int, n: int):
    """A cached range whose dir is gone (and whose store was never committed) must rerun."""
    from eagle3.extract.run import range_dir
    from eagle3.storage.manifests import HiddenRange

    done = HiddenRange.exists(range_dir(out, k, n)) or HiddenStates.exists(out)
    return extract_range_task if done else extract_range_task.with_options(refresh_cache=True)


def node_name(name: str, k: int) -> str:
    return f"{name} (node {k})"


def wait_all(name: str, futures: list, labels: list[str]) -> list:
    """Wait for the tasks of one stage submitted together (the nodes of a multi-node training, the ranges of an
    extraction); raise the first failed one's error, after logging every failure. Returns their states.

    Nodes: a node that dies ends its peers' torchrun too (a collective or the rendezvous fails), so every node
    task fails and retries, and they meet again at the rendezvous (eagle3/train/launch.py), resuming from the
    last checkpoint; they share one cache key (a finished run's are all cached). Ranges: each retries alone and
    resumes; the finished ones are kept."""
    with on_unwind():  # a stop here also stops the tasks' children on their threads
        for f in futures:
            f.wait()
    states = [f.state for f in futures]
    failed = [(lb, s) for lb, s in zip(labels, states, strict=True) if not s.is_completed()]
    if failed:
        get_run_logger().error("%s: %s", name, ", ".join(f"{lb} ended {s.name}: {s.message}" for lb, s in failed))
        failed[0][1].result()  # raises that task's own exception
    return states


def as_params(inputs: dict[str, Any]) -> dict[str, Any]:
    """Deployment parameters are JSON: configs go as dicts, the stage flow validates them again."""
    return {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in inputs.items()}


def hop_task(name: str, label: str | None = None):
    """The hop for stage `name` (shown as `label`, default the name), with the stage task's own retry policy."""
    t = TABLE[name].task
    return hop.with_options(name=label or name, retries=t.retries, retry_delay_seconds=t.retry_delay_seconds,
                            retry_condition_fn=t.retry_condition_fn)


@task(task_run_name="{name}", cache_policy=NO_CACHE)
def hop(name: str, deployment: str, params: dict, job_variables: dict | None = None) -> None:
    """Run one stage as a flow run of its deployment (with these job variables), its log copied here; raise if
    it did not complete."""
    log = get_run_logger()
    attempt = TaskRunContext.get().task_run.run_count
    parent = FlowRunContext.get().flow_run
    run_name = f"{name} · {parent.name}" + (f" (try {attempt})" if attempt > 1 else "")
    run = run_deployment(deployment, parameters=params, flow_run_name=run_name, timeout=0,
                         job_variables=job_variables)
    log.info("%s: flow run %r of %s", name, run_name, deployment)
    run = follow(run.id, name, log)
    if not run.state.is_completed():
        # a Final kind (the state's name) is raised as its type, which the hop's retry condition does not retry:
        # a new flow run would fail the same way
        raise_for(run.state, f"stage {name}: flow run {run_name!r} of {deployment} ended {run.state.name}: "
                             f"{run.state.message}")


def follow(run_id, name: str, log, poll: float = 2.0):
    """Wait for flow run `run_id` to end, copying its log lines into this run's log as they arrive."""
    from datetime import timedelta

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    seen, since = set(), None
    with get_client(sync_client=True) as c:
        def copy() -> None:
            nonlocal since
            # Lines reach the server in batches, not always in order: re-read a window, skip those seen.
            flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]),
                            timestamp=LogFilterTimestamp(after_=since - timedelta(seconds=30)) if since else None)
            offset = 0
            while page := c.read_logs(flt, sort=LogSort.TIMESTAMP_ASC, limit=200, offset=offset):
                for x in page:
                    if x.id not in seen:
                        seen.add(x.id)
                        log.log(x.level, "%s | %s", name, x.message.split("\n", 1)[0])  # tracebacks stay there
                        since = max(since or x.timestamp, x.timestamp)
                offset += len(page)

        while not (run := c.read_flow_run(run_id)).state.is_final():
            copy()
            time.sleep(poll)
        time.sleep(poll)  # the stage's last lines reach the server in the next batch
        copy()
    return run


def run_online(spool: str, train_out: str, *, model: str, prepared: str, extract: ExtractConfig, train: TrainConfig,
               spool_bytes: int, wait_s: float, verifier: str, verifier_name: str = "",
               trust_remote_code: bool = False, times: Times | None = None) -> tuple[SpooledStates, TrainedDraft]:
    """Online: the producers (extract.workers of them, into the spool `spool`) and the trainer (into `train_out`)
    as tasks submitted side by side, each on its deployment when the GPU stages hop; returns the spool's and the
    trainer's manifests once all ended.

    None ends without the others (a producer waits while the spool is full, the trainer for its next window),
    so they run as a pair: when the pair is not done for these inputs (tasks/_online.py) the spool is reset
    and all run, none served from the cache. In this process they split the visible devices (each producer's
    engine in turn, then the trainer's processes); hopped, each flow run (each producer on the GPU worker that
    takes it: its own host) splits its host's devices the same way."""
    log = get_run_logger()
    if train.nnodes > 1:  # the producer and the trainer split one host's devices
        raise ValueError(f"online training runs on one node; train.nnodes is {train.nnodes} (use mode offline)")
    suffix = os.environ.get("EAGLE3_GPU_DEPLOYMENT")
    online = OnlineSource(extract=extract, spool_bytes=spool_bytes, wait_s=wait_s)
    n = extract.workers
    common = dict(model=model, prepared=prepared, out=spool, cfg=extract, train=train, spool_bytes=spool_bytes,
                  wait_s=wait_s, trust_remote_code=trust_remote_code)
    # one producer: as before (no part); several: each its part, named "produce k/N"
    sides = {produce_label(k, n): ("produce", {**common, **({"part": k} if n > 1 else {})}) for k in range(n)}
    sides["train"] = ("train", dict(hidden=spool, verifier=verifier, out=train_out, cfg=train,
                                    verifier_name=verifier_name, model=model, prepared=prepared,
                                    trust_remote_code=trust_remote_code, online=online))
    fp = producer_inputs(model, prepared, extract, train, spool_bytes, trust_remote_code)
    rerun = not pair_done(spool, train_out, fp, verifier, train)
    if rerun:
        reset_spool(spool)
    t0 = time.monotonic()
    what = "produce" if n == 1 else f"produce ({n} producers)"
    if suffix:
        log.info("%s + train (online): started side by side on deployments eagle3-produce/produce-%s and "
                 "eagle3-train/train-%s; spool %s (cap %s bytes), output %s", what, suffix, suffix, spool,
                 f"{spool_bytes:,}", train_out)
        jobs = {"env": {"PREFECT_TASKS_REFRESH_CACHE": "true"}} if rerun else None  # the stage flows' tasks too
        futures = {label: hop_task(stage, label).submit(label, f"eagle3-{stage}/{stage}-{suffix}", as_params(args),
                                                        jobs)
                   for label, (stage, args) in sides.items()}
        with on_unwind():
            for f in futures.values():
                f.wait()
        mem = ""  # each side ran in its deployment's process
    else:
        log.info("%s + train (online): started side by side; spool %s (cap %s bytes), output %s", what, spool,
                 f"{spool_bytes:,}", train_out)
        devices = split_devices(*[online.producer_slots] * n, train.nproc_per_node) or [None] * (n + 1)
        with PeakRSS() as peak:  # they share this process: one peak for all
            futures = {}
            for (label, (stage, args)), d in zip(sides.items(), devices, strict=True):
                t = TABLE[stage].task.with_options(task_run_name=label)
                futures[label] = (t.with_options(refresh_cache=True) if rerun else t).submit(**args, devices=d)
            with on_unwind():  # a stop here also stops the trainer's torchrun on its thread
                for f in futures.values():
                    f.wait()
        mem = f", {peak.line()}"
    failed = [(label, f.state) for label, f in futures.items() if not f.state.is_completed()]
    if failed:  # the side that failed first is the cause; the others' PartnerGone follows from it
        label, state = next(((lb, s) for lb, s in failed if not isinstance(failure(s), PartnerGone)), failed[0])
        log.error("online: %s; raising %s's error", ", ".join(f"{m} ended {s.name}" for m, s in failed), label)
        state.result()  # raises the task's own exception
    ms = {"produce": SpooledStates.read(spool), "train": TrainedDraft.read(train_out)}  # the spool's: every producer's
    for stage, m in ms.items():
        mine = [f for label, f in futures.items() if sides[label][0] == stage]
        how = "cached (inputs unchanged)" if all(f.state.name == "Cached" for f in mine) else "done"
        TABLE[stage].publish(m, spool if stage == "produce" else train_out)
        log.info("%s: %s in %s%s: %s", stage, how, hms(time.monotonic() - t0), mem, TABLE[stage].headline(m))
        _record(times, stage, time.monotonic() - t0, how, None if suffix else peak)
    return ms["produce"], ms["train"]


def own(stage: str, out: str):
    """The stage's task for a stage flow: refreshed if its output is gone; without retries when a
    pipeline's hop started this flow run (the hop retries, with a new flow run, and shows the count)."""
    task, manifest_cls = TABLE[stage].task, TABLE[stage].manifest
    hopped = FlowRunContext.get().flow_run.parent_task_run_id is not None
    return fresh(task.with_options(retries=0) if hopped else task, manifest_cls, out)


def _done(stage: str, out: str, run: Callable[[], Any]):
    """A stage flow's body: `run()` (the stage's task), then its artifacts and headline. A `Final` failure ends
    the flow run Failed with its kind as the state's name, which a hop raises as the same type."""
    try:
        m = run()
    except Final as e:
        get_run_logger().error("%s: %s", stage, e)
        return end_failed(e)
    TABLE[stage].publish(m, out)
    get_run_logger().info("%s: %s", stage, TABLE[stage].headline(m))
    return m


@flow(name="eagle3-regenerate")
def regenerate(model: str, data: str, out: str, cfg: RegenConfig, trust_remote_code: bool = False) -> RegeneratedData:
    """Stage 0 alone: rewrite every assistant turn of a chat dataset with the target."""
    return _done("regenerate", out, lambda: own("regenerate", out)(model, data, out, cfg, trust_remote_code))


@flow(name="eagle3-prepare")
def prepare(model: str, out: str, cfg: PrepareConfig, trust_remote_code: bool = False) -> PreparedData:
    """Stage 1 alone: tokenize and mask conversations, build the draft vocab map."""
    return _done("prepare", out, lambda: own("prepare", out)(model, out, cfg, trust_remote_code))


@flow(name="eagle3-extract")
def extract(model: str, prepared: str, out: str, cfg: ExtractConfig, reuse: list[str] | None = None,
            trust_remote_code: bool = False, part: int | None = None) -> HiddenStates | HiddenRange:
    """Stage 2 alone: store the target's hidden states of a prepared dir, reusing earlier extract dirs. `part`:
    only that range of cfg.workers (a pipeline's extraction over several workers starts one flow run per range;
    its commit runs in the pipeline)."""
    if part is None:
        if cfg.workers > 1:
            return _done("extract", out, lambda: run_ranges(out, model=model, prepared=prepared, cfg=cfg, reuse=reuse,
                                                            trust_remote_code=trust_remote_code)[0])
        return _done("extract", out, lambda: own("extract", out)(model, prepared, out, cfg, reuse, trust_remote_code))
    hopped = FlowRunContext.get().flow_run.parent_task_run_id is not None
    t = fresh_range(out, part, cfg.workers)
    m = (t.with_options(retries=0) if hopped else t)(model, prepared, out, cfg, part, reuse, trust_remote_code)
    publish_range(m, out)
    get_run_logger().info("%s: %s", range_label(part, cfg.workers), range_headline(m))
    return m


@flow(name="eagle3-verifier")
def verifier(model: str, prepared: str, out: str) -> VerifierWeights:
    """Stage 3 alone: read the target's embedding, final norm and lm_head."""
    return _done("verifier", out, lambda: own("verifier", out)(model, prepared, out))


@flow(name="eagle3-train")
def train(hidden: str, verifier: str, out: str, cfg: TrainConfig, verifier_name: str = "", model: str = "",
          prepared: str = "", trust_remote_code: bool = False, online: OnlineSource | None = None,
          node_rank: int = 0) -> TrainedDraft:
    """Stage 4 alone: train the draft under torchrun (a retry resumes from its last checkpoint); `online`:
    `hidden` is the spool an eagle3-produce run fills beside it; `node_rank`: this host's node of cfg.nnodes
    (a flow run per node, started together)."""
    # beside a producer, the devices after the producer's; alone, every visible device
    devices = (split_devices(online.producer_slots, cfg.nproc_per_node) or [None, None])[1] if online else None
    task = own("train", out)
    if cfg.nnodes > 1:
        task = task.with_options(task_run_name=node_name("train", node_rank))
    return _done("train", out, lambda: task(hidden, verifier, out, cfg, verifier_name, model, prepared,
                                            trust_remote_code, online, devices, node_rank))


@flow(name="eagle3-produce")
def produce(model: str, prepared: str, out: str, cfg: ExtractConfig, train: TrainConfig, spool_bytes: int,
            wait_s: float = SPOOL_WAIT_S, trust_remote_code: bool = False, part: int | None = None) -> SpooledStates:
    """Online, beside an eagle3-train run reading the spool `out`: fill it with the target's hidden states in
    the read order of `train`, as the trainer reads them (the spool never holds more than spool_bytes). `part`:
    producer `part` of cfg.workers (its own windows; a pipeline starts one flow run per producer). On this
    host it takes the first devices (the trainer's flow run, on the same host, takes those after them)."""
    devices = (split_devices(cfg.tensor_parallel_size * cfg.pipeline_parallel_size, train.nproc_per_node)
               or [None, None])[0]
    return _done("produce", out, lambda: own("produce", out)(model, prepared, out, cfg, train, spool_bytes, wait_s,
                                                             trust_remote_code, devices, part))


@flow(name="eagle3-eval")
def evaluate(model: str, draft: str, out: str, cfg: EvalConfig, trust_remote_code: bool = False) -> EvalReport:
    """Stage 5 alone: acceptance length, speedup and the lossless check of a draft."""
    return _done("eval", out, lambda: own("eval", out)(model, draft, out, cfg, trust_remote_code))
