"""Stage 2 resume: SIGKILL the real `eagle3 extract` process mid-run, rerun, compare shard sha256s."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from eagle3.config import ExtractConfig
from eagle3.extract import run_extract
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import HiddenStates
from tests.helpers.extract_helpers import chat_samples, write_prepared


@pytest.mark.slow
def test_sigkill_then_rerun_equals_uninterrupted(smollm2_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prep = tmp_path / "prep"
    write_prepared(prep, {"train": chat_samples(tok, 14), "val": chat_samples(tok, 2)})
    # the smallest shards allowed (64 KiB) hold one ~70-token SmolLM2 sample each: 16 shards
    cfg = ExtractConfig(shard_bytes=1 << 16)

    ref = run_extract(smollm2_dir, prep, tmp_path / "ref", cfg, show_progress=False)
    assert len(ref.shards) == 16

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "eagle3.cli", "extract", "--model", str(smollm2_dir), "--prepared", str(prep),
           "--out", str(out), "--shard-bytes", str(1 << 16)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    shards = out / "shards"
    deadline = time.time() + 300
    committed: list = []
    while time.time() < deadline and proc.poll() is None:
        committed = sorted(shards.glob("train-*.safetensors")) if shards.is_dir() else []
        if len(committed) >= 3:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the extract process finished before it could be killed"
    assert not (out / "manifest.json").exists()
    n_before = len(list(shards.glob("*.safetensors")))
    assert 3 <= n_before < 16

    # rerun (the command a retry would run): committed shards are skipped, the rest computed
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    man = HiddenStates.read(out)
    assert man.stats["shards_skipped"] >= n_before - 1  # the newest file may be the one being renamed
    assert man.stats["shards_written"] == 16 - man.stats["shards_skipped"]
    assert not list(shards.glob(".*.tmp"))
    assert [s.file for s in man.shards] == [s.file for s in ref.shards]
    for a, b in zip(ref.shards, man.shards, strict=True):
        assert a.sha256 == b.sha256 == sha256_file(out / b.file), b.file
    assert man.fingerprint == ref.fingerprint
