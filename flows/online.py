"""Online: extraction and training as one step. The producers (`produce`, not a registered stage: it has no store
of its own) fill a bounded spool while the trainer reads it; they run as tasks submitted side by side, each
hopping to its own deployment (`eagle3-produce/produce-<suffix>`, `eagle3-train/...`) when the GPU stages hop,
and the step ends when all have.

None ends without the others (a producer waits while the spool is full, the trainer for its next window), so
they run as a pair: when the pair is not done for these inputs (tasks/_online.py) the spool is reset and all
run, none served from the cache. In this process they split the visible devices (each producer's engine in
turn, then the trainer's processes); hopped, each flow run (each producer on the GPU worker that takes it: its
own host) splits its host's devices the same way.
"""
from __future__ import annotations

import time

from prefect import get_run_logger

from eagle3.config import ExtractConfig, TrainConfig
from eagle3.runtime.heap import PeakRSS
from eagle3.runtime.progress import hms
from eagle3.storage.manifests import SpooledStates, TrainedDraft
from flows.hop import as_params, deployment, gpu_suffix, hop_task, settle
from flows.stages import TABLE, Times, record
from tasks._failures import PartnerGone, failure
from tasks._gpus import split_devices
from tasks._online import OnlineSource, pair_done, producer_inputs, reset_spool
from tasks.extract import produce_label

Sides = dict[str, tuple[str, dict]]  # task label -> (stage, its inputs): "produce k/N"..., "train"


def run_online(spool: str, train_out: str, *, model: str, prepared: str, extract: ExtractConfig, train: TrainConfig,
               spool_bytes: int, wait_s: float, verifier: str, verifier_name: str = "",
               trust_remote_code: bool = False, times: Times | None = None) -> tuple[SpooledStates, TrainedDraft]:
    """The producers (extract.workers of them, into the spool `spool`) and the trainer (into `train_out`) side by
    side; returns the spool's and the trainer's manifests once all ended, their artifacts published."""
    if train.nnodes > 1:  # the producer and the trainer split one host's devices
        raise ValueError(f"online training runs on one node; train.nnodes is {train.nnodes} (use mode offline)")
    online = OnlineSource(extract=extract, spool_bytes=spool_bytes, wait_s=wait_s)
    n = extract.workers
    common = dict(model=model, prepared=prepared, out=spool, cfg=extract, train=train, spool_bytes=spool_bytes,
                  wait_s=wait_s, trust_remote_code=trust_remote_code)
    # one producer: as before (no part); several: each its part, named "produce k/N"
    sides: Sides = {produce_label(k, n): ("produce", {**common, **({"part": k} if n > 1 else {})}) for k in range(n)}
    sides["train"] = ("train", dict(hidden=spool, verifier=verifier, out=train_out, cfg=train,
                                    verifier_name=verifier_name, model=model, prepared=prepared,
                                    trust_remote_code=trust_remote_code, online=online))
    fp = producer_inputs(model, prepared, extract, train, spool_bytes, trust_remote_code)
    rerun = not pair_done(spool, train_out, fp, verifier, train)
    if rerun:
        reset_spool(spool)
    t0, suffix = time.monotonic(), gpu_suffix()
    what = "produce" if n == 1 else f"produce ({n} producers)"
    start = f"{what} + train (online): started side by side"
    cap = f"spool {spool} (cap {spool_bytes:,} bytes), output {train_out}"
    if suffix:
        get_run_logger().info("%s on deployments %s and %s; %s", start, deployment("produce", suffix),
                              deployment("train", suffix), cap)
        futures, mem, peak = _hopped(sides, suffix, rerun), "", None  # each side ran in its deployment's process
    else:
        get_run_logger().info("%s; %s", start, cap)
        with PeakRSS() as peak:  # they share this process: one peak for all
            futures = _here(sides, online.producer_slots, train.nproc_per_node, rerun)
        mem = f", {peak.line()}"
    _raise_cause(futures)
    ms = {"produce": SpooledStates.read(spool), "train": TrainedDraft.read(train_out)}  # the spool's: every producer's
    for stage, m in ms.items():
        mine = [f for label, f in futures.items() if sides[label][0] == stage]
        how = "cached (inputs unchanged)" if all(f.state.name == "Cached" for f in mine) else "done"
        TABLE[stage].publish(m, spool if stage == "produce" else train_out)
        get_run_logger().info("%s: %s in %s%s: %s", stage, how, hms(time.monotonic() - t0), mem,
                              TABLE[stage].headline(m))
        record(times, stage, time.monotonic() - t0, how, peak)
    return ms["produce"], ms["train"]


def _hopped(sides: Sides, suffix: str, rerun: bool) -> dict:
    """Each side as a hop to its stage's deployment; on a rerun the stage flows' tasks refresh their cache too."""
    jobs = {"env": {"PREFECT_TASKS_REFRESH_CACHE": "true"}} if rerun else None
    futures = {label: hop_task(TABLE[stage].task, label).submit(label, deployment(stage, suffix), as_params(args),
                                                                jobs)
               for label, (stage, args) in sides.items()}
    settle(list(futures.values()))
    return futures


def _here(sides: Sides, producer_slots: int, trainer_slots: int, rerun: bool) -> dict:
    """Each side as its stage's task in this process, on its share of the visible devices (each producer's engine
    in turn, then the trainer's processes); a stop here also stops the trainer's torchrun on its thread."""
    n = len(sides) - 1
    devices = split_devices(*[producer_slots] * n, trainer_slots) or [None] * (n + 1)
    futures = {}
    for (label, (stage, args)), d in zip(sides.items(), devices, strict=True):
        t = TABLE[stage].task.with_options(task_run_name=label)
        futures[label] = (t.with_options(refresh_cache=True) if rerun else t).submit(**args, devices=d)
    settle(list(futures.values()))
    return futures


def _raise_cause(futures: dict) -> None:
    """Where a side failed, raise the error of the one that caused it: the first that is not PartnerGone (the
    others' PartnerGone follows from it), after logging how each ended."""
    failed = [(label, f.state) for label, f in futures.items() if not f.state.is_completed()]
    if failed:
        label, state = next(((lb, s) for lb, s in failed if not isinstance(failure(s), PartnerGone)), failed[0])
        get_run_logger().error("online: %s; raising %s's error", ", ".join(f"{m} ended {s.name}" for m, s in failed),
                               label)
        state.result()  # raises the task's own exception
