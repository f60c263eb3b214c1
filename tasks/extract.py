"""Prefect tasks for stage 2: extract (offline, into a store; with several workers, one task per range of the
shard plan, then the commit) and produce (online, into the trainer's spool)."""
from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from eagle3.config import SPOOL_WAIT_S, ExtractConfig, TrainConfig
from eagle3.extract import run_extract
from eagle3.runtime.progress import Meter
from eagle3.storage.manifests import HiddenRange, HiddenStates, SpooledStates
from tasks._cache import cached_task, content_policy, stage_task
from tasks._failures import PartnerGone, retry_unless_final
from tasks._faults import fail_once
from tasks._gpus import cuda_devices, gpu_slots, hold_gpus
from tasks._online import partner_gone, producer_inputs


def stats_table(m: HiddenStates) -> list[dict[str, Any]]:
    s = m.stats
    return [
        {"what": "samples", "value": m.num_samples},
        {"what": "tokens", "value": m.num_tokens},
        {"what": "tokens computed this run", "value": s.get("tokens_computed")},
        {"what": "tok/s", "value": s.get("tokens_per_second")},
        {"what": "bytes/token", "value": s.get("bytes_per_token")},
        {"what": "bytes/token / (4*H*2)", "value": s.get("bytes_ratio")},
        {"what": "shards", "value": len(m.shards)},
        {"what": "shards resumed (already committed)", "value": s.get("shards_skipped")},
        {"what": "samples reused from earlier runs", "value": s.get("samples_reused")},
        {"what": "layer ids", "value": str(m.layer_ids)},
        {"what": "storage", "value": m.storage},
    ]


def publish(m: HiddenStates, out: str) -> None:
    """The stage's artifacts, made by the flow that ran it (a cached task does not rerun its body)."""
    create_table_artifact(stats_table(m), key="extract-stats",
                          description="eagle3 extract: tokens, tok/s, bytes, shards")


def _pace(log, what: str, cap: int | None = None):
    """The `progress(done, total[, spool_now])` callback of an extraction (`cap` None) or a producer (`cap`: the
    spool's byte cap): a progress artifact (every 5 s, and at the end), a log line every 20 s with tok/s and an
    ETA (`progress.meter`; inside `progress.meter.ticking()` also after 25 s without one: within a long batch,
    or a producer waiting for the trainer to make room), the spool's bytes now / its cap for a producer, and
    the drill's injected failure halfway (when EAGLE3_FAIL_ONCE asks for one)."""
    kind = "produce" if cap is not None else "extract"
    share = "share of tokens produced" if cap is not None else "share of tokens done"
    art = create_progress_artifact(0.0, description=f"eagle3 {what}: {share}")
    meter = Meter(what, 0, "tokens", say=log.info)
    last = [0.0]

    def progress(done: int, total: int, spool_now: int | None = None) -> None:
        note = f"spool {spool_now:,} / {cap:,} bytes" if cap is not None and spool_now is not None else ""
        now = time.monotonic()
        if total and (now - last[0] > 5 or done >= total):
            last[0] = now
            update_progress_artifact(art, min(100.0, 100.0 * done / total),
                                     **({"description": f"eagle3 {what}: {share}; {note}"} if note else {}))
        if total:
            meter.update(done, note, total=total)
        if total and done >= total / 2:
            fail_once(kind)  # a drill, when EAGLE3_FAIL_ONCE asks for one

    progress.artifact, progress.meter = art, meter
    return progress


@stage_task("extract", retries=2, delay=10)
def extract_task(
    model: str, prepared: str, out: str, cfg: ExtractConfig, reuse: list[str] | None = None,
    trust_remote_code: bool = False,
) -> HiddenStates:
    """Store the target's aux + final hidden states of the prepared samples (a retry resumes)."""
    log = get_run_logger()
    progress = _pace(log, "extract")
    with hold_gpus(), progress.meter.ticking():
        m = run_extract(model, prepared, out, cfg, reuse=reuse or [], progress=progress, show_progress=False,
                        trust_remote_code=trust_remote_code)
    update_progress_artifact(progress.artifact, 100.0)
    log.info("extract: %d samples, %d tokens in %d shards (%s resumed); %s tok/s; %.1f bytes/token",
             m.num_samples, m.num_tokens, len(m.shards), m.stats.get("shards_skipped"),
             m.stats.get("tokens_per_second"), m.stats.get("bytes_per_token", 0.0))
    return m


