"""Extraction over `extract.workers`: one task per range of the shard plan, submitted at once, then the commit.

Each range hops to the extract deployment when the GPU stages hop (its flow run goes to whichever GPU worker
takes it), else runs here on its own devices; the commit runs here (it renames files on the storage both pools
share). A failed range is retried alone (it resumes); the commit waits for all.
"""
from __future__ import annotations

from prefect import get_run_logger

from eagle3.runtime.heap import PeakRSS
from eagle3.storage.manifests import HiddenRange, HiddenStates
from flows.hop import as_params, deployment, gpu_suffix, hop_task, settle, wait_all
from tasks._cache import fresh
from tasks._gpus import split_devices
from tasks.extract import commit_task, extract_range_task, range_label


def run_ranges(out: str, wait_for=None, **inputs) -> tuple[HiddenStates, str, str, PeakRSS | None]:
    """Every range of cfg.workers into `out`, then the commit. Returns (manifest, how, memory line, peak: None
    where the ranges hopped)."""
    log, cfg = get_run_logger(), inputs["cfg"]
    n, suffix = cfg.workers, gpu_suffix()
    labels = [range_label(k, n) for k in range(n)]
    if suffix:
        where = deployment("extract", suffix)
        log.info("extract: %d ranges started on deployment %s, output %s", n, where, out)
        futures = [hop_task(extract_range_task, label).submit(label, where, as_params({**inputs, "out": out,
                                                                                       "part": k}), wait_for=wait_for)
                   for k, label in enumerate(labels)]
        mem, peak = "", None
    else:
        log.info("extract: %d ranges started, output %s", n, out)
        engine = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
        devices = split_devices(*[engine] * n) or [None] * n
        with PeakRSS() as peak:
            futures = [fresh_range(out, k, n).submit(out=out, part=k, devices=d, wait_for=wait_for, **inputs)
                       for k, d in enumerate(devices)]
            settle(futures)
        mem = f", {peak.line()}"
    cached = all(s.name == "Cached" for s in wait_all("extract", futures, labels))
    state = fresh(commit_task, HiddenStates, out)(out=out, return_state=True, **inputs)
    how = "cached (inputs unchanged)" if cached and state.name == "Cached" else f"done over {n} workers"
    return state.result(), how, mem, peak


def fresh_range(out: str, k: int, n: int):
    """The range task for range k of n: a cached range whose dir is gone (and whose store was never committed)
    must rerun."""
    from eagle3.extract.ranges import range_dir

    done = HiddenRange.exists(range_dir(out, k, n)) or HiddenStates.exists(out)
    return extract_range_task if done else extract_range_task.with_options(refresh_cache=True)
