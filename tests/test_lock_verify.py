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

from eagle3.lock import LockedError, RunLock

REPO = Path(__file__).resolve().parents[1]
HOLD = "import sys, time; from eagle3.lock import RunLock\nwith RunLock(sys.argv[1]):\n print('held', flush=True); time.sleep(600)"


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
    from eagle3.data.prepare import prepare

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


def test_sha256_cache_survives_processes_and_follows_rewrites(tmp_path, monkeypatch):
    from eagle3.atomic import sha256_file, sha256_file_cached

    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 1000)
    assert sha256_file_cached(f) == sha256_file(f)
    assert len(json.loads((tmp_path / "cache" / "sha256.json").read_text())) == 1
    f.write_bytes(b"b" * 1001)  # a rewrite changes size/mtime: a new key, a fresh hash
    assert sha256_file_cached(f) == sha256_file(f)
