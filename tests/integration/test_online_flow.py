"""Online mode in the Prefect pipeline, on a real `prefect server start` with process workers
(tests/helpers/prefect_service.py): the producer and the trainer run as two tasks side by side, retries of either side
resume to the uninterrupted run's bytes, an unchanged rerun is served from the cache; and how the two split the
GPU host's devices and the `gpus` slots."""
from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

import tests.helpers.prefect_service as ps
from eagle3.config import EvalConfig, ExtractConfig, PipelineConfig, PrepareConfig, TrainConfig
from tests.helpers.prefect_service import events, logs, trigger

LOCAL = {"EAGLE3_GPU_DEPLOYMENT": ""}  # every stage in the cpu worker's flow run (no hop)


# ---------------------------------------------------------------- no server
def test_visible_devices_split_in_order_and_too_few_is_an_error(monkeypatch):
    from tasks._gpus import cuda_devices, split_devices

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert split_devices(1, 1) is None  # CPU: nothing named, each side holds one slot
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert split_devices(2, 4) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert split_devices(2, 4) == [["0", "1"], ["2", "3", "4", "5"]]  # the producer's TP x PP first
    assert split_devices(4, 4) == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,7")
    assert split_devices(1, 2) == [["3"], ["5", "7"]]
    with pytest.raises(ValueError, match=r"names 3 devices; the stages that run side by side need 2 \+ 2 = 4"):
        split_devices(2, 2)
    with cuda_devices(["5", "7"]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3, 5,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with cuda_devices(["1"]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with cuda_devices(None):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_producer_logs_its_pace_while_it_waits(monkeypatch):
    """A log line at least every 25 s (the meter's ticker, so a producer blocked on a full spool still reports):
    tokens produced / total, tok/s, ETA, the spool's bytes now / its cap."""
    import functools

    import tasks.extract as te
    from eagle3.runtime.progress import Meter

    class Clock:
        t = 0.0

        def __call__(self) -> float:
            return self.t

    clock = Clock()
    monkeypatch.setattr(te, "Meter", functools.partial(Meter, clock=clock))
    monkeypatch.setattr(te, "create_progress_artifact", lambda *a, **k: "artifact")
    shown: list[float] = []
    monkeypatch.setattr(te, "update_progress_artifact", lambda art, p, **k: shown.append(p))
    lines: list[str] = []

    class Log:
        def info(self, msg, *args):
            lines.append(msg % args if args else msg)

    pace = te._pace(Log(), "produce", cap=1_500_000)
    pace(500, 2000, 700_000)
    for t in (10.0, 30.0, 60.0):  # no window written meanwhile: the lines keep coming
        clock.t = t
        pace.meter.tick()
    assert len(lines) == 2 and shown == [25.0]  # the artifact moves every 5 s at most, and at the end
    assert lines[-1] == "produce: 500/2,000 tokens (25%), ? tokens/s, ETA ?; spool 700,000 / 1,500,000 bytes; working"
    clock.t = 75.0
    pace(2000, 2000, 0)
    assert shown == [25.0, 100.0]
    assert lines[-1] == "produce: 2,000/2,000 tokens (100%), 20.0 tokens/s, ETA 0m00s; spool 0 / 1,500,000 bytes"


def test_a_side_whose_partner_is_gone_is_not_retried(tmp_path):
    """A side that failed while its partner's beat file was silent for wait_s fails as PartnerGone, which neither
    task retries (the partner's own retries start within seconds: one silent that long has ended for good)."""
    from prefect.states import Failed

    from tasks._failures import PartnerGone, UserInputError, end_failed, raise_for, retry_unless_final
    from tasks._online import partner_gone

    beat = tmp_path / "trainer.beat"
    now = time.time()
    assert not partner_gone(tmp_path, beat.name, 60, since=now)  # never touched, but this attempt just began
    assert partner_gone(tmp_path, beat.name, 60, since=now - 61)
    beat.touch()
    os.utime(beat, (now - 100, now - 100))
    assert partner_gone(tmp_path, beat.name, 60, since=now - 1000)
    beat.touch()
    assert not partner_gone(tmp_path, beat.name, 60, since=now - 1000)

    def failed(e: Exception):
        return Failed(data=e, message=str(e))

    assert retry_unless_final(None, None, failed(RuntimeError("engine died")))
    assert not retry_unless_final(None, None, failed(PartnerGone("the trainer is gone")))
    assert retry_unless_final(None, None, failed(RuntimeError("UserInputError PartnerGone")))  # words are not kinds
    assert not retry_unless_final(None, None, failed(UserInputError("refused")))

    # across a hop: the stage flow's final state is named by the kind, and the hop raises that type again
    for e in (PartnerGone("the producer is gone"), UserInputError("refused")):
        state = end_failed(e)
        assert state.is_failed() and state.name == e.kind
        with pytest.raises(type(e), match="stage train"):
            raise_for(state, "stage train: ended")
    with pytest.raises(RuntimeError) as got:
        raise_for(Failed(message="PartnerGone UserInputError"), "stage train: ended Failed")
    assert type(got.value) is RuntimeError


# ---------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def service(request, tmp_path_factory):
    """The service with a `gpus` limit of 8 (the gpu pool's deployments see devices 0-7)."""
    home = tmp_path_factory.mktemp("prefect-online")
    with ps.service(home, gpus=8, while_booting=lambda: request.getfixturevalue("tiny_llama_dir")) as s:
        print(f"\nservice ready in {s.seconds['ready']:.1f} s")
        yield s


@pytest.fixture
def client(service):
    with service.client() as c:
        yield c


def config(root: Path, model: Path, mode: str) -> PipelineConfig:
    """40 real ShareGPT conversations on the tiny Llama; fp32 states, one sample per hf batch (its states do not
    depend on its batch-mates), so online and offline train on the same floats; a spool of 1.5 MB (the offline
    store is larger: the spool is cycled), 2 epochs of 10 steps, a checkpoint every 4."""
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 2?"}) + "\n")
    return PipelineConfig(
        model=str(model), run_dir=str(root / mode), mode=mode, spool_bytes=1_500_000, spool_wait_s=120,
        prepare=PrepareConfig(data=os.environ.get("EAGLE3_TEST_SHAREGPT", "sharegpt"), limit=40, max_len=96,
                              val_fraction=0.1, draft_vocab=256),
        extract=ExtractConfig(aux_layer_ids=[1, 3, 4], storage="fp32", batch_tokens=64),
        train=TrainConfig(ttt_steps=2, pack_tokens=192, epochs=2, lr=1e-3, warmup_steps=1, threads=1, log_every=1,
                          val_every=1000, ckpt_every=4, replay_max_new_tokens=16),
        eval=EvalConfig(prompts=str(prompts), k=2, max_new_tokens=6),
    )


@pytest.fixture(scope="module")
def deployed(service, tmp_path_factory, tiny_llama_dir):
    """The online pipeline as deployed (the GPU stages hop to the gpu pool), run once: its config, flow run, start
    time and wall time. Its draft equals the offline head bitwise (tests/unit/storage/test_online.py shows that in
    the library; the pipeline adds no step of its own to what either side computes)."""
    root = tmp_path_factory.mktemp("online-flow")
    cfg = config(root, tiny_llama_dir, "online")
    since = datetime.now(timezone.utc)
    t0 = time.time()
    with service.client() as c:
        run = trigger(c, "eagle3-pipeline/eagle3-pipeline", {"config": cfg.model_dump(mode="json")})
        assert run.state.is_completed(), logs(c, run)[-4000:]
    return root, cfg, run, since, time.time() - t0


def weights(cfg: PipelineConfig) -> bytes:
    return (cfg.stage_dir("train") / "final" / "model.safetensors").read_bytes()


def task_runs(client, run) -> dict:
    """The flow run's task runs by name (hops included), skipping run_deployment's placeholders."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    trs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    return {t.name: t for t in trs if t.name in ps.STAGES or t.name.startswith("produce")}


def subflows(client, run) -> dict:
    return {k.name: k for k in ps.subflows(client, run)}


def artifacts(client, run) -> dict:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    return {a.key: a for a in arts if a.key}


def overlap(a, b) -> float:
    """Seconds two (start, end) intervals share."""
    return (min(a[1], b[1]) - max(a[0], b[0])).total_seconds()


def gpu_work(client, since: datetime, expect: int, timeout: float = 60) -> dict[str, list]:
    """Per flow run, the GPU work its tasks did (tasks/_gpus.py's events): [(start, end, slots, devices)]."""
    deadline = time.time() + timeout
    while True:  # the server persists events in batches
        starts, out = {}, {}
        for e in events(client, ["eagle3.gpus.start", "eagle3.gpus.end"], since):
            fr = next(r.id for r in e.related if r.id.startswith("prefect.flow-run."))
            if e.event == "eagle3.gpus.start":
                starts[e.id] = e
            elif e.follows in starts:
                s = starts.pop(e.follows)
                out.setdefault(fr.removeprefix("prefect.flow-run."), []).append(
                    (s.occurred, e.occurred, int(e.resource["slots"]), e.resource["devices"]))
        if sum(map(len, out.values())) >= expect or time.time() > deadline:
            return out
        time.sleep(1)


def check_spool(cfg: PipelineConfig) -> dict:
    from eagle3.storage.manifests import SpoolSource
    from eagle3.storage.store import bytes_per_token

    m = json.loads((cfg.stage_dir("extract") / "manifest.json").read_text())  # SpooledStates
    src = SpoolSource.read(cfg.stage_dir("extract"))
    store = sum(map(sum, src.lengths.values())) * bytes_per_token(3, 64, "fp32")  # what offline would store
    assert store > cfg.spool_bytes >= m["stats"]["peak_spool_bytes"] > 0  # the store never fit: the spool cycled
    assert m["num_windows"] >= 6
    assert not list((cfg.stage_dir("extract") / "shards").iterdir())  # nothing of the states is kept
    return m


def test_online_pipeline_as_deployed_runs_both_sides_at_once(client, deployed):
    """As deployed (the GPU stages hop to the gpu pool): `produce` and `train` are two tasks of the pipeline run,
    each starting its flow run on the gpu pool; both work at once, on devices 0 and 1 of the host's eight, one
    `gpus` slot each; the spool never held the store."""
    _, cfg, run, since, took = deployed
    check_spool(cfg)

    trs = task_runs(client, run)
    assert {n: (t.state.name, t.run_count) for n, t in trs.items()} == {
        s: ("Completed", 1) for s in ("prepare", "verifier", "produce", "train", "eval")}
    kids = subflows(client, run)
    assert {n: (k.state.name, k.work_pool_name) for n, k in kids.items()} == {
        f"{s} · {run.name}": ("Completed", "gpu") for s in ("produce", "train", "eval")}
    produce, train = kids[f"produce · {run.name}"], kids[f"train · {run.name}"]
    assert overlap((produce.start_time, produce.end_time), (train.start_time, train.end_time)) > 0
    # the GPU work itself, from the server's events: at once, each on its own device of the eight
    work = gpu_work(client, since, expect=3)
    (p,), (t,) = work[str(produce.id)], work[str(train.id)]
    assert (p[2:], t[2:]) == ((1, "0"), (1, "1"))
    assert overlap(p[:2], t[:2]) > 0
    # the log says what ran side by side; the producer's own figures are an artifact of its flow run
    text = logs(client, run)
    assert "produce + train (online): started side by side on deployments eagle3-produce/produce-gpu" in text
    assert "produce | produce: " in text and " tokens produced at " in text
    assert "produce-stats" in artifacts(client, produce)
    rows = {r["stage"]: r for r in json.loads(artifacts(client, run)["eagle3-run-stages"].data)}
    assert rows["produce"]["dir"] == str(cfg.stage_dir("extract"))
    print(f"\nonline run (hops) {took:.1f} s")


def test_online_retries_resume_to_the_same_bytes_and_a_rerun_is_cached(service, client, deployed, tiny_llama_dir):
    """In the cpu worker's flow run (no hop), with two producers (extract.workers: 2, two produce tasks beside the
    train task): one producer fails once midway (EAGLE3_FAIL_ONCE) and the trainer is SIGKILLed at its 7th step
    (EAGLE3_KILL_AT, after the step-4 checkpoint); each is retried by Prefect (run count 2) and resumes, and the
    draft is still the one-producer run's byte for byte. The same parameters again: all served from the cache;
    another learning rate: all run again. A `gpus` limit smaller than the pair's slots is refused, not waited
    on."""
    root, first, *_ = deployed
    ref = weights(first)
    cfg = config(root, tiny_llama_dir, "online")
    cfg = cfg.model_copy(update={"run_dir": str(root / "online-retried"),
                                 "extract": cfg.extract.model_copy(update={"workers": 2})})
    params = {"config": cfg.model_dump(mode="json")}
    produce_marker, train_marker = root / "produce-failed-once", root / "train-killed-once"
    drills = {**LOCAL, "EAGLE3_FAIL_ONCE": f"produce:{produce_marker}", "EAGLE3_KILL_AT": "train.step:7",
              "EAGLE3_KILL_MARKER": str(train_marker)}
    t0 = time.time()
    run = trigger(client, "eagle3-pipeline/eagle3-pipeline", params, {"env": drills})
    assert run.state.is_completed(), logs(client, run)[-4000:]
    took = time.time() - t0
    assert produce_marker.is_file() and train_marker.is_file()
    assert weights(cfg) == ref  # the uninterrupted one-producer run's draft, byte for byte
    assert len(check_spool(cfg)["stats"]["producers"]) == 2
    trs = task_runs(client, run)
    producers = ("produce 1/2", "produce 2/2")
    assert {n: (t.state.name, t.run_count) for n, t in trs.items() if n not in producers} == {
        "prepare": ("Completed", 1), "verifier": ("Completed", 1), "train": ("Completed", 2), "eval": ("Completed", 1)}
    assert [trs[n].state.name for n in producers] == ["Completed"] * 2
    assert sorted(trs[n].run_count for n in producers) == [1, 2]  # the drill fails the first to get halfway
    assert not subflows(client, run)
    t = trs["train"]
    for p in (trs[n] for n in producers):
        assert overlap((p.start_time, p.end_time), (t.start_time, t.end_time)) > 0
    assert "produce: injected transient failure" in logs(client, run)
    assert "produce-stats" in artifacts(client, run)

    t1 = time.time()
    again = trigger(client, "eagle3-pipeline/eagle3-pipeline", params, {"env": LOCAL})
    assert again.state.is_completed(), logs(client, again)[-4000:]
    assert {n: t.state.name for n, t in task_runs(client, again).items()} == dict.fromkeys(
        ("prepare", "verifier", *producers, "train", "eval"), "Cached")
    cached = time.time() - t1

    # Another learning rate: the producer's inputs (its read order) are unchanged and its task would be served
    # from the cache, leaving the new trainer without shards; the pair is not done, so both run again.
    from tasks._online import pair_done, producer_inputs

    spool, out, ver = (str(cfg.stage_dir(s)) for s in ("extract", "train", "verifier"))
    fp = producer_inputs(cfg.model, str(cfg.stage_dir("prepare")), cfg.extract, cfg.train, cfg.spool_bytes)
    assert pair_done(spool, out, fp, ver, cfg.train)
    lr = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": 2e-3})})
    assert not pair_done(spool, out, fp, ver, lr.train)
    t2 = time.time()
    other = trigger(client, "eagle3-pipeline/eagle3-pipeline", {"config": lr.model_dump(mode="json")},
                    {"env": LOCAL})
    assert other.state.is_completed(), logs(client, other)[-4000:]
    assert {n: t.state.name for n, t in task_runs(client, other).items()} == {
        "prepare": "Cached", "verifier": "Cached", **dict.fromkeys(producers, "Completed"), "train": "Completed",
        "eval": "Completed"}
    assert weights(lr) != ref
    relearned = time.time() - t2

    # the pair needs 1 + 1 slots here; against a limit of 1 each would wait for the other forever
    from tasks._gpus import hold_gpus

    service.setup(1)
    try:
        with service.client(), pytest.raises(ValueError, match=r"the 'gpus' limit has 1 slots; these side-by-side "
                                                               r"stages hold 1 \+ 1 at once"), hold_gpus(beside=1):
            pass
    finally:
        service.setup(8)
    print(f"\nonline run with both retries {took:.1f} s; cached rerun {cached:.1f} s; another lr {relearned:.1f} s")
