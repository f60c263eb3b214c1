"""Prefect task for stage 5 (eval)."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eagle3.config import EvalConfig
from eagle3.eval.run import evaluate
from eagle3.runtime.progress import Meter
from eagle3.storage.manifests import EvalReport
from tasks._cache import stage_task
from tasks._gpus import hold_gpus


def _r(x: float | None, nd: int) -> float | str:
    return "n/a (replay)" if x is None else round(x, nd)


def results_table(m: EvalReport) -> list[dict[str, Any]]:
    rows = [
        {"what": "acceptance length (tau)", "value": round(m.acceptance_length, 4)},
        {"what": "k", "value": m.k},
        {"what": "lossless", "value": m.lossless},
        {"what": "mode", "value": m.mode},
        {"what": "tau 95% CI (replay)", "value": str(m.acceptance_length_ci)},
        {"what": "tokens/s (speculative)", "value": _r(m.tokens_per_second, 2)},
        {"what": "tokens/s (target greedy)", "value": _r(m.target_tokens_per_second, 2)},
        {"what": "speedup vs target", "value": _r(m.speedup_vs_target, 3)},
        {"what": "prompts / turns", "value": f"{m.num_prompts} / {m.num_turns}"},
        {"what": "verify passes", "value": m.num_drafts},
        {"what": "backend / head format", "value": f"{m.backend} / {m.draft_format}"},
    ]
    rows += [{"what": f"acceptance at position {i}", "value": round(a, 4)}
             for i, a in enumerate(m.per_position_acceptance, 1)]
    return rows


def report_markdown(m: EvalReport, out: str | Path) -> str:
    """The results table plus the per-position plot, embedded (the UI cannot read the worker's disk)."""
    lines = [f"# eagle3 eval: `{m.draft_dir}`", "", "| what | value |", "|---|---|"]
    lines += [f"| {r['what']} | {r['value']} |" for r in results_table(m)]
    png = Path(out) / m.plot_file if m.plot_file else None
    if png is not None and png.is_file():
        b64 = base64.b64encode(png.read_bytes()).decode()
        lines += ["", f"![per-position acceptance](data:image/png;base64,{b64})"]
    lines += ["", f"report: `{Path(out) / m.report_file}`"]
    return "\n".join(lines) + "\n"


def publish(m: EvalReport, out: str) -> None:
    """The stage's artifacts, made by the flow that ran it (a cached task does not rerun its body)."""
    create_table_artifact(results_table(m), key="eval-results", description="eagle3 eval: tau, speed, lossless")
    create_markdown_artifact(report_markdown(m, out), key="eval-report", description="eagle3 eval: report and plot")


@stage_task("eval", retries=1, delay=10)
def eval_task(model: str, draft: str, out: str, cfg: EvalConfig, trust_remote_code: bool = False) -> EvalReport:
    """Measure a draft head: acceptance length, speedup over plain greedy, lossless check."""
    log = get_run_logger()
    beat = Meter("eval", 0, say=log.info)  # "eval: 2m10s in; working" in any 30 s the eval's own lines leave
    with hold_gpus(), beat.ticking():  # the target and the draft on the GPU host's devices
        m = evaluate(model, draft, out, cfg, progress=beat.relay(log.info), trust_remote_code=trust_remote_code)
    log.info("eval (%s): tau %.3f at k=%d, lossless %s, %s tok/s, speedup %s over greedy", m.mode,
             m.acceptance_length, m.k, m.lossless, _r(m.tokens_per_second, 2), _r(m.speedup_vs_target, 3))
    return m
