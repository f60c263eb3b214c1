"""The service end to end: a real `prefect server start`, deployments from deployments/prefect.yaml,
process workers on the `cpu` and `gpu` pools, runs triggered through the API.

One test, in order (each run builds on the last):
  A. eagle3-pipeline, as deployed, extraction over two workers: the GPU stages hop to the gpu pool, where two
     process workers (two GPU hosts) take one range each; one worker is SIGKILLed with its flow run mid-range
     (its host dies), the server's automation marks the silent run Crashed, the hop retries it as a new flow
     run on the live worker, which resumes the range; the commit makes one store (equal to one worker's: D);
  B. the same parameters again: every stage is served from the cache;
  C. eagle3-nightly seeded with run A, one conversation added: only that sample is extracted,
     training warm-starts from A's draft with A's vocab map, and the promotion decision is an artifact.
  D. load, with the `gpus` limit at 1: three runs submitted at once queue on it (their GPU stages never
     overlap, by the server's events), a second run on a busy run dir is refused naming the holder, and
     every output equals the same run done alone (benchmarks/drills/load.py is the larger drill).
B, C and D run their stages in the cpu worker's flow runs (EAGLE3_GPU_DEPLOYMENT="" per run); A covers
the hop. The server has basic auth on throughout.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

import tests.helpers.prefect_service as ps
from eagle3.config import EvalConfig, ExtractConfig, PipelineConfig, PrepareConfig, TrainConfig
from eagle3.storage.hashing import sha256_file
from tests.helpers.prefect_service import (
    BIN,
    STAGES,
    chat,
    checksums,
    events,
    gpu_intervals,
    logs,
    overlaps,
    subflows,
    submit,
    tiny_inputs,
    trigger,
    wait,
)


@pytest.fixture(scope="module")
def service(request, tmp_path_factory):
    """The service (tests/helpers/prefect_service.py) with basic auth on: every client below holds the credentials,
    as docs/service.md's multi-host set-up does. Two gpu workers, one flow run at a time each: two 8-GPU hosts,
    so the `gpus` limit is 16.
    A flow run silent for 90 s (three heartbeats, as deployments/setup.py sets by default) is marked Crashed: with
    60 s (two) the pipeline's own flow run on a loaded 2-core host was marked Crashed while it waited on a
    retried range."""
    home = tmp_path_factory.mktemp("prefect-service")
    with ps.service(home, gpus=16, while_booting=lambda: request.getfixturevalue("tiny_llama_dir"), gpu_workers=2,
                    silent_s=90, gpu_limit=1) as s:
        print(f"\nserver up in {s.seconds['server']:.1f} s; pools, limit, workers and deployments in "
              f"{s.seconds['ready']:.1f} s")
        yield s


@pytest.fixture
def client(service):
    with service.client() as c:
        yield c


def test_server_refuses_calls_without_the_credentials(service):
    """Basic auth is on: no credentials or wrong ones get 401 on the API (REST and the Prefect client); only
    the health probe answers anyone. The right ones are accepted (the runs below use them throughout)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    url, auth = service.url, service.auth
    user = auth.split(":")[0]
    assert httpx.post(f"{url}/deployments/filter", json={}).status_code == 401
    assert httpx.post(f"{url}/deployments/filter", json={}, auth=(user, "wrong")).status_code == 401
    assert httpx.post(f"{url}/work_pools/", json={"name": "intruder", "type": "process"}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    ok = httpx.post(f"{url}/deployments/filter", json={}, auth=tuple(auth.split(":", 1)))
    assert ok.status_code == 200 and {d["name"] for d in ok.json()} >= {"eagle3-pipeline", "extract-gpu"}
    with temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: None}), \
            get_client(sync_client=True) as c, pytest.raises(httpx.HTTPStatusError, match="401"):
        c.read_work_pools()
    r = subprocess.run([str(BIN / "prefect"), "work-pool", "ls"], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in service.env.items() if k != "PREFECT_API_AUTH_STRING"})
    assert r.returncode != 0 and "401" in r.stdout + r.stderr


