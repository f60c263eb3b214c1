"""The pipeline flow under a real (test-harness) Prefect server: content-keyed caching."""
from __future__ import annotations

import json

import pytest

from eagle3.config import PipelineConfig, PrepareConfig


def run(cfg):
    from flows.pipeline import pipeline

    state = pipeline(cfg, return_state=True)
    assert state.is_completed(), state
    return state


def task_states(flow_state):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}


def test_second_run_is_cached_and_edited_input_is_not(tmp_path, smollm2_dir, prefect_env):
    src = tmp_path / "chats.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"answer {i}"}]}
            for i in range(12)]
    src.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = PipelineConfig(model=str(smollm2_dir), run_dir=str(tmp_path / "run"),
                         prepare=PrepareConfig(data=str(src), draft_vocab=64))
    assert task_states(run(cfg)) == {"prepare": "Completed"}
    assert task_states(run(cfg)) == {"prepare": "Cached"}
    # Same path, new content: the content key changes, so the stage reruns.
    src.write_text("\n".join(json.dumps(r) for r in rows[:-1]))
    s3 = run(cfg)
    assert task_states(s3) == {"prepare": "Completed"}
    from eagle3.artifacts import PreparedData

    assert PreparedData.read(tmp_path / "run" / "prepare").records_read == 11
    # A cached result whose output dir was deleted reruns instead of pointing at nothing.
    import shutil

    shutil.rmtree(tmp_path / "run" / "prepare")
    assert task_states(run(cfg)) == {"prepare": "Completed"}
    assert PreparedData.exists(tmp_path / "run" / "prepare")


def test_pipeline_config_validates():
    with pytest.raises(ValueError):
        PipelineConfig.model_validate({"prepare": {"max_len": 3}})
    with pytest.raises(ValueError):
        PipelineConfig.model_validate({"prepare": {"bogus": 1}})
    with pytest.raises(ValueError, match="exactly 3"):
        PipelineConfig.model_validate({"extract": {"aux_layer_ids": [1, 2]}})
