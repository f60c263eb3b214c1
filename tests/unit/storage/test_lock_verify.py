"""Run locks (holder named, dead holder recovered) and `eagle3 verify` (corrupt files named)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.storage.lock import LockedError, RunLock

REPO = Path(__file__).resolve().parents[3]
HOLD = ("import sys, time; from eagle3.storage.lock import RunLock\n"
        "with RunLock(sys.argv[1]):\n print('held', flush=True); time.sleep(600)")


def hold(d: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(d)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_writer_is_refused_naming_the_holder_then_recovers_after_sigkill(tmp_path):
    p = hold(tmp_path)
    try:
        with pytest.raises(LockedError, match=f"pid {p.pid} on .* since"):
            with RunLock(tmp_path):
                pass
        t0 = time.monotonic()
        with pytest.raises(LockedError):
            with RunLock(tmp_path, wait_s=1.0):
                pass
        assert time.monotonic() - t0 >= 1.0  # it waited before giving up
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    with RunLock(tmp_path):  # the kernel dropped the dead holder's lock: no manual cleanup
        assert json.loads((tmp_path / ".eagle3.lock").read_text())["pid"] == os.getpid()


def test_cli_stage_on_a_locked_dir_exits_at_once(tmp_path, smollm2_dir):
    p = hold(tmp_path / "out")
    try:
        r = subprocess.run([sys.executable, "-m", "eagle3.cli", "prepare", "--model", str(smollm2_dir), "--data",
                            "sharegpt", "--limit", "5", "--out", str(tmp_path / "out")],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 2 and f"in use by pid {p.pid}" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_verify_names_corrupt_truncated_and_missing_files(tmp_path, smollm2_dir):
    from eagle3.config import PrepareConfig
    from eagle3.prepare import prepare

    run = tmp_path / "run"
    prepare(smollm2_dir, run / "prepare", PrepareConfig(data="sharegpt", limit=30, max_len=128, shard_samples=8,
                                                        draft_vocab=256), progress=False)
    cli = [sys.executable, "-m", "eagle3.cli", "verify", str(run)]
    ok = subprocess.run(cli, capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0 and ok.stdout.startswith("OK  prepare")
    shards = sorted((run / "prepare").glob("train-*.parquet"))
    data = bytearray(shards[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    shards[0].write_bytes(bytes(data))                            # one flipped byte
    shards[1].write_bytes(shards[1].read_bytes()[:100])           # truncated
    (run / "prepare" / "vocab_map.safetensors").unlink()          # missing
    bad = subprocess.run(cli, capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2
    assert f"{shards[0]}: sha256 differs" in bad.stdout and f"{shards[1]}: sha256 differs" in bad.stdout
    assert "vocab_map.safetensors: missing" in bad.stdout
    assert sum(ln.startswith("    ") for ln in bad.stdout.splitlines()) == 3  # only those three


HASH_ONCE = """
import sys, time
from pathlib import Path
import eagle3.storage.hashing as a
real, n = a.sha256_file, []
a.sha256_file = lambda p: n.append(p) or real(p)
while not Path(sys.argv[2]).exists():
    time.sleep(0.005)
d = a.sha256_file_cached(sys.argv[1])
print(len(n), d)
"""


def test_sha256_stamp_hashes_once_per_host_across_concurrent_processes(tmp_path, monkeypatch):
    """Four processes (a trainer's ranks) verify one file at the same moment: one reads it, the others
    wait for its stamp; a later process reads nothing."""
    from eagle3.storage.hashing import sha256_file

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "shard.bin"
    f.write_bytes(os.urandom(1 << 20) * 96)  # 96 MiB: hashing takes long enough for all four to ask at once
    go = tmp_path / "go"
    ps = [subprocess.Popen([sys.executable, "-c", HASH_ONCE, str(f), str(go)], stdout=subprocess.PIPE, text=True,
                           cwd=REPO) for _ in range(4)]
    time.sleep(2)  # all four import and wait for `go`
    go.touch()
    outs = [p.communicate(timeout=120)[0].split() for p in ps]
    want = sha256_file(f)
    assert sorted(int(n) for n, _ in outs) == [0, 0, 0, 1] and {d for _, d in outs} == {want}
    later = subprocess.run([sys.executable, "-c", HASH_ONCE, str(f), str(go)], capture_output=True, text=True,
                           cwd=REPO)
    assert later.stdout.split() == ["0", want]


def test_sha256_stamp_follows_every_change_of_the_file(tmp_path, monkeypatch):
    import eagle3.storage.hashing as a

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    calls: list = []
    real = a.sha256_file
    monkeypatch.setattr(a, "sha256_file", lambda p: calls.append(p) or real(p))
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    assert a.sha256_file_cached(f) == real(f) and len(calls) == 1
    assert a.sha256_file_cached(f) == real(f) and len(calls) == 1  # the stamp answers
    st = f.stat()
    time.sleep(0.05)
    f.write_bytes(b"b" * 1000)  # same size, then the old mtime put back: the ctime still moved
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert a.sha256_file_cached(f) == real(f) == a.sha256_bytes(b"b" * 1000) and len(calls) == 2
    g = tmp_path / "g.bin"
    g.write_bytes(b"c" * 1000)
    os.replace(g, f)  # another inode at the same path
    assert a.sha256_file_cached(f) == a.sha256_bytes(b"c" * 1000) and len(calls) == 3
    assert a.sha256_file_cached(f, rehash=True) == a.sha256_bytes(b"c" * 1000) and len(calls) == 4


def test_verify_reads_only_what_changed_unless_deep(tmp_path, smollm2_dir, monkeypatch):
    import eagle3.storage.hashing as a
    from eagle3.checksums import verify_tree
    from eagle3.config import PrepareConfig
    from eagle3.prepare import prepare

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run"
    prepare(smollm2_dir, run / "prepare", PrepareConfig(data="sharegpt", limit=30, max_len=128, shard_samples=8,
                                                        draft_vocab=256), progress=False)
    calls: list = []
    real = a.sha256_file
    monkeypatch.setattr(a, "sha256_file", lambda p: calls.append(p) or real(p))
    (f,) = verify_tree(run)
    n = f.checked
    assert n >= 4 and not f.bad and len(calls) == n  # first look on this host: every file read
    assert not verify_tree(run)[0].bad and len(calls) == n  # unchanged: no byte read again
    assert not verify_tree(run, deep=True)[0].bad and len(calls) == 2 * n  # --deep: every byte again
    shard = sorted((run / "prepare").glob("train-*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    (f,) = verify_tree(run)
    assert len(calls) == 2 * n + 1 and f.bad == [f"{shard}: sha256 differs from the manifest (corrupt or truncated)"]


def test_stop_message_names_the_last_output_not_a_checksum_stamp(tmp_path, monkeypatch):
    """A stamp the checksum cache writes is bookkeeping: a stop after it still names the run's last output."""
    import signal

    import eagle3.storage.hashing as a
    from eagle3.runtime import stop
    from eagle3.storage.atomic import atomic_write_text

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run" / "shard-0.txt"
    atomic_write_text(out, "x")
    a.sha256_file_cached(out)
    assert any((tmp_path / "cache").rglob("*.json"))  # the stamp was written
    assert f"the last file committed was {out};" in stop.message(stop.Stopped(signal.SIGTERM))