def task_runs(client, *runs) -> dict:
    """Stage task runs by stage name, over the given flow runs (skipping run_deployment's placeholders)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    trs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in runs])))
    return {t.name.rsplit("-", 1)[0]: t for t in trs if t.name.rsplit("-", 1)[0] in STAGES}


def artifacts(client, run) -> dict:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    return {a.key: a for a in arts if a.key}


def range_hops(client, run) -> list:
    """The hop tasks of run A's extraction ranges ("extract 1/2", ...)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    trs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    return [t for t in trs if t.name.startswith("extract ") and "/" in t.name]


class KillMidRange:
    """From a thread: once an extraction range has committed a shard, SIGKILL the gpu worker whose flow run holds
    that range's lock, with every process it started, as a host that dies does. `part`: the range killed."""

    def __init__(self, service, out: Path, timeout: float = 300):
        import threading

        self.service, self.out, self.timeout = service, out, timeout
        self.killed, self.part, self.error = "", -1, ""
        threading.Thread(target=self._watch, daemon=True).start()

    def _holder(self, rdir: Path) -> int | None:
        lock = rdir / ".eagle3.lock"
        try:
            return json.loads(lock.read_text())["pid"] if any((rdir / "shards").glob("*.safetensors")) else None
        except (OSError, ValueError, KeyError):
            return None

    def _watch(self) -> None:
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            for rdir in sorted((self.out / "ranges").glob("*-of-*")):
                if (pid := self._holder(rdir)) is None or (rdir / "manifest.json").exists():
                    continue
                if name := ps.kill_worker_of(self.service, pid):
                    self.killed, self.part = name, int(rdir.name.split("-")[0])
                    return
            time.sleep(0.005)
        self.error = f"no range of {self.out} was seen mid-way in {self.timeout} s"


def gpu_slot_events(client, phase: str, expect: int, timeout: float = 30) -> dict[str, int]:
    """Slots taken (or given back) per acquisition of the `gpus` limit, from the server's event log."""
    from collections import Counter

    deadline = time.time() + timeout
    while True:  # the server persists events in batches
        slots = Counter(e.resource["slots-acquired"] for e in events(client, [f"prefect.concurrency-limit.{phase}"])
                        if e.resource.get("prefect.resource.name") == "gpus")
        if sum(slots.values()) >= expect or time.time() > deadline:
            return dict(slots)
        time.sleep(1)


@pytest.fixture
def tiny(tmp_path, tiny_llama_dir):
    """tests/e2e/test_flow.py's tiny config, with 64 KiB hidden-state shards (one or two samples each)."""
    data, prompts = tiny_inputs(tmp_path)
    cfg = PipelineConfig(
        model=str(tiny_llama_dir), run_dir=str(tmp_path / "run"),
        prepare=PrepareConfig(data=str(data), draft_vocab=256, val_fraction=0.2),
        extract=ExtractConfig(aux_layer_ids=[1, 3, 4], shard_bytes=1 << 16),
        train=TrainConfig(ttt_steps=2, max_steps=2, pack_tokens=128, threads=1, val_every=1, ckpt_every=1),
        eval=EvalConfig(prompts=str(prompts), k=2, max_new_tokens=6),
    )
    return cfg, data


