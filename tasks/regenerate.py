"""Prefect task for the optional stage 0 (regenerate): the target rewrites the assistant turns."""
from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from eagle3.config import RegenConfig
from eagle3.regenerate.run import progress_line, regenerate
from eagle3.storage.manifests import RegeneratedData
from tasks._cache import stage_task


def stats_table(m: RegeneratedData) -> list[dict[str, Any]]:
    s = m.stats
    return [
        {"what": "records read", "value": m.records_read},
        {"what": "records written", "value": m.records_written},
        *({"what": f"skipped: {k}", "value": v} for k, v in m.skipped.items()),
        {"what": "assistant turns written", "value": m.turns_written},
        {"what": "turns cut at max_new_tokens", "value": m.turns_cut},
        {"what": "conversations shortened", "value": m.conversations_shortened},
        {"what": "records reused from earlier runs", "value": s.get("records_reused")},
        {"what": "records resumed (already committed)", "value": s.get("records_resumed")},
        {"what": "tokens generated this run", "value": s.get("tokens_generated")},
        {"what": "tok/s", "value": s.get("tokens_per_second")},
        {"what": "backend", "value": m.backend},
        {"what": "settings", "value": str(m.settings)},
    ]


def samples_markdown(m: RegeneratedData) -> str:
    """The first records side by side: the source's answer against the target's own."""
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", "<br>")

    md = ["# eagle3 regenerate: original vs regenerated (first assistant turn)", "",
          "| record | user | original | regenerated |", "|---|---|---|---|"]
    md += [f"| {cell(str(s['id']))} | {cell(s['user'])} | {cell(s['original'])} | {cell(s['regenerated'])} |"
           for s in m.samples]
    return "\n".join(md)


@stage_task("regenerate", retries=2, delay=10)
def regenerate_task(model: str, data: str, out: str, cfg: RegenConfig,
                    trust_remote_code: bool = False) -> RegeneratedData:
    """Rewrite every assistant turn of `data` with the target (a retry resumes at the last committed chunk)."""
    log = get_run_logger()
    total = cfg.limit
    art = create_progress_artifact(0.0, description="eagle3 regenerate: share of records done") if total else None
    last = [0.0]

    def progress(p: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - last[0] > 10:
            last[0] = now
            log.info(progress_line(p))
            if art is not None:
                update_progress_artifact(art, min(100.0, 100.0 * p["records_read"] / total))

    m = regenerate(model, data, out, cfg, progress=progress, trust_remote_code=trust_remote_code)
    if art is not None:
        update_progress_artifact(art, 100.0)
    log.info("regenerate: %d of %d records written, %d turns; %s tok/s; skipped %s",
             m.records_written, m.records_read, m.turns_written, m.stats.get("tokens_per_second"), m.skipped)
    return m


def publish(m: RegeneratedData, out: str) -> None:
    """The stage's artifacts, made by the flow that ran it (a cached task does not rerun its body)."""
    create_table_artifact(stats_table(m), key="regenerate-stats", description="eagle3 regenerate: records, tok/s")
    create_markdown_artifact(samples_markdown(m), key="regenerate-samples",
                             description="eagle3 regenerate: original vs regenerated answers")
