"""The eagle3 pipeline as a Prefect flow: prepare -> (extract -> verifier -> train -> eval)."""
from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from eagle3.artifacts import PreparedData
from eagle3.config import PipelineConfig
from tasks.prepare import counts_table, prepare_task


def _fresh(task, done: bool):
    """A cached result whose output dir is gone must rerun, not return a dangling manifest."""
    return task if done else task.with_options(refresh_cache=True)


@flow(name="eagle3-pipeline", log_prints=True)
def pipeline(config: PipelineConfig = PipelineConfig()) -> dict[str, str]:
    """Train an EAGLE-3 draft for `config.model` from chat data."""
    prep_dir = config.stage_dir("prepare")
    prepared = _fresh(prepare_task, PreparedData.exists(prep_dir))(
        str(config.model), str(prep_dir), config.prepare
    )
    # Per-run summary lives in the flow: a cached task does not re-create its artifacts.
    rows = "\n".join(f"| {r['what']} | {r['value']} |" for r in counts_table(prepared))
    create_markdown_artifact(
        f"# eagle3 run `{config.run_dir}`\n\n| stage | dir | fingerprint |\n|---|---|---|\n"
        f"| prepare | `{prep_dir}` | `{prepared.fingerprint[:16]}` |\n\n"
        f"## prepare\n\n| what | value |\n|---|---|\n{rows}\n",
        key="eagle3-run-summary",
        description="eagle3 run summary",
    )
    return {"prepare": str(prep_dir)}