def test_deployed_runs_retry_resume_cache_and_nightly(service, client, tiny):
    from eagle3.storage.manifests import EvalReport, HiddenStates, PreparedData, TrainedDraft

    cfg, data = tiny
    t0 = time.time()

    # What prefect.yaml and setup.py put on the server.
    assert {p: client.read_work_pool(p).type for p in ("cpu", "gpu")} == {"cpu": "process", "gpu": "process"}
    assert client.read_global_concurrency_limit_by_name("gpus").limit == 16  # two 8-GPU hosts
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

    # A: as deployed, two extraction workers. One gpu worker dies mid-range; its range is retried and resumes.
    two = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"workers": 2})})
    params = {"config": two.model_dump(mode="json")}
    killer = KillMidRange(service, cfg.stage_dir("extract"))
    run_a = trigger(client, "eagle3-pipeline/eagle3-pipeline", params)
    assert run_a.state.is_completed(), logs(client, run_a)[-4000:]
    assert run_a.work_pool_name == "cpu"
    assert killer.killed, f"no worker was killed mid-range: {killer.error}"
    service.restart(killer.killed)  # the host comes back: the tests below need both gpu workers
    # Each hop is a task of run A named after its stage (and range), its flow run after stage and run; the
    # range whose worker died was marked Crashed by the server and retried by a second flow run, which resumed.
    children = {c.name: c for c in subflows(client, run_a)}
    k = killer.part
    dead, again = f"extract {k + 1}/2 · {run_a.name}", f"extract {k + 1}/2 · {run_a.name} (try 2)"
    alive = f"extract {2 - k}/2 · {run_a.name}"
    assert {n: c.state.name for n, c in children.items()} == {
        dead: "Crashed", again: "Completed", alive: "Completed", f"train · {run_a.name}": "Completed",
        f"eval · {run_a.name}": "Completed"}
    assert "no heartbeat for 90 s" in children[dead].state.message
    assert {c.work_pool_name for c in children.values()} == {"gpu"}
    assert children[again].infrastructure_pid != children[dead].infrastructure_pid
    runs_a = task_runs(client, run_a)
    assert sorted(runs_a) == sorted(STAGES) and {t.state.name for t in runs_a.values()} == {"Completed"}
    assert {s: runs_a[s].run_count for s in STAGES} == dict.fromkeys(STAGES, 1)  # the commit ran once
    hops = {t.name: t.run_count for t in range_hops(client, run_a)}
    assert hops == {f"extract {k + 1}/2": 2, f"extract {2 - k}/2": 1}, "the killed range alone was retried"
    hidden = HiddenStates.read(cfg.stage_dir("extract"))
    # The retry resumed: the shards the killed range committed were kept, only the rest computed.
    assert len(hidden.shards) >= 6 and hidden.stats["workers"] == 2
    killed = hidden.stats["ranges"][k]
    assert 1 <= killed["shards_skipped"] < killed["shards"] and hidden.stats["ranges"][1 - k]["shards_skipped"] == 0
    assert hidden.stats["tokens_computed"] < hidden.num_tokens
    assert not (cfg.stage_dir("extract") / "ranges").exists()

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
    range_arts = artifacts(client, children[again])
    stats = {r["what"]: r["value"] for r in json.loads(range_arts["extract-range-stats"].data)}
    assert stats["shards resumed (already committed)"] == killed["shards_skipped"]
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
    (data / "day2.jsonl").write_text(json.dumps(chat(100)) + "\n")
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

    # The `gpus` limit: held by the extraction ranges (the killed one's two attempts), training and eval, all 8
    # slots on the gpu pool (its 8 visible devices), 1 slot where the stages ran on the cpu pool; every slot
    # given back, the dead holder's when its lease ran out.
    assert gpu_slot_events(client, "acquired", 8) == {"8": 5, "1": 3}
    assert gpu_slot_events(client, "released", 7) == {"8": 4, "1": 3}
    deadline = time.time() + 150
    while client.read_global_concurrency_limit_by_name("gpus").active_slots:
        assert time.time() < deadline, "the dead worker's slots were never given back"
        time.sleep(2)
    t_d = load_drill(service, client, cfg, night_params, night_dir)
    print(f"\nrun A (hop + retry) {t_a:.1f} s, run B (cached) {t_b:.1f} s, nightly {t_c:.1f} s, load drill {t_d:.1f} s")