# ---------------------------------------------------------------- several workers: ranges, then the commit
def range_label(part: int, parts: int) -> str:
    """How a range shows in task and flow run names: 1-based, "extract 1/4"."""
    return f"extract {part + 1}/{parts}"


def _range_key(i: dict[str, Any]) -> dict[str, Any]:
    from eagle3.extract.ranges import range_inputs
    from eagle3.extract.resume import inputs

    cfg = i["cfg"]
    return {"format": HiddenRange.format_version,
            **range_inputs(inputs(i["model"], i["prepared"], cfg, i.get("trust_remote_code", False)), i["part"],
                           cfg.workers)}


@cached_task(name="extract-range", task_run_name="extract {part}",
             cache_policy=content_policy("extract-range", _range_key), retries=2, retry_delay_seconds=10)
def extract_range_task(model: str, prepared: str, out: str, cfg: ExtractConfig, part: int,
                       reuse: list[str] | None = None, trust_remote_code: bool = False,
                       devices: list[str] | None = None) -> HiddenRange:
    """Range `part` of cfg.workers into out/ranges/ (a retry resumes it alone, keeping its committed shards).
    `devices`: its engine's GPUs (CUDA_VISIBLE_DEVICES) where ranges share a host; None: what the process sees."""
    from eagle3.extract.ranges import run_range

    log, what = get_run_logger(), range_label(part, cfg.workers)
    progress = _pace(log, what)
    with hold_gpus(devices), cuda_devices(devices), progress.meter.ticking():
        m = run_range(model, prepared, out, cfg, part, reuse=reuse or [], progress=progress, show_progress=False,
                      trust_remote_code=trust_remote_code)
    update_progress_artifact(progress.artifact, 100.0)
    log.info("%s: %d shards, %d tokens (%s resumed); %s tok/s", what, len(m.shards), m.num_tokens,
             m.stats.get("shards_skipped"), m.stats.get("tokens_per_second"))
    return m


def publish_range(m: HiddenRange, out: str) -> None:
    """A range's artifact, made by the flow that ran it."""
    create_table_artifact([{"what": "range", "value": range_label(m.part, m.parts)},
                           {"what": "shards", "value": len(m.shards)}, {"what": "tokens", "value": m.num_tokens},
                           {"what": "tokens computed this run", "value": m.stats.get("tokens_computed")},
                           {"what": "tok/s", "value": m.stats.get("tokens_per_second")},
                           {"what": "shards resumed (already committed)", "value": m.stats.get("shards_skipped")}],
                          key="extract-range-stats", description="eagle3 extract, one range: shards, tokens, tok/s")


def range_headline(m: HiddenRange) -> str:
    return (f"{len(m.shards)} shards, {m.num_tokens:,} tokens ({m.stats.get('tokens_computed', 0) or 0:,} computed "
            f"at {m.stats.get('tokens_per_second')} tok/s)")


@stage_task("extract", retries=2, delay=10)
def commit_task(model: str, prepared: str, out: str, cfg: ExtractConfig, reuse: list[str] | None = None,
                trust_remote_code: bool = False) -> HiddenStates:
    """The finished ranges' shards moved into one store (the extract stage's output; no GPU, no copy)."""
    from eagle3.extract.ranges import commit_ranges

    m = commit_ranges(model, prepared, out, cfg, trust_remote_code=trust_remote_code)
    get_run_logger().info("extract: %d ranges committed: %d samples, %d tokens in %d shards", cfg.workers,
                          m.num_samples, m.num_tokens, len(m.shards))
    return m


