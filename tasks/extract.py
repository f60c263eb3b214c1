"""Prefect task for stage 2 (extract)."""
from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from eagle3.config import ExtractConfig
from eagle3.extract import run_extract
from eagle3.storage.manifests import HiddenStates
from tasks._cache import stage_task
from tasks._faults import fail_once
from tasks._gpus import hold_gpus


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


@stage_task("extract", retries=2, delay=10)
def extract_task(
    model: str, prepared: str, out: str, cfg: ExtractConfig, reuse: list[str] | None = None,
    trust_remote_code: bool = False,
) -> HiddenStates:
    """Store the target's aux + final hidden states of the prepared samples (a retry resumes)."""
    log = get_run_logger()
    art = create_progress_artifact(0.0, description="eagle3 extract: share of tokens done")
    last, logged, t0 = [0.0], [time.monotonic()], time.monotonic()

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if total and (now - last[0] > 5 or done == total):
            last[0] = now
            update_progress_artifact(art, 100.0 * done / total)
        if total and done and (now - logged[0] > 60 or done == total):  # a log line a minute: tok/s, ETA
            logged[0] = now
            rate = done / max(now - t0, 1e-9)
            log.info("extract: %d/%d tokens (%.0f%%), %.0f tok/s, ETA %.0f s", done, total, 100 * done / total,
                     rate, (total - done) / max(rate, 1e-9))
        if done >= total / 2:
            fail_once("extract")  # a drill, when EAGLE3_FAIL_ONCE asks for one

    with hold_gpus():
        m = run_extract(model, prepared, out, cfg, reuse=reuse or [], progress=progress, show_progress=False,
                        trust_remote_code=trust_remote_code)
    update_progress_artifact(art, 100.0)
    log.info("extract: %d samples, %d tokens in %d shards (%s resumed); %s tok/s; %.1f bytes/token",
             m.num_samples, m.num_tokens, len(m.shards), m.stats.get("shards_skipped"),
             m.stats.get("tokens_per_second"), m.stats.get("bytes_per_token", 0.0))
    return m