@pytest.mark.vllm
def test_deployed_run_with_the_vllm_backend_on_the_gpu_pool(service, client, family_dirs, tmp_path):
    """As deployed, with `backend: vllm` for extraction: the stage hops to the gpu pool's process worker and
    runs on the real vLLM engine there (the CPU build here), on the tiny Qwen3 checkpoint. (Eval and
    regenerate on the engine run in tests/e2e/test_vllm_pipeline.py; each engine costs ~45 s to start here.)"""
    from eagle3.storage.manifests import EvalReport, HiddenStates

    service.setup(16)  # the load drill above left the `gpus` limit at 1; two 8-GPU hosts take 16
    data, prompts = tiny_inputs(tmp_path)
    eager = {"enforce_eager": True}  # tests/helpers/engine.py: an engine starts in ~45 s instead of ~150 s
    cfg = PipelineConfig(
        model=str(family_dirs["qwen3"]), run_dir=str(tmp_path / "run"),
        prepare=PrepareConfig(data=str(data), draft_vocab=256, val_fraction=0.2),
        extract=ExtractConfig(backend="vllm", engine_args=eager),
        train=TrainConfig(ttt_steps=2, max_steps=2, pack_tokens=128, threads=1, val_every=1, ckpt_every=1),
        eval=EvalConfig(prompts=str(prompts), k=2, max_new_tokens=6),
    )
    run = trigger(client, "eagle3-pipeline/eagle3-pipeline", {"config": cfg.model_dump(mode="json")}, timeout=900)
    assert run.state.is_completed(), logs(client, run)[-4000:]
    children = {c.name: c for c in subflows(client, run)}
    assert {n for n in children} == {f"{s} · {run.name}" for s in ("extract", "train", "eval")}
    assert {c.work_pool_name for c in children.values()} == {"gpu"}
    assert {c.state.name for c in children.values()} == {"Completed"}
    hidden, report = HiddenStates.read(cfg.stage_dir("extract")), EvalReport.read(cfg.stage_dir("eval"))
    assert hidden.backend == "vllm" and hidden.num_samples > 0
    assert report.lossless and report.num_drafts > 0


def load_drill(service, client, cfg: PipelineConfig, night_params: dict, night_dir: Path) -> float:
    """D. With the `gpus` limit at 1 (a one-GPU host), submitted at once: A's config in a new run dir, a
    variant (another draft vocab, fp8 storage, k=3 training), and C's nightly in a new root; every stage in
    the cpu worker's flow runs, one slot each. While the first holds its run dir, a second run on that dir
    is refused, naming the holder. From the server's events: the GPU stages never overlapped. Outputs:
    equal to the same runs done alone (A, C, and the variant run alone afterwards)."""
    t0 = time.time()
    service.setup(1)  # deployments/setup.py --gpus 1
    since = datetime.now(timezone.utc)
    tmp = Path(cfg.run_dir).parent
    local = {"env": {"EAGLE3_GPU_DEPLOYMENT": ""}}
    data_a = tmp / "data-a"  # the conversations as A read them (C added one since)
    data_a.mkdir()
    shutil.copy(Path(cfg.prepare.data) / "day1.jsonl", data_a)
    prep_a = cfg.prepare.model_copy(update={"data": str(data_a)})
    same = cfg.model_copy(update={"run_dir": str(tmp / "load-same"), "prepare": prep_a})
    variant = cfg.model_copy(update={
        "run_dir": str(tmp / "load-variant"), "prepare": prep_a.model_copy(update={"draft_vocab": 192}),
        "extract": cfg.extract.model_copy(update={"storage": "fp8"}),
        "train": cfg.train.model_copy(update={"ttt_steps": 3})})
    night = {"config": {**night_params["config"], "root": str(tmp / "load-nightly")}}
    runs = [submit(client, "eagle3-pipeline/eagle3-pipeline", {"config": c.model_dump(mode="json")}, local)
            for c in (same, variant)] + [submit(client, "eagle3-nightly/eagle3-nightly", night, local)]
    lock = Path(same.run_dir) / ".eagle3.lock"
    deadline = time.time() + 120
    while not (lock.is_file() and lock.read_text()):  # the first run holds its dir
        assert time.time() < deadline, "the first load run never took its run dir"
        time.sleep(0.2)
    holder = json.loads(lock.read_text())
    dup = submit(client, "eagle3-pipeline/eagle3-pipeline", {"config": same.model_dump(mode="json")}, local)
    *done, dup = wait(client, [*runs, dup], timeout=600)
    assert [r.state.name for r in done] == ["Completed"] * 3, [logs(client, r)[-2000:] for r in done]
    assert dup.state.is_failed()
    assert f"{same.run_dir} is in use by pid {holder['pid']} on {holder['host']}" in dup.state.message

    # Nine GPU stages (extract, train, eval of three runs), one slot each, one at a time.
    spans = gpu_intervals(client, since, expect=9)
    assert len(spans) == 9 and {(i.slots, i.held) for i in spans} == {(1, True)}
    assert {i.flow_run for i in spans} == {f"prefect.flow-run.{r.id}" for r in done}
    assert overlaps(spans) == []
    assert client.read_global_concurrency_limit_by_name("gpus").active_slots == 0

    assert checksums(same.run_dir) == checksums(cfg.run_dir)  # A ran alone (with a hop and a retry)
    (night_load,) = [p for p in (tmp / "load-nightly").iterdir() if p.is_dir()]
    assert checksums(night_load) == checksums(night_dir)  # C ran alone
    alone = variant.model_copy(update={"run_dir": str(tmp / "alone-variant")})
    run = trigger(client, "eagle3-pipeline/eagle3-pipeline", {"config": alone.model_dump(mode="json")}, local)
    assert run.state.is_completed(), logs(client, run)[-3000:]
    assert checksums(variant.run_dir) == checksums(alone.run_dir) != checksums(same.run_dir)
    return time.time() - t0




