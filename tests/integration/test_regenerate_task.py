"""Stage 0 under a real (test-harness) Prefect server: content-keyed cache, artifacts, prepare reads its output."""
from __future__ import annotations

import json

from eagle3.config import PipelineConfig, PrepareConfig, RegenConfig
from tests.helpers.regen import write_source


def _states(flow_state) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        runs = c.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}


def _artifact(key: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as c:
        return c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=1,
                                sort="CREATED_DESC")[0]


def test_stage0_cached_on_content_and_prepare_reads_it(tmp_path, tiny_llama_dir, prefect_env):
    from prefect import flow

    from flows.pipeline import regenerate
    from tasks.prepare import prepare_task

    src = write_source(tmp_path / "chats.jsonl", 5)
    cfg = PipelineConfig(model=str(tiny_llama_dir), run_dir=str(tmp_path / "run"),
                         prepare=PrepareConfig(data=str(src), draft_vocab=64),
                         regenerate=RegenConfig(max_new_tokens=6))

    @flow
    def stage0_then_prepare(config: PipelineConfig):
        m, prep_cfg = regenerate(config)
        prepared = prepare_task(str(config.model), str(config.stage_dir("prepare")), prep_cfg)
        return m, prep_cfg, prepared

    state = stage0_then_prepare(cfg, return_state=True)
    m, prep_cfg, prepared = state.result()
    assert _states(state) == {"regenerate": "Completed", "prepare": "Completed"}
    assert prep_cfg.data == str(tmp_path / "run" / "regenerate" / "regenerated.jsonl")
    assert (m.records_written, prepared.records_kept) == (5, 5)
    assert prepared.source_fingerprint == m.sha256  # prepare read the regenerated file, not the raw source
    table = {r["what"]: r["value"] for r in json.loads(_artifact("regenerate-stats").data)}
    assert table["records written"] == 5 and table["tok/s"] > 0
    assert "| r0 | question 0: what is 0 plus 0? | 0 plus 0 is 0. |" in _artifact("regenerate-samples").data

    state = stage0_then_prepare(cfg, return_state=True)
    assert _states(state) == {"regenerate": "Cached", "prepare": "Cached"}
    # Same path, new content: stage 0 reruns; a batch-size change alone does not.
    src.write_text(src.read_text().replace("question 4:", "question four:"))
    state = stage0_then_prepare(cfg.model_copy(update={"regenerate": RegenConfig(max_new_tokens=6, batch_size=2)}),
                                return_state=True)
    assert _states(state) == {"regenerate": "Completed", "prepare": "Completed"}
    m2 = state.result()[0]
    assert m2.stats["records_reused"] == 4  # the dir's previous output: only the edited record is regenerated
