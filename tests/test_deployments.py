"""The service end to end: a real `prefect server start`, deployments from deployments/prefect.yaml,
process workers on the `cpu` and `gpu` pools, runs triggered through the API.

One test, in order (each run builds on the last):
  A. eagle3-pipeline, as deployed: the GPU stages hop to the gpu pool; extraction fails once
     midway (EAGLE3_FAIL_ONCE on the gpu worker), the hop task retries it as a new flow run, which resumes;
  B. the same parameters again: every stage is served from the cache;
  C. eagle3-nightly seeded with run A, one conversation added: only that sample is extracted,
     training warm-starts from A's draft with A's vocab map, and the promotion decision is an artifact.
B and C run their stages in the cpu worker's flow run (EAGLE3_GPU_DEPLOYMENT="" per run), which
keeps the test under 3 minutes; A covers the hop.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eagle3.atomic import sha256_file
from eagle3.config import EvalConfig, ExtractConfig, PipelineConfig, PrepareConfig, TrainConfig

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STAGES = ["prepare", "extract", "verifier", "train", "eval"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], env: dict, log: Path, **kw) -> subprocess.Popen:
    """A process in its own session (so its whole group can be stopped), output to `log`."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **kw)


def _stop(p: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if it lingers."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.fixture(scope="module")
def service(request, tmp_path_factory):
    """`prefect server start` on loopback, pools + limit from deployments/setup.py, one worker per pool, deployments."""
    home = tmp_path_factory.mktemp("prefect-service")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "EAGLE3_REPO": str(REPO)}
    env.pop("EAGLE3_FAIL_ONCE", None)
    env.pop("EAGLE3_GPU_DEPLOYMENT", None)
    t0 = time.time()
    procs = [_start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                    env, home / "server.log")]
    try:
        request.getfixturevalue("tiny_llama_dir")  # built while the server boots
        deadline = time.time() + 120
        while True:
            assert procs[0].poll() is None, (home / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "prefect server did not come up in 120 s"
            time.sleep(0.5)
        t_server = time.time() - t0
        r = subprocess.run([sys.executable, "deployments/setup.py", "--gpus", "8"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        # Deploy (it imports every flow) while the workers boot.
        deploy = _start([str(BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file",
                         "deployments/prefect.yaml"], env, home / "deploy.log", cwd=REPO)
        procs.append(deploy)
        marker = home / "extract-failed-once"
        for pool, extra in (("cpu", {}), ("gpu", {"EAGLE3_FAIL_ONCE": f"extract:{marker}"})):
            procs.append(_start([sys.executable, "deployments/worker.py", "--pool", pool, "--name", f"test-{pool}"],
                                {**env, **extra}, home / f"worker-{pool}.log", cwd=REPO))
        assert deploy.wait(180) == 0, (home / "deploy.log").read_text()[-4000:]
        print(f"\nserver up in {t_server:.1f} s; pools, limit, workers and deployments in {time.time() - t0:.1f} s")
        yield {"url": url, "home": home, "marker": marker}
    finally:
        for p in reversed(procs):
            _stop(p)


@pytest.fixture
def client(service):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: service["url"]}), get_client(sync_client=True) as c:
        yield c


def trigger(client, deployment: str, parameters: dict, job_variables: dict | None = None, timeout: float = 360):
    """Start a deployment's run through the API and wait for its final state."""
    dep = client.read_deployment_by_name(deployment)
    run = client.create_flow_run_from_deployment(dep.id, parameters=parameters, job_variables=job_variables)
    deadline = time.time() + timeout
    while not (run := client.read_flow_run(run.id)).state.is_final():
        assert time.time() < deadline, f"{deployment}: still {run.state.name} after {timeout} s"
        time.sleep(1)
    return run


def subflows(client, run) -> list:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(
        any_=[run.id])))