def test_deployed_train_on_two_nodes_equals_two_ranks_on_one(service, client, tiny, monkeypatch):
    """The pipeline's train step as deployed (`run_stage` in a flow run of this process, the GPU stages hopping),
    with train.nnodes 2: one hop per node, each a flow run of eagle3-train/train-gpu (node_rank 0 and 1) on the
    gpu pool, holding its host's 8 slots while the other holds its own; the two torchruns meet at a rendezvous
    on this host and train what 2 ranks on one node train (the library, here, on the same stage dirs): the
    same metrics records and final weights, bitwise. (The stages before train run here, by the library: the
    pipeline's own hops are run A's.)"""
    from prefect import flow

    from eagle3.eval.replay import replay_set_dir
    from eagle3.extract import run_extract
    from eagle3.prepare import prepare
    from eagle3.registry import STAGES as LIBRARY
    from eagle3.storage.manifests import HiddenStates, TrainedDraft
    from eagle3.verifier import extract_verifier
    from flows.stages import run_stage

    service.setup(16)  # two 8-GPU hosts (the load drill above leaves the limit at 1)
    service.check_workers()  # both nodes' hosts are up: a missing one would leave node 0 at its rendezvous
    cfg, _ = tiny
    model, d = cfg.model, {s: str(cfg.stage_dir(s)) for s in ("prepare", "extract", "verifier", "train")}
    # the full vocab as the draft's: the random target's argmax always falls in it (with the tiny config's 256
    # it never does, and the loss is 0): weights that move
    full = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prepare(model, d["prepare"], cfg.prepare.model_copy(update={"draft_vocab": full}), progress=False)
    run_extract(model, d["prepare"], d["extract"], cfg.extract, show_progress=False)
    extract_verifier(model, d["prepare"], d["verifier"])
    nodes = cfg.train.model_copy(update={"nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{ps.free_port()}"})
    since = datetime.now(timezone.utc)
    monkeypatch.setenv("EAGLE3_GPU_DEPLOYMENT", "gpu")  # as the cpu pool sets it

    @flow(name="eagle3-train-step")
    def step() -> TrainedDraft:
        return run_stage("train", d["train"], hidden=d["extract"], verifier=d["verifier"], cfg=nodes,
                         verifier_name=model, model=model, prepared=d["prepare"], trust_remote_code=False)

    state = step(return_state=True)
    run = client.read_flow_run(state.state_details.flow_run_id)
    assert state.is_completed(), logs(client, run)[-4000:]
    trains = sorted(subflows(client, run), key=lambda c: c.name)
    assert [c.name for c in trains] == [f"train (node {k}) · {run.name}" for k in (0, 1)]
    assert [(c.state.name, c.work_pool_name, c.parameters["node_rank"]) for c in trains] == [
        ("Completed", "gpu", 0), ("Completed", "gpu", 1)]
    spans = gpu_intervals(client, since, expect=2)
    assert {i.flow_run for i in spans} == {f"prefect.flow-run.{c.id}" for c in trains}
    assert len(spans) == 2 and {i.slots for i in spans} == {8} and overlaps(spans)  # both nodes at once

    # the reference: 2 processes on one node, on these stage dirs and the replay set the node tasks built
    one = nodes.model_copy(update={"nnodes": 1, "nproc_per_node": 2, "rdzv_endpoint": None})
    replay = replay_set_dir(model, d["prepare"], one.replay_prompts, one.replay_max_new_tokens,
                            HiddenStates.read(d["extract"]).aux_layer_ids)[0]
    ref = Path(cfg.run_dir) / "one-node"
    LIBRARY["train"].run(ref, one, hidden=d["extract"], verifier=d["verifier"], replay=str(replay),
                         verifier_name=model)
    rec = [[{k: v for k, v in json.loads(ln).items() if k != "tokens_per_s"}
            for ln in (Path(out) / "metrics.jsonl").read_text().splitlines()] for out in (d["train"], ref)]
    assert rec[0] == rec[1] and any(r["split"] == "val" and r["replay_rounds"] > 0 for r in rec[0])
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in rec[0] if r["split"] == "train")
    assert state.result() == TrainedDraft.read(d["train"])
    assert TrainedDraft.read(d["train"]).weights_sha256 == TrainedDraft.read(ref).weights_sha256


