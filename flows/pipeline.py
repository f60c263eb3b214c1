"""The eagle3 pipeline as a Prefect flow: (regenerate ->) prepare -> extract -> verifier -> train -> eval; online
(`mode: online`), extract and train run side by side: prepare -> verifier -> produce + train -> eval."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import FlowRunContext
from pydantic import Field

from eagle3.config import PipelineConfig, PrepareConfig
from eagle3.planning.fit import fit, read_fit
from eagle3.storage.lock import RunLock
from eagle3.storage.manifests import EvalReport, RegeneratedData, SpooledStates, TrainedDraft
from flows.online import run_online
from flows.stages import Times, run_stage
from tasks.eval import results_table
from tasks.extract import spool_table, stats_table
from tasks.prepare import counts_table
from tasks.train import metrics_table

# What the run form starts from, and what "Quick run" runs: the demo preset (about 35 min on a
# 2-core CPU), each run in its own dir, never the demo's runs/demo.
DEMO = Path(__file__).resolve().parents[1] / "examples" / "smollm2-sharegpt.yaml"
FORM_DEFAULT = PipelineConfig.from_file(DEMO).model_copy(update={"run_dir": "runs/ui-{date}"})



@flow(name="eagle3-pipeline", log_prints=True)
def pipeline(config: PipelineConfig = FORM_DEFAULT, max_hours: Annotated[float, Field(ge=0)] = 0.0) -> dict[str, Any]:
    """Train an EAGLE-3 draft for the config's model from chat data, then measure it.

    Args:
        config: The whole run: the target model, the run dir and each stage's settings. The run dir may
            hold {date}, the UTC time this run was created.
        max_hours: Hours of wall time a run may take as the preflight estimates it (the first line of the
            eagle3-preflight artifact); a longer run is refused before it starts (0: no limit)
    """
    config = config.model_copy(update={"run_dir": expand(config.run_dir)})
    dirs, report = run_stages(config, max_hours=max_hours)
    get_run_logger().info("tau = %.3f at k=%d on %d prompts; speedup %s over greedy; lossless: %s; draft: %s",
                          report.acceptance_length, report.k, report.num_prompts,
                          "n/a" if report.speedup_vs_target is None else f"{report.speedup_vs_target:.2f}x",
                          report.lossless, dirs["final"])
    return {**dirs, "report": report}  # the stage dirs, `final` (the draft vLLM serves) and the EvalReport


def expand(run_dir: str) -> str:
    """`{date}` in a run dir: when this flow run was created, UTC (YYYYmmdd-HHMMSS). A retried flow
    run keeps its creation time, so its retry resumes in the same dir."""
    if "{date}" not in run_dir:
        return run_dir
    ctx = FlowRunContext.get()
    created = ctx.flow_run.created.timestamp() if ctx and ctx.flow_run and ctx.flow_run.created else time.time()
    return run_dir.replace("{date}", time.strftime("%Y%m%d-%H%M%S", time.gmtime(created)))


def run_stages(config: PipelineConfig, reuse: list[str] | None = None,
               max_hours: float = 0.0) -> tuple[dict[str, str], EvalReport]:
    """Preflight, the five stages in order, the run summary; `reuse`: earlier extract dirs (incremental runs)."""
    with RunLock(config.run_dir):  # two runs never write one run dir
        return _stages(config, reuse, max_hours)


def _stages(config: PipelineConfig, reuse: list[str] | None, max_hours: float) -> tuple[dict[str, str], EvalReport]:
    model, dirs = str(config.model), {s: str(config.stage_dir(s))
                                      for s in ("prepare", "extract", "verifier", "train", "eval")}
    trc = config.trust_remote_code  # the target's custom tokenizer code (Kimi) may run
    get_run_logger().info("run dir %s", config.run_dir)
    config, estimate = preflight(config, max_hours)
    times: Times = {}

    # GPU stages hop to the gpu pool when EAGLE3_GPU_DEPLOYMENT is set (flows/hop.py); else run here.
    prep_cfg = config.prepare
    if config.regenerate is not None:  # optional stage 0: prepare reads the target's own answers instead
        _, prep_cfg = regenerate(config, times)
    prepared = run_stage("prepare", dirs["prepare"], times=times, model=model, cfg=prep_cfg, trust_remote_code=trc)
    if config.mode == "online":  # the producer fills the extract dir, a bounded spool, while the trainer reads it
        verifier = run_stage("verifier", dirs["verifier"], times=times, model=model, prepared=dirs["prepare"],
                             wait_for=[prepared])
        hidden, trained = online(config, dirs, reuse, times)
    else:
        hidden = run_stage("extract", dirs["extract"], times=times, model=model, prepared=dirs["prepare"],
                           cfg=config.extract, reuse=reuse, trust_remote_code=trc, wait_for=[prepared])
        verifier = run_stage("verifier", dirs["verifier"], times=times, model=model, prepared=dirs["prepare"],
                             wait_for=[prepared])
        # model + prepared: the train stage first answers held-out prompts with the target (its replay set)
        trained = run_stage("train", dirs["train"], times=times, hidden=dirs["extract"], verifier=dirs["verifier"],
                            cfg=config.train, verifier_name=model, model=model, prepared=dirs["prepare"],
                            trust_remote_code=trc, wait_for=[hidden, verifier])
    final = f"{dirs['train']}/{trained.final_dir}"
    report = run_stage("eval", dirs["eval"], times=times, model=model, draft=final, cfg=config.eval,
                       trust_remote_code=trc)

    # Per-run summary lives in the flow: a cached task does not re-create its artifacts.
    summarize(config, dirs, prepared, hidden, verifier, trained, report, times_table(times, estimate))
    return {**dirs, "final": final}, report


def online(config: PipelineConfig, dirs: dict[str, str], reuse: list[str] | None,
           times: Times | None = None) -> tuple[SpooledStates, TrainedDraft]:
    """Extract and train in one step: the producer and the trainer as two tasks side by side (flows/online.py)."""
    if reuse:
        get_run_logger().info("online: the earlier extract dirs are not read (the producer computes every window "
                              "the trainer reads): %s", ", ".join(reuse))
    model = str(config.model)
    return run_online(dirs["extract"], dirs["train"], model=model, prepared=dirs["prepare"], extract=config.extract,
                      train=config.train, spool_bytes=config.spool_bytes, wait_s=config.spool_wait_s,
                      verifier=dirs["verifier"], verifier_name=model, trust_remote_code=config.trust_remote_code,
                      times=times)


def regenerate(config: PipelineConfig, times: Times | None = None) -> tuple[RegeneratedData, PrepareConfig]:
    """Stage 0 into <run_dir>/regenerate: its manifest, and the prepare config that reads its output."""
    out = config.stage_dir("regenerate")
    m = run_stage("regenerate", str(out), times=times, model=str(config.model), data=config.prepare.data,
                  cfg=config.regenerate, trust_remote_code=config.trust_remote_code)
    return m, config.prepare.model_copy(update={"data": str(out / m.file)})


def preflight(config: PipelineConfig, max_hours: float = 0.0) -> tuple[PipelineConfig, dict[str, float]]:
    """Refuse to start a run that cannot finish, or would take longer than `max_hours`; show the estimate either way.
    With `fit_minutes`, first size the run to this host (eagle3/planning/fit.py). Returns the config the stages run
    (fitted) and the estimated seconds of each remaining stage (on CPU scaled by this host's measured speed)."""
    from eagle3.planning import measure_host, plan

    host = measure_host(config)
    config, fitted = fit(config, host)
    p = plan(config, max_hours=max_hours, host=host)
    note = f"{fitted.line()}\n\n" if fitted else ""
    create_markdown_artifact(note + p.markdown(), key="eagle3-preflight",
                             description="eagle3 preflight: wall time, disk and memory estimate")
    if fitted:
        get_run_logger().info("%s", fitted.line())
    get_run_logger().info("preflight: %s; %s", p.time_line(), p.host.line())
    return config, p.refuse().seconds


def times_table(times: dict[str, dict[str, Any]], estimate: dict[str, float]) -> list[dict[str, Any]]:
    """One row per stage this run ran or found done: wall time, peak RSS (this process's, per stage; and the
    largest subprocess's), the preflight's estimate and measured / estimate."""
    from eagle3.runtime.progress import hms

    def gib(b: int | None) -> str:
        return "" if b is None else f"{b / 2**30:.2f} GiB"

    rows = []
    for stage, t in times.items():
        est = estimate.get("extract" if stage == "produce" else stage)  # online: the producer is extraction
        rows.append({"stage": stage, "wall": hms(t["seconds"]), "seconds": round(t["seconds"], 1),
                     "peak RSS": gib(t["peak_rss"]) or "(elsewhere)", "subprocesses": gib(t["subprocesses_rss"]),
                     "estimate": "" if est is None else hms(est),
                     "measured / estimate": "" if not est or t["how"] != "done" else round(t["seconds"] / est, 2),
                     "how": t["how"]})
    return rows


def summarize(config, dirs, prepared, hidden, verifier, trained, report, times: list[dict[str, Any]]) -> None:
    """The run's artifacts: a table of every stage dir, the draft and the report; the figures in markdown, ending
    with `times` (times_table), which also closes the run's log."""
    spooled = isinstance(hidden, SpooledStates)  # online: the extract dir was the producer's spool
    rows = [
        {"stage": name, "dir": dirs[s], "fingerprint": m.fingerprint[:16]}
        for s, name, m in (("prepare", "prepare", prepared), ("extract", "produce" if spooled else "extract", hidden),
                           ("verifier", "verifier", verifier), ("train", "train", trained), ("eval", "eval", report))
    ]
    rows += [{"stage": "draft", "dir": f"{dirs['train']}/{trained.final_dir}",
              "fingerprint": trained.weights_sha256[:16]},
             {"stage": "report", "dir": f"{dirs['eval']}/{report.report_file}",
              "fingerprint": report.fingerprint[:16]}]
    create_table_artifact(rows, key="eagle3-run-stages", description=f"eagle3 run {config.run_dir}: stage dirs")
    md = ["# eagle3 run", "", f"Run dir: `{config.run_dir}`", "",
          f"**tau = {report.acceptance_length:.3f}** at k={report.k} on {report.num_prompts} prompts; "
          f"speedup {report.speedup_vs_target or 0:.2f}x over greedy; lossless: {report.lossless}.", "",
          f"Draft: `{dirs['train']}/{trained.final_dir}`; report: `{dirs['eval']}/report.json`.", ""]
    if (fitted := read_fit(config.run_dir)) is not None:  # fit_minutes sized this run to its host
        md += [fitted.line(), ""]
        get_run_logger().info("%s", fitted.line())
    for title, table in (("prepare", counts_table(prepared)),
                         ("produce", spool_table(hidden)) if spooled else ("extract", stats_table(hidden)),
                         ("train", metrics_table(trained)), ("eval", results_table(report))):
        md += [f"## {title}", "", "| what | value |", "|---|---|"]
        md += [f"| {r['what']} | {r['value']} |" for r in table] + [""]
    if times:
        cols = list(times[0])
        grid = [f"| {' | '.join(cols)} |", "|" + "---|" * len(cols)]
        grid += [f"| {' | '.join(str(r[c]) for c in cols)} |" for r in times]
        md += ["## stages: wall time, peak memory, estimate", "", *grid, ""]
        create_table_artifact(times, key="eagle3-run-times",
                              description="eagle3 run: wall time, peak RSS and the preflight's estimate per stage")
        get_run_logger().info("stages: wall time, peak RSS, the preflight's estimate\n%s", "\n".join(grid))
    create_markdown_artifact("\n".join(md), key="eagle3-run-summary", description="eagle3 run summary")