def task_runs(client, *runs) -> dict:
    """Stage task runs by stage name, over the given flow runs (skipping run_deployment's placeholders)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    trs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs])))
    return {t.name.rsplit("-", 1)[0]: t for t in trs if t.name.rsplit("-", 1)[0] in STAGES}


def artifacts(client, run) -> dict:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    return {a.key: a for a in arts if a.key}


def logs(client, run) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return "\n".join(x.message for x in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))))


def gpu_slot_events(client, phase: str, expect: int = 5, timeout: float = 30) -> dict[str, int]:
    """Slots taken (or given back) per acquisition of the `gpus` limit, from the server's event log."""
    from collections import Counter

    from prefect.events.filters import EventFilter, EventNameFilter

    deadline = time.time() + timeout
    while True:  # the server persists events in batches
        flt = EventFilter(event=EventNameFilter(name=[f"prefect.concurrency-limit.{phase}"]))
        page = client.read_events(flt, limit=50)  # the server's maximum (the client's default, 100, is refused)
        slots = Counter(e.resource["slots-acquired"] for e in page.events
                        if e.resource.get("prefect.resource.name") == "gpus")
        if sum(slots.values()) >= expect or time.time() > deadline:
            return dict(slots)
        time.sleep(1)


def _chat(i: int) -> dict:
    return {"conversations": [{"from": "human", "value": f"question {i}: what is {i} plus {i}?"},
                              {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. " * 3}]}


@pytest.fixture
def tiny(tmp_path, tiny_llama_dir):
    """tests/test_flow.py's tiny config, with 64 KiB hidden-state shards (one or two samples each)."""
    data = tmp_path / "conversations"
    data.mkdir()
    (data / "day1.jsonl").write_text("\n".join(json.dumps(_chat(i)) for i in range(12)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 2?"}) + "\n")
    cfg = PipelineConfig(
        model=str(tiny_llama_dir), run_dir=str(tmp_path / "run"),
        prepare=PrepareConfig(data=str(data), draft_vocab=256, val_fraction=0.2),
        extract=ExtractConfig(aux_layer_ids=[1, 3, 4], shard_bytes=1 << 16),
        train=TrainConfig(ttt_steps=2, max_steps=2, pack_tokens=128, threads=1, val_every=1, ckpt_every=1),
        eval=EvalConfig(prompts=str(prompts), k=2, max_new_tokens=6),
    )
    return cfg, data


def test_deployed_runs_retry_resume_cache_and_nightly(service, client, tiny):
    from eagle3.manifests import EvalReport, HiddenStates, PreparedData, TrainedDraft

    cfg, data = tiny
    t0 = time.time()

    # What prefect.yaml and setup.py put on the server.
    assert {p: client.read_work_pool(p).type for p in ("cpu", "gpu")} == {"cpu": "process", "gpu": "process"}
    assert client.read_global_concurrency_limit_by_name("gpus").limit == 8
    pipe = client.read_deployment_by_name("eagle3-pipeline/eagle3-pipeline")
    assert pipe.work_pool_name == "cpu" and not pipe.schedules
    assert pipe.job_variables["env"]["EAGLE3_GPU_DEPLOYMENT"] == "gpu"
    form = pipe.parameter_openapi_schema["definitions"]["PrepareConfig"]["properties"]["max_len"]
    assert form["minimum"] == 16 and "truncate" in form["description"]  # the UI's run form: bounds + descriptions
    night = client.read_deployment_by_name("eagle3-nightly/eagle3-nightly")
    assert (night.schedules[0].schedule.cron, night.schedules[0].schedule.timezone) == ("0 2 * * *", "Europe/Berlin")
    assert not night.schedules[0].active  # deployed paused: deployments/nightly.py turns it on
    for stage in ("extract", "train", "eval"):
        gpu = client.read_deployment_by_name(f"eagle3-{stage}/{stage}-gpu")
        assert gpu.work_pool_name == "gpu" and gpu.job_variables["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"

    # A: as deployed. GPU stages hop to the gpu pool; extraction fails once midway and is retried.
    params = {"config": cfg.model_dump(mode="json")}
    run_a = trigger(client, "eagle3-pipeline/eagle3-pipeline", params)
    assert run_a.state.is_completed(), logs(client, run_a)[-4000:]
    assert run_a.work_pool_name == "cpu"
    # Each hop is a task of run A named after its stage, its flow run named after stage and run;
    # the failed extraction was retried by a second flow run, which resumed.
    children = {c.name: c for c in subflows(client, run_a)}
    first, second = f"extract · {run_a.name}", f"extract · {run_a.name} (try 2)"
    assert {n: c.state.name for n, c in children.items()} == {
        first: "Failed", second: "Completed", f"train · {run_a.name}": "Completed", f"eval · {run_a.name}": "Completed"}
    assert {c.work_pool_name for c in children.values()} == {"gpu"}
    runs_a = task_runs(client, run_a)
    assert sorted(runs_a) == sorted(STAGES) and {t.state.name for t in runs_a.values()} == {"Completed"}
    assert runs_a["extract"].run_count == 2, "the injected failure must show as one retry"
    assert {s: runs_a[s].run_count for s in STAGES if s != "extract"} == dict.fromkeys(["prepare", "verifier",
                                                                                       "train", "eval"], 1)
    assert service["marker"].is_file()
    hidden = HiddenStates.read(cfg.stage_dir("extract"))
    # The retry resumed: shards committed before the failure were kept, only the rest computed.
    assert len(hidden.shards) >= 6 and 1 <= hidden.stats["shards_skipped"] < len(hidden.shards)
    assert hidden.stats["shards_written"] == len(hidden.shards) - hidden.stats["shards_skipped"]
    assert hidden.stats["tokens_computed"] < hidden.num_tokens
    assert "injected transient failure" in logs(client, children[first])

    # A's artifacts, read back through the API: the run summary (in the flow) and the stages' own.
    arts = artifacts(client, run_a)
    report = EvalReport.read(cfg.stage_dir("eval"))
    rows = {r["stage"]: r for r in json.loads(arts["eagle3-run-stages"].data)}
    assert {s: rows[s]["dir"] for s in STAGES} == {s: str(cfg.stage_dir(s)) for s in STAGES}
    assert (rows["draft"]["dir"], rows["report"]["dir"]) == (f"{cfg.stage_dir('train')}/final",
                                                             f"{cfg.stage_dir('eval')}/report.json")
    assert f"**tau = {report.acceptance_length:.3f}**" in arts["eagle3-run-summary"].data
    assert f"| shards resumed (already committed) | {hidden.stats['shards_skipped']} |" in \
        arts["eagle3-run-summary"].data
    extract_arts = artifacts(client, children[second])
    stats = {r["what"]: r["value"] for r in json.loads(extract_arts["extract-stats"].data)}
    assert stats["shards resumed (already committed)"] == hidden.stats["shards_skipped"]
    assert "eval-results" in artifacts(client, children[f"eval · {run_a.name}"])
    assert {"extract-stats", "train-summary", "eval-report"} <= set(arts)  # every stage's artifacts on run A too
    t_a = time.time() - t0

    # B: unchanged inputs, stages in this run's process: every stage is served from the cache,
    # and the summary, made in the flow, still shows A's figures.
    local = {"env": {"EAGLE3_GPU_DEPLOYMENT": ""}}
    run_b = trigger(client, "eagle3-pipeline/eagle3-pipeline", params, local)
    assert run_b.state.is_completed(), logs(client, run_b)[-4000:]
    assert not subflows(client, run_b)
    assert {s: t.state.name for s, t in task_runs(client, run_b).items()} == dict.fromkeys(STAGES, "Cached")
    assert f"**tau = {report.acceptance_length:.3f}**" in artifacts(client, run_b)["eagle3-run-summary"].data
    t_b = time.time() - t0 - t_a

    # C: nightly, seeded with run A, one new conversation: only the new sample is extracted.
    (data / "day2.jsonl").write_text(json.dumps(_chat(100)) + "\n")
    root = Path(cfg.run_dir).parent / "nightly"
    night_params = {"config": {"conversations": str(data), "root": str(root), "margin": 0.25,
                               "seed_run": cfg.run_dir, "base": cfg.model_dump(mode="json")}}
    run_c = trigger(client, "eagle3-nightly/eagle3-nightly", night_params, local)
    assert run_c.state.is_completed(), logs(client, run_c)[-4000:]
    (night_dir,) = [p for p in root.iterdir() if p.is_dir()]
    assert {s: t.state.name for s, t in task_runs(client, run_c).items()} == dict.fromkeys(STAGES, "Completed")
    prep = PreparedData.read(night_dir / "prepare")
    assert prep.records_read == 13
    h2 = HiddenStates.read(night_dir / "extract")
    assert h2.num_samples == hidden.num_samples + 1
    assert (h2.stats["samples_computed"], h2.stats["samples_reused"]) == (1, hidden.num_samples)
    assert h2.stats["tokens_computed"] == h2.num_tokens - hidden.num_tokens
    # Warm start: A's vocab map byte for byte, training initialized from A's draft.
    assert sha256_file(night_dir / "prepare" / "vocab_map.safetensors") == \
        sha256_file(cfg.stage_dir("prepare") / "vocab_map.safetensors")
    a_final = str(cfg.stage_dir("train") / TrainedDraft.read(cfg.stage_dir("train")).final_dir)
    assert TrainedDraft.read(night_dir / "train").config["init_from"] == a_final
    # Promotion: the decision and both figures in a markdown artifact, promoted.json only if tau held.
    new_tau = EvalReport.read(night_dir / "eval").acceptance_length
    promote = new_tau >= report.acceptance_length - 0.25
    md = artifacts(client, run_c)["eagle3-nightly-promotion"].data
    assert f"| new | {new_tau:.4f} |" in md and f"| promoted before | {report.acceptance_length:.4f} |" in md
    assert ("**promoted**" in md) == promote and "1 extracted tonight" in md
    assert (root / "promoted.json").is_file() == promote
    if promote:
        assert json.loads((root / "promoted.json").read_text())["tau"] == new_tau
    t_c = time.time() - t0 - t_a - t_b

    # The `gpus` limit: held by extraction (both attempts) and training, all 8 slots on the gpu pool
    # (its 8 visible devices), 1 slot where the stages ran on the cpu pool; every slot given back.
    assert gpu_slot_events(client, "acquired") == gpu_slot_events(client, "released") == {"8": 3, "1": 2}
    assert client.read_global_concurrency_limit_by_name("gpus").active_slots == 0
    print(f"\nrun A (hop + retry) {t_a:.1f} s, run B (cached) {t_b:.1f} s, nightly {t_c:.1f} s")


def test_nightly_sources_reuse_and_promoted_draft(tmp_path):
    """The nightly flow's plumbing, without a server: glob sources, which dirs it reuses, which draft is promoted."""
    from eagle3.manifests import EvalReport, HiddenStates, TrainedDraft
    from eagle3.atomic import atomic_write_json
    from flows.nightly import NightlyConfig, collect, earlier_extracts, promoted

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for name in ("b.jsonl", "a.jsonl", "notes.txt"):
        (inbox / name).write_text(name)
    assert collect(str(inbox), tmp_path / "n0") == str(inbox)  # a directory is read as is
    links = sorted(Path(collect(f"{inbox}/*.jsonl", tmp_path / "n1")).iterdir())
    assert [(p.name, p.read_text()) for p in links] == [("000000-a.jsonl", "a.jsonl"), ("000001-b.jsonl", "b.jsonl")]
    with pytest.raises(ValueError, match="nothing matches"):
        collect(f"{inbox}/*.parquet", tmp_path / "n2")

    root, seed = tmp_path / "nightly", tmp_path / "seed"
    for night in ("20260101-020000", "20260102-020000"):
        HiddenStates().write(root / night / "extract")
    (root / "20260103-020000" / "extract").mkdir(parents=True)  # a night that died before extraction finished
    HiddenStates().write(seed / "extract")
    TrainedDraft().write(seed / "train")
    EvalReport(acceptance_length=1.5).write(seed / "eval")
    latest = str(root / "20260102-020000" / "extract")
    assert earlier_extracts(root, None) == [latest]
    assert earlier_extracts(root, {"run_dir": str(seed)}) == [latest, str(seed / "extract")]

    cfg = NightlyConfig(root=str(root))
    assert promoted(cfg) is None  # the first night trains cold and builds the vocab map
    cfg = NightlyConfig(root=str(root), seed_run=str(seed))
    assert promoted(cfg) == {"run_dir": str(seed), "draft": str(seed / "train" / "final"), "tau": 1.5}
    record = {"run_dir": latest, "draft": "x/final", "tau": 2.0}
    atomic_write_json(root / "promoted.json", record)
    assert promoted(cfg) == record  # once something is promoted, the seed no longer matters
    with pytest.raises(ValueError):
        NightlyConfig(margin=-0.1)