def test_server_killed_and_restarted_mid_training(service, client, tiny):
    """The server's process group SIGKILLed while a run trains and started again 5 s later on the same database:
    the run's processes carry on (their API calls retry), the run completes with the outputs of the same run
    left alone, no stage runs twice, and the `gpus` slots it held come back (leases on disk, docs/service.md)."""
    cfg, _ = tiny
    local = {"env": {"EAGLE3_GPU_DEPLOYMENT": ""}}
    longer = cfg.train.model_copy(update={"max_steps": 40, "epochs": 40, "ckpt_every": 5, "val_every": 20})

    def params(name: str) -> dict:
        return {"config": cfg.model_copy(update={"run_dir": str(Path(cfg.run_dir).parent / name),
                                                 "train": longer}).model_dump(mode="json")}

    ref = trigger(client, "eagle3-pipeline/eagle3-pipeline", params("alone"), local)
    assert ref.state.is_completed(), logs(client, ref)[-3000:]
    run = submit(client, "eagle3-pipeline/eagle3-pipeline", params("restarted"), local)
    ckpts = Path(cfg.run_dir).parent / "restarted" / "train" / "checkpoints"
    deadline = time.time() + 300
    while not any(ckpts.glob("step-*")):
        assert time.time() < deadline, "training never wrote its first checkpoint"
        time.sleep(0.05)
    service.kill_server()
    time.sleep(5)
    service.start_server()
    with service.client() as c:
        (end,) = wait(c, [run], 600)
        assert end.state.is_completed(), logs(c, end)[-3000:]
        assert ps.task_counts(c, end) == dict.fromkeys(STAGES, 1)
        time.sleep(3)
        assert c.read_global_concurrency_limit_by_name("gpus").active_slots == 0
    assert checksums(Path(cfg.run_dir).parent / "restarted") == checksums(Path(cfg.run_dir).parent / "alone")


def test_nightly_sources_reuse_and_promoted_draft(tmp_path):
    """The nightly flow's plumbing, without a server: glob sources, which dirs it reuses, which draft is promoted."""
    from eagle3.storage.atomic import atomic_write_json
    from eagle3.storage.manifests import EvalReport, HiddenStates, TrainedDraft
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
