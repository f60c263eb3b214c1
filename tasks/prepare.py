"""Prefect task for stage 1 (prepare)."""
from __future__ import annotations

from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_table_artifact

from eagle3.config import PrepareConfig
from eagle3.prepare import prepare
from eagle3.storage.manifests import PreparedData
from tasks._cache import stage_task


def counts_table(m: PreparedData) -> list[dict[str, Any]]:
    rows = [
        {"what": "conversations read", "value": m.records_read},
        {"what": "conversations kept", "value": m.records_kept},
        *({"what": f"skipped: {k}", "value": v} for k, v in m.skipped.items()),
        {"what": "train samples", "value": sum(s.num_samples for s in m.splits.get("train", []))},
        {"what": "val samples", "value": sum(s.num_samples for s in m.splits.get("val", []))},
        {"what": "tokens", "value": m.num_tokens},
        {"what": "trainable tokens", "value": m.num_trainable_tokens},
        {"what": "draft vocab", "value": m.vocab_map.draft_vocab_size if m.vocab_map else 0},
        {"what": "draft vocab coverage", "value": round(m.vocab_map.coverage, 6) if m.vocab_map else 0},
        {"what": "unreadable tail bytes", "value": m.unreadable_tail_bytes},
    ]
    return rows


def publish(m: PreparedData, out: str) -> None:
    """The stage's artifacts, made by the flow that ran it (a cached task does not rerun its body)."""
    create_table_artifact(counts_table(m), key="prepare-counts", description="eagle3 prepare: counts")


@stage_task("prepare", retries=2, delay=5)
def prepare_task(model: str, out: str, cfg: PrepareConfig, trust_remote_code: bool = False) -> PreparedData:
    """Render, mask and tokenize the conversations; build the draft vocab map."""
    log = get_run_logger()
    m = prepare(model, out, cfg, progress=False, trust_remote_code=trust_remote_code)
    log.info("prepare: kept %d of %d conversations, %d tokens; skipped %s",
             m.records_kept, m.records_read, m.num_tokens, m.skipped)
    return m