# ---------------------------------------------------------------- online: the producer
def _produce_key(i: dict[str, Any]) -> dict[str, Any]:
    # each producer of several is its own task run: their keys differ by the part
    return {"format": SpooledStates.format_version, **({"part": i["part"]} if i.get("part") is not None else {}),
            **producer_inputs(i["model"], i["prepared"], i["cfg"], i["train"], i["spool_bytes"],
                              i.get("trust_remote_code", False))}


def produce_label(part: int | None, parts: int) -> str:
    """How a producer shows in task and flow run names: "produce", or 1-based "produce 1/4" of several."""
    return "produce" if parts == 1 else f"produce {(part or 0) + 1}/{parts}"


def spool_table(m: SpooledStates) -> list[dict[str, Any]]:
    s = m.stats
    return [
        {"what": "tokens produced", "value": s.get("tokens_produced")},
        {"what": "tok/s", "value": s.get("tokens_per_second")},
        {"what": "windows (val + train)", "value": m.num_windows},
        {"what": "windows written", "value": s.get("windows_written")},
        {"what": "windows written again (trainer resumed)", "value": s.get("windows_written_again")},
        {"what": "windows evicted", "value": s.get("windows_evicted")},
        {"what": "spool peak / cap (bytes)", "value": f"{s.get('peak_spool_bytes', 0):,} / {m.spool_bytes:,}"},
        {"what": "optimizer steps fed", "value": s.get("total_steps")},
        {"what": "backend", "value": m.backend},
    ]


def publish_spool(m: SpooledStates, out: str) -> None:
    """The producer's artifacts, made by the flow that ran it (a cached task does not rerun its body)."""
    create_table_artifact(spool_table(m), key="produce-stats",
                          description="eagle3 produce (online): tokens, tok/s, windows, spool peak")


def spool_headline(m: SpooledStates) -> str:
    s = m.stats
    return (f"{s.get('tokens_produced', 0):,} tokens produced at {s.get('tokens_per_second')} tok/s in "
            f"{s.get('windows_written')} windows ({s.get('windows_written_again')} again); spool peak "
            f"{s.get('peak_spool_bytes', 0):,} of {m.spool_bytes:,} bytes")


@cached_task(name="produce", task_run_name="produce", cache_policy=content_policy("produce", _produce_key), retries=2,
             retry_delay_seconds=10, retry_condition_fn=retry_unless_final)
def produce_task(model: str, prepared: str, out: str, cfg: ExtractConfig, train: TrainConfig, spool_bytes: int,
                 wait_s: float = SPOOL_WAIT_S, trust_remote_code: bool = False,
                 devices: list[str] | None = None, part: int | None = None) -> SpooledStates:
    """Online: fill the spool `out` with the target's hidden states in the read order of the trainer of `train`,
    which runs beside this task; end once it has read every window. `part`: with cfg.workers producers, this is
    producer `part` (its own windows only; the spool's manifest is the last one's). `devices`: the GPUs of the
    producer's engine (CUDA_VISIBLE_DEVICES), of those the trainer and the other producers do not use; None:
    whatever the process sees. A retry resumes: windows the trainer still needs stay, production restarts at
    its position."""
    from eagle3.extract.online import produce
    from eagle3.storage.spool import TRAINER_BEAT

    log, since = get_run_logger(), time.time()
    order = train.read_order(train.world)
    # what the train task (and, in this process, the other producers) hold beside this one
    engine = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    beside = train.nproc_per_node + (cfg.workers - 1) * engine if devices is not None else gpu_slots()
    pace = _pace(log, "produce", cap=spool_bytes)
    with hold_gpus(devices, beside=beside), cuda_devices(devices), pace.meter.ticking():
        try:
            m = produce(model, prepared, out, cfg, order, spool_bytes, part=part, wait_s=wait_s, progress=pace,
                        trust_remote_code=trust_remote_code)
        except RuntimeError as e:
            if partner_gone(out, TRAINER_BEAT, wait_s, since):
                raise PartnerGone(f"produce: the trainer of {out} has shown no sign of life for {wait_s:.0f} s; "
                                  f"{e}") from e
            raise
    update_progress_artifact(pace.artifact, 100.0)  # the trainer read every window (a retry counts its own tokens)
    log.info("produce: %s", spool_headline(m))
    return m
