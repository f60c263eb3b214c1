"""The pipeline flow under a real (test-harness) Prefect server: every stage, content-keyed caching."""
from __future__ import annotations

import base64
import json
import shutil
import time

import pytest

from eagle3.config import EvalConfig, ExtractConfig, PipelineConfig, PrepareConfig, TrainConfig


def run(cfg):
    from flows.pipeline import pipeline

    state = pipeline(cfg, return_state=True)
    assert state.is_completed(), state
    return state


def task_states(flow_state) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        runs = c.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r.state.name for r in runs}


STAGES = ["prepare", "extract", "verifier", "train", "eval"]


@pytest.fixture
def tiny_cfg(tmp_path, tiny_llama_dir):
    src = tmp_path / "chats.jsonl"
    rows = [{"conversations": [{"from": "human", "value": f"question {i}: what is {i} plus {i}?"},
                               {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. " * 3}]} for i in range(12)]
    src.write_text("\n".join(json.dumps(r) for r in rows))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 2?"}) + "\n")
    cfg = PipelineConfig(
        model=str(tiny_llama_dir), run_dir=str(tmp_path / "run"),
        prepare=PrepareConfig(data=str(src), draft_vocab=256, val_fraction=0.2),
        extract=ExtractConfig(aux_layer_ids=[1, 3, 4]),
        train=TrainConfig(ttt_steps=2, max_steps=2, pack_tokens=128, threads=1, val_every=1, ckpt_every=1),
        eval=EvalConfig(prompts=str(prompts), k=2, max_new_tokens=6),
    )
    return cfg, src, rows


def run_times(flow_state) -> list[dict]:
    """The run's closing table (artifact eagle3-run-times): one row per stage."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as c:
        (art,) = c.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["eagle3-run-times"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_state.state_details.flow_run_id])))
    return json.loads(art.data)


def test_all_stages_cached_then_edited_input_reruns(tiny_cfg, prefect_env):
    cfg, src, rows = tiny_cfg
    storage, t0 = prefect_env / "storage", time.time()  # records written from t0 on: this test's
    first = run(cfg)
    assert task_states(first) == dict.fromkeys(STAGES, "Completed")
    # the run ends with each stage's wall time and peak RSS beside the preflight's estimate
    times = run_times(first)
    assert [r["stage"] for r in times] == STAGES and {r["how"] for r in times} == {"done"}
    assert all(r["peak RSS"].endswith(" GiB") and r["estimate"] and r["measured / estimate"] > 0 for r in times)
    cached = run(cfg)
    assert task_states(cached) == dict.fromkeys(STAGES, "Cached")
    assert {r["how"] for r in run_times(cached)} == {"cached (inputs unchanged)"}
    distrusted_results_recompute(cfg, storage, t0)
    # Same path, new content: the content key changes, so prepare and what depends on it rerun.
    src.write_text("\n".join(json.dumps(r) for r in rows[:-1]))
    states = task_states(run(cfg))
    assert {s: states[s] for s in STAGES[:4]} == dict.fromkeys(STAGES[:4], "Completed")
    # eval is keyed on the exported weights: if the dropped record was a validation one, training
    # saw the same rows, wrote the same draft, and eval is rightly served from the cache.
    assert states["eval"] in ("Completed", "Cached")
    from eagle3.storage.manifests import PreparedData

    assert PreparedData.read(cfg.stage_dir("prepare")).records_read == 11
    # A cached result whose output dir was deleted reruns instead of pointing at nothing.
    shutil.rmtree(cfg.stage_dir("eval"))
    states = task_states(run(cfg))
    assert states["eval"] == "Completed" and states["train"] == "Cached"
    report = json.loads((cfg.stage_dir("eval") / "report.json").read_text())
    assert report["lossless"] is True and 1.0 <= report["acceptance_length"] <= 3.0


def fingerprints(cfg) -> dict[str, str]:
    return {s: json.loads((cfg.stage_dir(s) / "manifest.json").read_text())["fingerprint"] for s in STAGES}


def distrusted_results_recompute(cfg, storage, t0):
    """Prefect's result records hold JSON manifests, never a pickle. A record replaced by a pickle payload (in
    Prefect's own record format, naming the pickle serializer) is never unpickled, and a truncated one is not a
    failure: either way every stage runs again, finds its finished output, and the records are rewritten."""
    import cloudpickle

    from tests.helpers.bad_inputs import _RunsCode

    # the storage is shared by the other flow tests of this process, and another test's stage of the same
    # inputs has the same key: the records this test wrote (first run) are those written since t0
    records = sorted(p for p in storage.iterdir() if p.is_file() and p.stat().st_mtime >= t0)
    assert len(records) == len(STAGES)
    for p in records:
        rec = json.loads(p.read_text())
        assert rec["metadata"]["serializer"] == {"type": "eagle3-manifest"}
        assert json.loads(rec["result"])["kind"] in STAGES
    before, marker = fingerprints(cfg), storage.parent / "code-ran"
    payload = base64.b64encode(cloudpickle.dumps(_RunsCode(marker))).decode()
    for planted in ("pickle", "truncated"):
        for p in records:
            rec = json.loads(p.read_text())
            if planted == "pickle":
                rec["metadata"]["serializer"] = {"type": "pickle", "picklelib": "cloudpickle"}
                rec["result"] = payload
                p.write_text(json.dumps(rec))
            else:
                p.write_bytes(p.read_bytes()[:50])
        assert task_states(run(cfg)) == dict.fromkeys(STAGES, "Completed"), planted
        assert not marker.exists() and fingerprints(cfg) == before
    assert task_states(run(cfg)) == dict.fromkeys(STAGES, "Cached")


def test_pipeline_config_validates():
    with pytest.raises(ValueError):
        PipelineConfig.model_validate({"prepare": {"max_len": 3}})
    with pytest.raises(ValueError):
        PipelineConfig.model_validate({"prepare": {"bogus": 1}})
    with pytest.raises(ValueError, match="exactly 3"):
        PipelineConfig.model_validate({"extract": {"aux_layer_ids": [1, 2]}})


def test_result_serializer_reads_back_only_checked_manifests():
    """The cached result's JSON: a sealed manifest round-trips; an unsealed one (a producer's share) is written
    sealed, so it reads back instead of being a silent miss; a pickle, another kind and an edited field are
    refused."""
    import cloudpickle

    from eagle3.storage.manifests import PreparedData, SpooledStates
    from tasks._cache import SERIALIZER, checked_record

    m = PreparedData(model_dir="/m", records_read=3).seal()
    assert SERIALIZER.loads(SERIALIZER.dumps(m)) == m
    share = SpooledStates(num_windows=2)
    back = SERIALIZER.loads(SERIALIZER.dumps(share))
    assert back.fingerprint == share.model_copy().seal().fingerprint and share.fingerprint == ""
    edited = json.loads(SERIALIZER.dumps(m))
    edited["data"]["records_read"] = 4
    other = {"kind": "bogus", "data": edited["data"]}
    for bad in (json.dumps(edited).encode(), json.dumps(other).encode(), b"[]", cloudpickle.dumps(m)):
        with pytest.raises(ValueError):
            SERIALIZER.loads(bad)
    record = {"metadata": {"serializer": {"type": "pickle", "picklelib": "cloudpickle"}},
              "result": base64.b64encode(cloudpickle.dumps(m)).decode()}
    with pytest.raises(ValueError, match="not an eagle3 result record"):
        checked_record(json.dumps(record).encode())
    record = {"metadata": {"serializer": {"type": "eagle3-manifest"}}, "result": SERIALIZER.dumps(m).decode()}
    assert checked_record(json.dumps(record).encode())
