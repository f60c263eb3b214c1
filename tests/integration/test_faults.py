"""Fault injection: SIGKILL at chosen points of extraction, shard commits, training and checkpoint
saves; a full disk; corrupted files; a Prefect task killed mid-run. After each fault the rerun
must equal the uninterrupted run (shard sha256s; loss trajectory and exported weights).
benchmarks/drills/faults.py runs the larger matrix with the same drills (tests/helpers/fault_drills.py)."""
from __future__ import annotations

import json
import random
import shutil

import pytest

import eagle3.storage.faults  # noqa: F401  parsed now, before any test sets EAGLE3_KILL_AT: this process never dies
import tests.helpers.fault_drills as fault_drills
from tests.helpers.fault_drills import (
    build_inputs,
    cli,
    enospc_extract,
    enospc_stage,
    enospc_train,
    extract_disk_preflight,
    kill_drill,
    leftovers,
    losses,
    random_kill_drill,
    rank_kill_drill,
    ranks_cmd,
    shard_digests,
    snapshot_code,
    stage_kill_drill,
    stage_reference,
    tmpfs_available,
    train_cmd,
    weights,
)


@pytest.fixture(scope="module")
def inputs(tiny_llama_dir, tmp_path_factory):
    snapshot_code(tmp_path_factory.mktemp("code"))
    yield build_inputs(tmp_path_factory.mktemp("fault-inputs"), tiny_llama_dir)
    fault_drills.CODE[0] = fault_drills.REPO


def test_malformed_kill_spec_is_refused():
    with pytest.raises(ValueError, match="EAGLE3_KILL_AT"):
        eagle3.storage.faults.parse("train.stepp:3")
    assert eagle3.storage.faults.parse("file.written@shards/:3") == ("file.written", "shards/", 3)


@pytest.mark.parametrize("stage,spec", [
    ("extract", "extract.batch:5"),                 # between forward batches
    ("shard commit", "file.written@shards/:7"),     # shard temp file complete, not renamed
    ("shard commit", "file.renamed@shards/:3"),     # renamed, index and manifest not yet written
    ("training", "train.step:5"),                   # between optimizer steps
    ("checkpoint save", "file.written@meta.json:3"),  # between the files of one checkpoint
    ("checkpoint save", "dir.written@best:1"),      # every file of `best` written, the dir not renamed
    # the checkpoint of an epoch's last step (16) is saved before the epoch-end validation, which the
    # killed run logged: the resume must not log it twice (found by benchmarks/drills/faults.py)
    ("training", "train.step:17"),
    # inside the tensor write itself: a shard with its header and ids on disk, its states not; a
    # checkpoint's weights half written; its optimizer state half written
    ("tensor write", "file.writing@shards/:7"),
    ("tensor write", "file.writing@model.safetensors:2"),
    ("tensor write", "file.writing@state.pt:3"),
])
def test_sigkill_at_point_then_rerun_equals_uninterrupted(stage, spec, inputs, tmp_path):
    d = kill_drill(stage, spec, inputs, tmp_path / "out")
    assert (d.killed, d.recovered, d.equal) == (True, True, True), d.detail


@pytest.fixture(scope="module")
def eval_ref(inputs, tmp_path_factory) -> tuple:
    """The uninterrupted replay eval of the drill's trained head: (its root, its manifest's fingerprint)."""
    root = tmp_path_factory.mktemp("eval-ref")
    return root, stage_reference("eval", inputs, root)


@pytest.mark.parametrize("stage,spec", [
    ("verifier", "file.written@verifier.safetensors:1"),  # its temp file was never cleaned before
    ("eval", "dir.written@cache:1"),                        # the replay answers built, their dir not renamed
    ("eval", "file.written@cache:1"),                       # the aux states written, not renamed
])
def test_sigkill_in_another_stage_then_rerun_equals_uninterrupted(stage, spec, inputs, eval_ref, tmp_path):
    ref = eval_ref[1] if stage == "eval" else stage_reference(stage, inputs, tmp_path / "ref")
    d = stage_kill_drill(stage, spec, inputs, tmp_path / "out", ref)
    assert (d.killed, d.recovered, d.equal) == (True, True, True), d.detail


