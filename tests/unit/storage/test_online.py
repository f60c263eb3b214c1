"""Online training: the producer fills a bounded spool while the trainer reads it. The head equals the
offline head bitwise (hf producer, fp32), the spool never holds more than its cap, kills of either side
resume to the same bytes, and the real vLLM engine produces what the trainer reads."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagle3.config import ExtractConfig, PrepareConfig, TrainConfig
from eagle3.storage import liveness as lv
from eagle3.storage import spool as sp
from eagle3.storage.manifests import SpoolSource

REPO = Path(__file__).resolve().parents[3]
AUX = [1, 3, 4]
# batch_tokens below the shortest sample: every hf batch is one sample, so its states are a pure function of
# its tokens, whichever other samples a store shard or a spool window holds (larger batches agree to ~2e-8).
EXTRACT = ["--aux-layer-ids", "1,3,4", "--storage", "fp32", "--batch-tokens", "64"]
TRAIN = {"ttt_steps": 2, "pack_tokens": 192, "log_every": 1, "val_every": 1000, "ckpt_every": 4, "warmup_steps": 1,
         "threads": 1, "lr": 1e-3, "epochs": 2, "nproc_per_node": 2}  # DDP: two ranks read each window
SPOOL = 1_500_000  # the val shard and two or three train windows; the full store is 2.28 MB


def _flags(cfg: dict) -> list[str]:
    return [x for k, v in cfg.items() for x in (f"--{k.replace('_', '-')}", str(v))]


def build(root: Path, model: Path, aux: list[int] | None = AUX) -> Path:
    """prepare, verifier and an offline hf store of 40 real ShareGPT conversations on `model`, the offline head
    trained on it (`ref`), and the train config both sides read (`train.json`)."""
    from eagle3.extract import run_extract
    from eagle3.prepare import prepare
    from eagle3.verifier import extract_verifier

    data = os.environ.get("EAGLE3_TEST_SHAREGPT", "sharegpt")
    prepare(model, root / "prep", PrepareConfig(data=data, limit=40, max_len=96, val_fraction=0.1), progress=False)
    extract_verifier(model, root / "prep", root / "ver")
    run_extract(model, root / "prep", root / "hid", ExtractConfig(aux_layer_ids=aux, storage="fp32", batch_tokens=64),
                show_progress=False)
    (root / "train.json").write_text(json.dumps(TRAIN))
    wait(trainer(root, root / "hid", root / "ref", online=False))
    return root


@pytest.fixture(scope="module")
def stages(tmp_path_factory, tiny_llama_dir):
    return build(tmp_path_factory.mktemp("online"), tiny_llama_dir)


def cli(*args: str, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "eagle3.cli", *args], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def producer(root: Path, spool: Path, *extra: str, model: Path, log: str = "produce") -> subprocess.Popen:
    return cli("produce", "--model", str(model), "--prepared", str(root / "prep"), "--out", str(spool),
               "--train-config", str(root / "train.json"), "--spool-bytes", str(SPOOL), "--wait-s", "120", *extra,
               log=spool.with_suffix(f".{log}.log"))


def trainer(root: Path, hidden: Path, out: Path, *extra: str, online: bool = True) -> subprocess.Popen:
    on = ["--online", "--wait-s", "120"] if online else []
    return cli("train", "--hidden", str(hidden), "--verifier", str(root / "ver"), "--out", str(out), *on,
               *_flags(TRAIN), *extra, log=out.with_suffix(".train.log"))


def wait(p: subprocess.Popen, timeout: float = 600) -> None:
    rc = p.wait(timeout=timeout)
    log = Path(p.args[p.args.index("--out") + 1])
    text = next(log.parent.glob(f"{log.name}.*.log")).read_text()
    assert rc == 0, text[-3000:]


def kill(p: subprocess.Popen) -> None:
    """SIGKILL the command and every process under it (torchrun starts its ranks in sessions of their own)."""
    import psutil

    procs = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    for q in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            q.send_signal(signal.SIGKILL)
    p.wait()
    psutil.wait_procs(procs, timeout=30)


def weights(out: Path) -> bytes:
    return (out / "final" / "model.safetensors").read_bytes()


def train_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


def same_run(a: Path, b: Path) -> None:
    """Every train record (loss, accuracies, grad norm; not the rate) and the exported weights, bitwise."""
    strip = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in train_records(a)]
    assert strip == [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in train_records(b)]
    assert weights(a) == weights(b)


class Watch:
    """The spool's bytes on disk, sampled every few ms while the block runs: the most it ever held, and how many
    windows were being written at once (the producers' reservations)."""

    def __init__(self, root: Path):
        self.root, self.peak, self.samples, self.in_flight, self._stop = root, 0, 0, 0, threading.Event()

    def __enter__(self):
        def poll():
            while not self._stop.is_set():
                self.peak = max(self.peak, sp.spool_dir_bytes(self.root))
                self.in_flight = max(self.in_flight, len(list(self.root.glob("producer*.reserve"))))
                self.samples += 1
                time.sleep(0.002)

        self._t = threading.Thread(target=poll, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


# ---------------------------------------------------------------- the plan
def _source(train: list[int], val: list[int]) -> SpoolSource:
    return SpoolSource(inputs={"x": 1}, lengths={"train": train, "val": val}).seal()


def test_plan_covers_every_step_in_order_and_fits_the_budget():
    import random

    rnd = random.Random(0)
    src = _source([rnd.randint(20, 300) for _ in range(200)], [rnd.randint(20, 300) for _ in range(12)])
    order = TrainConfig(pack_tokens=512, epochs=3, grad_accum=2).read_order(2)
    p = sp.plan_spool(src, order, 1_500_000, 100)
    steps = list(sp.step_rows(src.lengths["train"], order))
    assert p.total_steps == len(steps) and p.train[0].first == 0 and p.train[-1].end == len(steps)
    assert len(p.train) > 10
    for w, nxt in zip(p.train, p.train[1:], strict=False):
        assert w.end == nxt.first  # windows tile the run
    for s, rows in enumerate(steps):
        w = p.train[p.window_of(s)]
        assert w.first <= s < w.end and set(rows) <= set(w.rows)
    # the val shard and any two neighbouring windows fit together: the producer writes one while the other is read
    assert all(p.val.bytes + a.bytes + b.bytes <= p.spool_bytes for a, b in zip(p.train, p.train[1:], strict=False))
    assert p.val.rows == sorted({i for pk in sp.epoch_packs(src.lengths["val"], 0, -1, 512) for i in pk})
    # the plan is a pure function of its inputs; the order's fields and the budget are in its key
    assert sp.plan_spool(src, order, 1_500_000, 100).key == p.key
    assert sp.plan_spool(src, TrainConfig(pack_tokens=512, epochs=3, grad_accum=2, seed=1).read_order(2),
                   1_500_000, 100).key != p.key
    assert sp.plan_spool(src, order, 2_000_000, 100).key != p.key
    # two producers: windows of a third of the room, so two are written while the trainer reads a third; the
    # trainer learns the number from plan.json, and it is in the key
    two = sp.plan_spool(src, order, 1_500_000, 100, producers=2)
    assert len(two.train) > len(p.train) and two.key != p.key and two.to_json()["producers"] == 2
    assert all(two.val.bytes + a.bytes + b.bytes + c.bytes <= two.spool_bytes
               for a, b, c in zip(two.train, two.train[1:], two.train[2:], strict=False))
    assert [two.owner(w) for w in two.windows()[:4]] == [1, 0, 1, 0]  # val: the last producer's; then j % 2


def test_plan_refuses_a_budget_that_cannot_hold_one_step():
    src = _source([100] * 8, [50] * 2)
    with pytest.raises(ValueError, match=r"spool_bytes 20,000 is too small: optimizer step 0 alone reads 2 samples "
                                         r"\(24,352 bytes stored\) beside the val shard \(14,352 bytes\); give it "
                                         r"at least 63,056 bytes"):
        sp.plan_spool(src, TrainConfig(pack_tokens=200, epochs=1).read_order(1), 20_000, 100)


def test_the_cap_counts_every_reservation_and_the_trainer_waits_on_the_window_owner(tmp_path):
    """Several producers: a reserved window counts at its planned size (its growing temp file is not counted
    twice) until released; the trainer waiting for a window fails once that window's producer is silent, though
    another beats, and on any producer's error."""
    src = _source([100] * 40, [50] * 4)
    p = sp.plan_spool(src, TrainConfig(pack_tokens=200, epochs=1).read_order(1), 200_000, 100, producers=2)
    s = sp.Spool(tmp_path)
    (tmp_path / "shards").mkdir()
    (tmp_path / p.train[0].file).write_bytes(b"x" * 1000)  # committed shard of window 0
    with s.locked():
        s.reserve("producer-1", p.train[1])
    (tmp_path / "shards" / f".{p.train[1].name}.safetensors.ab12.tmp").write_bytes(b"x" * 500)  # being written
    assert s.held() == 1000 + p.train[1].bytes
    assert s.held(p.train[2]) == 1000 + p.train[1].bytes + p.train[2].bytes
    s.release("producer-1")
    assert s.held() == sp.spool_dir_bytes(tmp_path) == 1500

    def waiting_for(step: int, wait_s: float) -> sp.SpoolReader:
        waits = [lv.Waiter(tmp_path, f"producer-{k}.beat", wait_s, "the next shard", sp.PRODUCER_ERRORS)
                 for k in range(2)]
        r = sp.SpoolReader(s, p, "train", src.lengths["train"], waits, main=True, barrier=lambda: None)
        r.at(step)
        return r

    def show_up() -> None:  # a trainer that does not fail ends (failing the test) once the windows are there
        for w in p.train[1:3]:
            (tmp_path / w.file).write_bytes(b"x")
            (tmp_path / w.record).write_text(json.dumps({"key": sp.window_key(p, w)}))

    later = threading.Timer(10, show_up)
    later.start()
    with lv.beating(tmp_path / "producer-0.beat", tmp_path / sp.PRODUCER_BEAT):  # producer 0 lives, 1 is silent
        r = waiting_for(p.train[1].first, 0.5)
        with pytest.raises(RuntimeError, match=r"the producer-1 has shown no sign of life for \d+ s \(producer-1.beat"):
            r[p.train[1].rows[0]]
        err = tmp_path / "producer-1.error"
        err.write_text("RuntimeError: engine died")
        os.utime(err, (time.time() - lv.ERROR_GRACE - 1,) * 2)  # no restart of producer 1 cleared it in time
        r = waiting_for(p.train[2].first, 60)  # producer 0's window; producer 1's error fails it all the same
        with pytest.raises(RuntimeError, match=r"the producer-1 failed \(producer-1.error\): RuntimeError: engine"):
            r[p.train[2].rows[0]]
    later.cancel()


# ---------------------------------------------------------------- the pair
def test_online_equals_offline_bitwise_and_never_exceeds_the_spool(stages, tiny_llama_dir):
    spool = stages / "spool-a"
    with Watch(spool) as watch:
        prod = producer(stages, spool, *EXTRACT, model=tiny_llama_dir)
        tr = trainer(stages, spool, stages / "online-a")
        wait(tr)
        wait(prod)
    same_run(stages / "online-a", stages / "ref")
    m = json.loads((spool / "manifest.json").read_text())
    store = sum(f.stat().st_size for f in (stages / "hid" / "shards").iterdir())
    assert store > SPOOL and m["num_windows"] >= 6  # the whole store never fit: the spool was really cycled
    assert watch.samples > 100 and 0 < watch.peak <= SPOOL and m["stats"]["peak_spool_bytes"] <= SPOOL
    assert m["stats"]["windows_written"] == m["num_windows"] and m["stats"]["windows_written_again"] == 0
    assert m["stats"]["final_check"]["passed"] is not False and m["stats"]["final_check"]["positions"] > 0
    assert not list((spool / "shards").iterdir())  # the trainer finished: nothing of the states is kept
    # a rerun of both is a no-op that returns the same results at once
    prod = producer(stages, spool, *EXTRACT, model=tiny_llama_dir)
    wait(trainer(stages, spool, stages / "online-a"))
    wait(prod)
    assert json.loads((spool / "manifest.json").read_text())["fingerprint"] == m["fingerprint"]


def _until(cond, procs, timeout=300.0):
    deadline = time.time() + timeout
    while not cond():
        for p in procs:
            assert p.poll() is None, f"{p.args[3]} ended early (status {p.returncode})"
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_kills_of_producer_and_trainer_resume_to_the_same_bytes(stages, tiny_llama_dir):
    """SIGKILL the producer mid-run (restarted, it keeps the committed windows and starts at the trainer's
    position); then SIGKILL the trainer after it moved past its last checkpoint's window (restarted, it goes
    back to that checkpoint, and the producer writes the deleted windows again, byte for byte)."""
    spool, out = stages / "spool-k", stages / "online-k"
    s = sp.Spool(spool)
    prod = producer(stages, spool, *EXTRACT, model=tiny_llama_dir)
    tr = trainer(stages, spool, out)
    _until(lambda: s.position()["window"] >= 2, [prod, tr])
    kill(prod)
    prod = producer(stages, spool, *EXTRACT, model=tiny_llama_dir)
    plan = None

    def past_checkpoint() -> bool:
        nonlocal plan
        plan = plan or _plan(spool)
        done = sorted((out / "checkpoints").glob("step-*")) if (out / "checkpoints").is_dir() else []
        if not done:
            return False
        back = plan.train[plan.window_of(int(done[-1].name[5:]))]  # the window a resume starts in
        # ... which the trainer left and the producer deleted
        pos = s.position()
        return not pos["done"] and pos["window"] > back.index and not (spool / back.record).exists()

    _until(past_checkpoint, [prod, tr])
    kill(tr)
    assert not (out / "final").exists()
    wait(trainer(stages, spool, out))
    wait(prod)
    same_run(out, stages / "ref")
    st = json.loads((spool / "manifest.json").read_text())["stats"]
    assert st["windows_written_again"] >= 1 and st["peak_spool_bytes"] <= SPOOL


def test_two_producers_equal_one_bitwise_share_the_cap_and_resume_a_kill(stages, tiny_llama_dir):
    """Two producers (--workers 2, --part 0 and 1, each its own engine) fill one spool: they write two windows at
    once while the trainer reads a third, the spool sampled from outside never holds more than its cap, producer 1
    SIGKILLed mid-window (its first, the val window) and restarted clears what it left and writes its own windows,
    and the head is the offline one (and so the one-producer one: the test above) bitwise."""
    spool, out = stages / "spool-2", stages / "online-2"
    with Watch(spool) as watch:
        prods = [producer(stages, spool, *EXTRACT, "--workers", "2", "--part", str(k), model=tiny_llama_dir,
                          log=f"produce-{k}") for k in range(2)]
        tr = trainer(stages, spool, out)
        _until(lambda: (spool / "producer-1.reserve").is_file(), [*prods, tr])
        kill(prods[1])  # mid-window: its reservation (and maybe a temp file) stay behind
        prods[1] = producer(stages, spool, *EXTRACT, "--workers", "2", "--part", "1", model=tiny_llama_dir,
                            log="produce-1b")
        wait(tr)
        for p in prods:
            wait(p)
    same_run(out, stages / "ref")
    p = json.loads((spool / sp.PLAN).read_text())
    m = json.loads((spool / "manifest.json").read_text())
    st = m["stats"]
    assert p["producers"] == 2 and m["inputs"]["producers"] == 2 and m["num_windows"] >= 8
    assert watch.samples > 100 and 0 < watch.peak <= SPOOL and st["peak_spool_bytes"] <= SPOOL
    assert watch.in_flight == 2  # both producers wrote at once
    # each wrote each of its windows once (producer 0 the even train windows; producer 1 the val window and the
    # odd ones, in its restarted run: the killed one committed none)
    first, second = st["producers"]
    even = sum(w["split"] == "train" and w["index"] % 2 == 0 for w in p["windows"])
    assert (first["windows_written"], second["windows_written"]) == (even, m["num_windows"] - even)
    assert st["windows_written"] == m["num_windows"] and st["windows_written_again"] == 0
    assert st["final_check"]["ranges"] == 2 and st["final_check"]["passed"] is not False  # each producer checked
    assert not list((spool / "shards").iterdir()) and not list(spool.glob("*.reserve"))


def _plan(spool: Path) -> sp.SpoolPlan:
    """The trainer's plan of this spool, once the producer wrote source.json."""
    from eagle3.storage.store import bytes_per_token

    order = TrainConfig(**TRAIN).read_order(TRAIN["nproc_per_node"])
    return sp.plan_spool(SpoolSource.read(spool), order, SPOOL, bytes_per_token(3, 64, "fp32"))


def test_a_trainer_of_another_read_order_is_refused_by_name(stages, tiny_llama_dir):
    spool = stages / "spool-m"
    prod = producer(stages, spool, *EXTRACT, model=tiny_llama_dir)
    tr = trainer(stages, spool, stages / "online-m", "--seed", "5")
    assert tr.wait(timeout=300) == 2
    kill(prod)
    text = (stages / "online-m.train.log").read_text()
    assert "the producer planned for another source, read order or budget ({'seed': 0," in text
    assert "than this trainer ({'seed': 5," in text


@pytest.mark.vllm
def test_the_real_vllm_engine_produces_what_the_trainer_reads(family_dirs, tmp_path):
    """The vLLM producer (the real engine, fp32 on CPU) feeds the online trainer on the tiny Llama-3.1 layout
    (the CPU engine's smallest head size): every step's loss equals the offline hf head's to float noise."""
    from tests.helpers.engine import ENGINE

    model = family_dirs["llama-3.1"]
    root = build(tmp_path, model, aux=None)
    spool = root / "spool-v"
    prod = producer(root, spool, "--backend", "vllm", "--storage", "fp32", "--engine-args", json.dumps(ENGINE),
                    model=model)
    wait(trainer(root, spool, root / "online-v"))
    wait(prod)
    m = json.loads((spool / "manifest.json").read_text())
    assert m["backend"] == "vllm" and m["stats"]["peak_spool_bytes"] <= SPOOL
    check = m["stats"]["final_check"]  # run on the producer's first window, before its commit
    assert check["passed"] and check["source"] == "vLLM prompt_logprobs", check
    a, b = train_records(root / "online-v"), train_records(root / "ref")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, len(b) + 1))
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-4 * abs(y["loss"]), (x["step"], x["loss"], y["loss"])
