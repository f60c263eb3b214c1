"""Every stage as its own flow, so that a deployment can place it on another work pool, and `run_stage`: how the
pipeline and the nightly flow call a stage.

A stage runs in the calling flow's process by default (`eagle3 run`), or, when the GPU stages hop
(flows/hop.py), as a flow run of its deployment on the `gpu` pool. Extraction over several workers fans out
over ranges (flows/ranges.py); online, extraction and training run as one pair (flows/online.py).
"""
from __future__ import annotations

import importlib
import time
from typing import Any, Callable, NamedTuple

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

from eagle3.config import SPOOL_WAIT_S, EvalConfig, ExtractConfig, PrepareConfig, RegenConfig, TrainConfig
from eagle3.registry import STAGES as LIBRARY
from eagle3.runtime.heap import PeakRSS
from eagle3.runtime.progress import hms
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
from flows.hop import as_params, deployment, gpu_suffix, hop_task, wait_all
from flows.ranges import fresh_range, run_ranges
from tasks._cache import fresh
from tasks._failures import Final, end_failed
from tasks._gpus import split_devices
from tasks._online import OnlineSource
from tasks.extract import produce_task, publish_range, publish_spool, range_headline, range_label, spool_headline


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


def record(times: Times | None, stage: str, seconds: float, how: str, peak: PeakRSS | None) -> None:
    """Note a stage's figures in the run's `times` (the pipeline's closing table): seconds, how ("done",
    "cached ..."), peak_rss (this process's, per stage; None where the stage hopped to another process) and
    subprocesses_rss (the largest child's, None when none beat an earlier one)."""
    if times is not None:
        times[stage] = {"seconds": seconds, "how": how, "peak_rss": peak.own if peak else None,
                        "subprocesses_rss": peak.children if peak else None}


def run_stage(name: str, out: str, wait_for=None, times: Times | None = None, **inputs):
    """Run stage `name` into `out`, log its start and end with its key figures, publish its artifacts, note its
    figures in `times`. Training on several nodes (cfg.nnodes > 1) is one task per node, started together."""
    stage, log = STAGES[name], get_run_logger()
    suffix = gpu_suffix()
    nnodes = inputs["cfg"].nnodes if name == "train" else 1
    t0, peak, mem = time.monotonic(), None, ""  # no peak where the stage ran in another process
    if name == "extract" and inputs["cfg"].workers > 1:
        m, how, mem, peak = run_ranges(out, wait_for, **inputs)
    elif suffix and name in GPU_STAGES:
        m, how = _hopped(name, deployment(name, suffix), nnodes, out, wait_for, inputs)
    else:
        log.info("%s: started%s, output %s", name, f" on {nnodes} nodes" if nnodes > 1 else "", out)
        with PeakRSS() as peak:  # stages run one at a time here: each gets its own peak
            m, how = _here(name, nnodes, out, wait_for, inputs)
        mem = f", {peak.line()}"
    stage.publish(m, out)
    log.info("%s: %s in %s%s: %s", name, how, hms(time.monotonic() - t0), mem, stage.headline(m))
    record(times, name, time.monotonic() - t0, how, peak)
    return m


def _hopped(name: str, where: str, nnodes: int, out: str, wait_for, inputs: dict) -> tuple[Any, str]:
    """Stage `name` as a flow run of deployment `where` (one per node, each on a gpu worker of its own: a GPU
    host); its manifest, read from the stage dir on the storage both pools share."""
    get_run_logger().info("%s: started%s on deployment %s, output %s", name,
                          f" on {nnodes} nodes" if nnodes > 1 else "", where, out)
    params, policy = as_params({**inputs, "out": out}), STAGES[name].task
    if nnodes == 1:
        hop_task(policy, name)(name, where, params, wait_for=wait_for)
    else:
        labels = [node_name(name, k) for k in range(nnodes)]
        wait_all(name, [hop_task(policy, lb).submit(lb, where, {**params, "node_rank": k}, wait_for=wait_for)
                        for k, lb in enumerate(labels)], labels)
    return STAGES[name].manifest.read(out), "done"


def _here(name: str, nnodes: int, out: str, wait_for, inputs: dict) -> tuple[Any, str]:
    """Stage `name` as its task in this process (every node's torchrun under it where nnodes > 1: the nodes share
    this host); the manifest global rank 0 wrote, and whether it was cached."""
    task = fresh(STAGES[name].task, STAGES[name].manifest, out)
    if nnodes == 1:
        states = [task(out=out, wait_for=wait_for, return_state=True, **inputs)]
    else:
        labels = [node_name(name, k) for k in range(nnodes)]
        states = wait_all(name, [task.with_options(task_run_name=lb).submit(
            out=out, wait_for=wait_for, node_rank=k, **inputs) for k, lb in enumerate(labels)], labels)
    how = "cached (inputs unchanged)" if all(s.name == "Cached" for s in states) else "done"
    return states[0].result(), how


def node_name(name: str, k: int) -> str:
    return f"{name} (node {k})"


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
