"""Extraction over several workers: the shard plan cut into ranges, each extracted on its own (here one after
another, as two hosts would at once), then committed into one store by moving the shards. The store equals a
single worker's bitwise; a range killed midway resumes alone; a commit killed between two moves finishes on a
rerun."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from eagle3.config import ExtractConfig
from eagle3.extract.ranges import RANGES, commit_ranges, range_dir, run_range
from eagle3.extract.run import run_extract
from eagle3.extract.shards import split_plans
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import HiddenRange, HiddenStates
from eagle3.storage.store import ShardPlan
from tests.helpers.extract_helpers import random_samples, write_prepared

CFG = ExtractConfig(aux_layer_ids=[1, 3, 4], shard_bytes=1 << 16, storage="fp32")  # ~1 sample per shard


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep")
    write_prepared(d, {"train": random_samples(256, [40, 90, 25, 60, 70, 30, 55, 80, 45, 35], seed=1),
                       "val": random_samples(256, [50, 20], seed=2)})
    return d


def test_split_plans_is_contiguous_balanced_and_total():
    plans = [ShardPlan("train", i, [i], [str(i)], [n]) for i, n in enumerate([10, 10, 10, 10, 50, 10])]
    parts = split_plans(plans, 2)
    assert [[p.index for p in r] for r in parts] == [[0, 1, 2, 3], [4, 5]]
    assert [p for r in split_plans(plans, 4) for p in r] == plans  # every shard once, in order
    assert [len(r) for r in split_plans(plans[:1], 3)] == [0, 1, 0]  # fewer shards than ranges: some empty


def test_two_ranges_commit_to_the_one_worker_store_bitwise(tiny_llama_dir, prepared, tmp_path, one_thread):
    one = run_extract(tiny_llama_dir, prepared, tmp_path / "one", CFG, show_progress=False)
    assert len(one.shards) >= 8
    cfg = CFG.model_copy(update={"workers": 2})
    out = tmp_path / "two"
    with pytest.raises(ValueError, match="range 1 of 2 is not finished"):
        r0 = run_range(tiny_llama_dir, prepared, out, cfg, 0, show_progress=False)
        commit_ranges(tiny_llama_dir, prepared, out, cfg)
    r1 = run_range(tiny_llama_dir, prepared, out, cfg, 1, show_progress=False)
    assert {s.file for s in r0.shards}.isdisjoint(s.file for s in r1.shards) and r0.shards and r1.shards
    assert len(r0.shards) + len(r1.shards) == len(one.shards)
    moved = (range_dir(out, 0, 2) / r0.shards[0].file).stat().st_ino
    two = commit_ranges(tiny_llama_dir, prepared, out, cfg)
    assert (out / r0.shards[0].file).stat().st_ino == moved  # moved, not copied
    assert not (out / RANGES).exists()
    assert two.inputs == one.inputs and two.fingerprint == one.fingerprint
    assert [(s.file, s.sha256) for s in two.shards] == [(s.file, s.sha256) for s in one.shards]
    for s in two.shards:
        assert sha256_file(out / s.file) == s.sha256
    assert sha256_file(out / "index.parquet") == sha256_file(tmp_path / "one" / "index.parquet")
    assert two.stats["workers"] == 2 and [r["part"] for r in two.stats["ranges"]] == [0, 1]
    assert two.stats["tokens_computed"] == one.num_tokens
    # Finished: a range or the commit run again return at once, computing nothing.
    assert run_range(tiny_llama_dir, prepared, out, cfg, 1, show_progress=False).stats["tokens_computed"] == 0
    assert commit_ranges(tiny_llama_dir, prepared, out, cfg).fingerprint == one.fingerprint
    # The one-process path of several workers: ranges one after another, then the commit.
    assert run_extract(tiny_llama_dir, prepared, tmp_path / "seq", cfg, show_progress=False).fingerprint == \
        one.fingerprint


def test_a_killed_range_resumes_alone_and_a_killed_commit_finishes(tiny_llama_dir, prepared, tmp_path, one_thread):
    one = run_extract(tiny_llama_dir, prepared, tmp_path / "one", CFG, show_progress=False)
    cfg = CFG.model_copy(update={"workers": 2})
    out = tmp_path / "two"
    r0 = run_range(tiny_llama_dir, prepared, out, cfg, 0, show_progress=False)
    # Range 1 as its own `eagle3 extract --part 1` process, SIGKILLed once it committed two shards.
    cmd = [sys.executable, "-m", "eagle3.cli", "extract", "--model", str(tiny_llama_dir), "--prepared", str(prepared),
           "--out", str(out), "--shard-bytes", str(1 << 16), "--aux-layers", "1,3,4", "--storage", "fp32",
           "--workers", "2", "--part", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    shards, deadline = range_dir(out, 1, 2) / "shards", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if shards.is_dir() and len(list(shards.glob("*.safetensors"))) >= 2:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "range 1 finished before it could be killed"
    assert not HiddenRange.exists(range_dir(out, 1, 2))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    r1 = HiddenRange.read(range_dir(out, 1, 2))
    assert 2 <= r1.stats["shards_skipped"] < len(r1.shards), "the rerun kept what the killed range committed"
    assert HiddenRange.read(range_dir(out, 0, 2)).fingerprint == r0.fingerprint  # range 0 untouched
    # A commit that stopped after moving range 0's shards: the rerun moves the rest.
    (out / "shards").mkdir()
    for s in r0.shards:
        os.replace(range_dir(out, 0, 2) / s.file, out / s.file)
    assert run_range(tiny_llama_dir, prepared, out, cfg, 0, show_progress=False).fingerprint == r0.fingerprint
    r = subprocess.run([*cmd[:-2], "--commit"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    two = HiddenStates.read(out)
    assert [(s.file, s.sha256) for s in two.shards] == [(s.file, s.sha256) for s in one.shards]
    assert two.fingerprint == one.fingerprint


def test_preflight_plans_extraction_over_n_hosts_as_the_largest_range():
    """The Kimi-K2.5 preset's extraction on 1, 4 and 16 hosts: one host's time times the largest range's share
    (an even cut plus at most one shard); the other stages keep theirs."""
    from pathlib import Path

    from eagle3.config import PipelineConfig
    from eagle3.planning import plan, worker_share

    base = PipelineConfig.from_file(Path(__file__).parents[3] / "examples" / "kimi-k2.5.yaml")
    plans = {}
    for n in (1, 4, 16):
        cfg = base.model_copy(update={"extract": base.extract.model_copy(update={"workers": n})})
        plans[n] = plan(cfg, free_bytes=1 << 50, free_mem=1 << 40)
        share = worker_share(cfg, cfg.target, plans[n].tokens)
        assert 1 / n <= share < 1 / n + 0.01  # 1 GiB shards against ~22.8M tokens of ~36 KB each
        assert plans[n].seconds["extract"] == pytest.approx(plans[1].seconds["extract"] * share)
        assert {k: v for k, v in plans[n].seconds.items() if k != "extract"} == \
            {k: v for k, v in plans[1].seconds.items() if k != "extract"}
    assert any("over 16 workers" in r.what for r in plans[16].rows)
