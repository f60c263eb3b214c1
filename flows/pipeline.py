"""The eagle3 pipeline as a Prefect flow: prepare -> extract -> verifier -> train -> eval."""
from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eagle3.artifacts import EvalReport, HiddenStates, PreparedData, TrainedDraft, VerifierWeights
from eagle3.config import PipelineConfig
from tasks.evaluate import eval_task, results_table
from tasks.extract import extract_task, stats_table
from tasks.prepare import counts_table, prepare_task
from tasks.train import metrics_table, train_task
from tasks.verifier import verifier_task


def _fresh(task, manifest_cls, out):
    """A cached result whose output dir is gone must rerun, not return a dangling manifest."""
    return task if manifest_cls.exists(out) else task.with_options(refresh_cache=True)


@flow(name="eagle3-pipeline", log_prints=True)
def pipeline(config: PipelineConfig = PipelineConfig()) -> dict[str, str]:
    """Train an EAGLE-3 draft for `config.model` from chat data, then measure it."""
    model, d = str(config.model), {s: str(config.stage_dir(s)) for s in ("prepare", "extract", "verifier", "train", "eval")}

    prepared = _fresh(prepare_task, PreparedData, d["prepare"])(model, d["prepare"], config.prepare)
    hidden = _fresh(extract_task, HiddenStates, d["extract"])(model, d["prepare"], d["extract"], config.extract,
                                                              wait_for=[prepared])
    verifier = _fresh(verifier_task, VerifierWeights, d["verifier"])(model, d["prepare"], d["verifier"],
                                                                     wait_for=[prepared])
    trained = _fresh(train_task, TrainedDraft, d["train"])(d["extract"], d["verifier"], d["train"], config.train,
                                                           model, wait_for=[hidden, verifier])
    final = f"{d['train']}/{trained.final_dir}"
    report = _fresh(eval_task, EvalReport, d["eval"])(model, final, d["eval"], config.eval)

    # Per-run summary lives in the flow: a cached task does not re-create its artifacts.
    summarize(config, d, prepared, hidden, verifier, trained, report)
    return {**d, "final": final}


def summarize(config, d, prepared, hidden, verifier, trained, report) -> None:
    rows = [
        {"stage": s, "dir": d[s], "fingerprint": m.fingerprint[:16]}
        for s, m in (("prepare", prepared), ("extract", hidden), ("verifier", verifier), ("train", trained),
                     ("eval", report))
    ]
    create_table_artifact(rows, key="eagle3-run-stages", description=f"eagle3 run {config.run_dir}: stage dirs")
    md = [f"# eagle3 run `{config.run_dir}`", "",
          f"**tau = {report.acceptance_length:.3f}** at k={report.k} on {report.num_prompts} prompts; "
          f"speedup {report.speedup_vs_target:.2f}x over greedy; lossless: {report.lossless}.", "",
          f"Draft: `{d['train']}/{trained.final_dir}`; report: `{d['eval']}/report.json`.", ""]
    for title, table in (("prepare", counts_table(prepared)), ("extract", stats_table(hidden)),
                         ("train", metrics_table(trained)), ("eval", results_table(report))):
        md += [f"## {title}", "", "| what | value |", "|---|---|"]
        md += [f"| {r['what']} | {r['value']} |" for r in table] + [""]
    create_markdown_artifact("\n".join(md), key="eagle3-run-summary", description="eagle3 run summary")