def test_a_non_zero_rank_killed_under_ddp_then_rerun_equals_uninterrupted(inputs, tmp_path):
    """Rank 1 of 2 dies of SIGKILL at step 5: torchrun stops rank 0 and the command fails; the rerun resumes
    from the step-4 checkpoint and ends bitwise equal to the uninterrupted 2-rank run."""
    ref = tmp_path / "ref"
    r = cli(ranks_cmd(inputs, ref))
    assert r.returncode == 0, r.stderr[-2000:]
    d = rank_kill_drill("train.step:5", 1, inputs, tmp_path / "out", ref)
    assert (d.killed, d.recovered, d.equal) == (True, True, True), d.detail


@pytest.mark.skipif(not tmpfs_available(), reason="no private mount namespace for a small tmpfs")
def test_full_disk_in_eval_is_one_line_then_rerun_equals_uninterrupted(inputs, eval_ref, tmp_path):
    root, ref = eval_ref
    r = enospc_stage("eval", inputs, tmp_path / "disk", (root / "eval-ref", root / "eval-ref-cache"), ref)
    assert r["first_exit"] == 2 and r["one_line"] and "no space left on device writing" in r["message"], r
    assert r["leftovers"] == [] and r["rerun_exit"] == 0 and r["equal"], r


def test_corrupt_and_truncated_shards_are_named_and_only_they_are_rebuilt(inputs, tmp_path):
    out = tmp_path / "hid"
    shutil.copytree(inputs.hid, out)
    shards = sorted((out / "shards").glob("train-*.safetensors"))
    assert len(shards) >= 10
    data = bytearray(shards[2].read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the states: the header still parses
    shards[2].write_bytes(bytes(data))
    shards[5].write_bytes(shards[5].read_bytes()[:-100])  # truncated
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards}

    r = cli(["train", "--hidden", str(out), "--verifier", str(inputs.ver), "--out", str(tmp_path / "t"),
             "--max-steps", "1", "--threads", "1", "--pack-tokens", "4096"])  # a reader names the bad file
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"{shards[2]}: sha256 differs from the manifest" in r.stderr or f"{shards[5]}: truncated" in r.stderr

    r = cli(["extract", "--model", str(inputs.model), "--prepared", str(inputs.prep), "--out", str(out),
             "--aux-layers", "1,3,4", "--shard-bytes", str(1 << 16), "--batch-tokens", "128"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{shards[2]}: sha256 differs from the manifest (corrupt); rebuilding it" in r.stderr
    assert f"{shards[5]}: truncated or padded" in r.stderr
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards}
    assert {k for k in before if before[k] != after[k]} == {shards[2].name, shards[5].name}  # others untouched
    m = json.loads((out / "manifest.json").read_text())
    redone = [s["num_samples"] for s in m["shards"] if s["file"].endswith((shards[2].name, shards[5].name))]
    assert m["stats"]["shards_written"] == 2 and m["stats"]["samples_computed"] == sum(redone)
    assert shard_digests(out) == shard_digests(inputs.hid)


def test_corrupt_newest_checkpoint_resumes_from_the_one_before(inputs, tmp_path):
    out = tmp_path / "train"
    assert cli(train_cmd(inputs, out), {"EAGLE3_KILL_AT": "train.step:7"}).returncode == -9
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert [c.name for c in ckpts] == ["step-00000004", "step-00000006"]
    (ckpts[-1] / "state.pt").write_bytes((ckpts[-1] / "state.pt").read_bytes()[:-10])  # truncated
    r = cli(train_cmd(inputs, out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from step-00000004" in r.stderr
    assert f"checkpoint step-00000006 skipped: {ckpts[-1] / 'state.pt'} does not match its checksum" in r.stderr
    assert losses(out) == losses(inputs.train) and weights(out) == weights(inputs.train)


def test_external_kill_lands_inside_extraction_then_rerun_equals_uninterrupted(inputs, tmp_path):
    # The drill's delay follows the observed pace (a shard of the tiny drill takes ~8 ms on an idle machine),
    # so its kill lands inside extraction; should one still miss (the process finished first), that draw
    # tested nothing and the next one is tried, in a fresh out dir.
    rng, missed = random.Random(3), []
    for i in range(5):
        d = random_kill_drill("extract", inputs, tmp_path / f"out-{i}", rng)
        if d.killed:
            break
        missed.append(d.detail)
    assert d.killed, f"no kill landed inside extraction in 5 draws: {missed}"
    assert (d.recovered, d.equal) == (True, True), d.detail


@pytest.mark.skipif(not tmpfs_available(), reason="no private mount namespace for a small tmpfs")
def test_checkpoint_save_on_a_full_disk_keeps_the_previous_one_then_resumes(inputs, tmp_path):
    r = enospc_train(inputs, tmp_path)
    assert r.first_rc == 2, r.message
    assert "Traceback" not in r.message and len(r.message.splitlines()) == 1, r.message
    assert ("no space left on device writing" in r.message and "/checkpoints/step-" in r.message
            and "MiB free" in r.message)
    assert r.leftovers == []  # the half-written checkpoint dir was removed
    assert r.checkpoints and r.intact  # the previous checkpoints are whole and match their checksums
    assert r.second_rc == 0 and f"resumed from {r.checkpoints[-1]}" in r.resumed_from
    assert losses(r.out) == losses(inputs.train) and weights(r.out) == weights(inputs.train)


@pytest.mark.skipif(not tmpfs_available(), reason="no private mount namespace for a small tmpfs")
def test_standalone_extract_refuses_up_front_when_the_disk_cannot_hold_it(inputs, tmp_path):
    """Disk preflight: on a tmpfs with room for 40% of the shards, `eagle3 extract` fails before loading
    the model, in one line with the numbers and the options, having written no shard."""
    r = extract_disk_preflight(inputs, tmp_path)
    assert r["exit"] == 2 and len(r["message"].splitlines()) == 1 and "Traceback" not in r["message"], r
    assert (f"{r['out']}: not enough disk to extract: " in r["message"]
            and "bytes/token (bf16) need about" in r["message"])
    assert "--storage fp8" in r["message"] and r["files_written"] == []  # no shard, not even a temp file


@pytest.mark.skipif(not tmpfs_available(), reason="no private mount namespace for a small tmpfs")
def test_full_disk_names_path_and_free_space_then_rerun_equals_uninterrupted(inputs, tmp_path):
    r = enospc_extract(inputs, tmp_path)
    assert r.first_rc == 2, r.message
    assert "Traceback" not in r.message and len(r.message.splitlines()) == 1
    assert "no space left on device writing" in r.message and "shards/train-" in r.message and "MiB free" in r.message
    assert r.leftovers == []  # no half-written shard
    n = len(shard_digests(inputs.hid)) // 2
    assert 0 < r.committed < n  # some shards were committed before the disk filled
    assert r.second_rc == 0
    assert shard_digests(r.out) == shard_digests(inputs.hid)
    assert json.loads((r.out / "manifest.json").read_text())["stats"]["shards_skipped"] == r.committed


def test_prefect_train_task_killed_mid_run_retries_and_resumes(inputs, tmp_path, monkeypatch, prefect_env):
    """The torchrun process dies of SIGKILL at step 5; Prefect retries the task; the retry resumes
    from the step-4 checkpoint (steps 1-4 are not redone) and ends equal to the uninterrupted run."""
    from prefect import flow

    from eagle3.config import TrainConfig
    from tasks.train import train_task

    cfg = TrainConfig(max_steps=24, epochs=20, ttt_steps=2, pack_tokens=128, log_every=1, val_every=3, ckpt_every=2,
                      warmup_steps=1, threads=1, lr=1e-3, keep_last=100)
    out = tmp_path / "train"
    monkeypatch.setattr(train_task, "retry_delay_seconds", [0, 0])
    monkeypatch.chdir(fault_drills.CODE[0])  # torchrun runs the frozen code the reference run ran
    monkeypatch.setenv("EAGLE3_KILL_AT", "train.step:5")
    monkeypatch.setenv("EAGLE3_KILL_MARKER", str(tmp_path / "killed-once"))

    step4: list = []

    @flow
    def f():
        return train_task(str(inputs.hid), str(inputs.ver), str(out), cfg, return_state=True)

    orig = train_task.fn

    def spy(*a, **k):  # note the step-4 checkpoint the first attempt left, before the retry runs
        if (out / "checkpoints" / "step-00000004").is_dir():
            step4.append((out / "checkpoints" / "step-00000004" / "model.safetensors").stat().st_ino)
        return orig(*a, **k)

    monkeypatch.setattr(train_task, "fn", spy)
    st = f()
    assert st.is_completed(), st
    assert (tmp_path / "killed-once").is_file()  # the first attempt did die
    assert len(step4) == 1  # exactly one retry, and it found the checkpoint
    assert (out / "checkpoints" / "step-00000004" / "model.safetensors").stat().st_ino == step4[0]  # not rewritten
    assert not leftovers(out)
    assert losses(out) == losses(inputs.train) and weights(out) == weights(inputs.train)
