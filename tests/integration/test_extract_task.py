"""Stage 2 as a Prefect task: a retry resumes committed shards; the cache key is content, not paths."""
from __future__ import annotations

import threading

from eagle3.config import ExtractConfig
from eagle3.extract import run_extract
from eagle3.storage.manifests import HiddenStates
from tests.helpers.extract_helpers import random_samples, write_prepared


class _FlakyOnce:
    """Wraps the real backend; the first backend to reach its `at`-th shard dies there, once (like a lost GPU
    host). Counted per backend: two ranges run at once, each with its own."""

    at = 3
    failed = False
    lock = threading.Lock()

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, 0

    def extract(self, samples, on_tokens=None):
        self.calls += 1
        with _FlakyOnce.lock:
            fail = self.calls == _FlakyOnce.at and not _FlakyOnce.failed
            _FlakyOnce.failed |= fail
        if fail:
            raise RuntimeError("simulated crash in the middle of the run")
        yield from self.inner.extract(samples, on_tokens)


def test_retry_resumes_and_cache_keys_on_content(tiny_llama_dir, tmp_path, monkeypatch, prefect_env):
    from prefect import flow

    import eagle3.extract.shards as er  # plan_run builds the backend there
    from tasks.extract import extract_task

    rows = random_samples(1000, [100] * 6, seed=9)
    prep = tmp_path / "prep"
    write_prepared(prep, {"train": rows})
    cfg = ExtractConfig(aux_layer_ids=[1, 2, 3], shard_bytes=1 << 16)  # one sample per shard
    ref = run_extract(tiny_llama_dir, prep, tmp_path / "ref", cfg, show_progress=False)
    assert len(ref.shards) == 6

    _FlakyOnce.at, _FlakyOnce.failed = 3, False
    real = er.make_backend
    monkeypatch.setattr(er, "make_backend", lambda *a, **k: _FlakyOnce(real(*a, **k)))
    monkeypatch.setattr(extract_task, "retry_delay_seconds", [0, 0])

    @flow
    def f(out: str, cfg: ExtractConfig):
        return extract_task(str(tiny_llama_dir), str(prep), out, cfg, return_state=True)

    st = f(str(tmp_path / "out"), cfg)
    assert st.is_completed() and _FlakyOnce.failed
    m = HiddenStates.read(tmp_path / "out")
    assert m.stats["shards_skipped"] == 2  # the retry kept what the failed attempt committed
    assert [s.sha256 for s in m.shards] == [s.sha256 for s in ref.shards]

    # same inputs again -> cache hit (no body run: the backend is never built)
    monkeypatch.setattr(er, "make_backend", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    st2 = f(str(tmp_path / "out"), cfg)
    assert st2.name == "Cached" and st2.result().fingerprint == m.fingerprint
    # other layer ids change the key: the body runs again
    monkeypatch.setattr(er, "make_backend", real)
    st3 = f(str(tmp_path / "out2"), cfg.model_copy(update={"aux_layer_ids": [0, 2, 4]}))
    assert st3.name == "Completed" and st3.result().layer_ids == [0, 2, 4, 6]


def test_ranges_on_two_workers_retry_alone_and_commit_the_one_worker_store(tiny_llama_dir, tmp_path, monkeypatch,
                                                                          prefect_env):
    """The extract flow with `workers: 2`, in this process: two range tasks at once, then the commit. The range
    that dies (on its second shard) is retried alone and keeps its first shard; the store equals one worker's."""
    import eagle3.extract.shards as er  # plan_run builds the backend there
    from eagle3.extract.ranges import RANGES
    from flows.stages import extract
    from tasks.extract import extract_range_task

    rows = random_samples(1000, [100] * 6, seed=9)
    prep = tmp_path / "prep"
    write_prepared(prep, {"train": rows})
    cfg = ExtractConfig(aux_layer_ids=[1, 2, 3], shard_bytes=1 << 16)
    ref = run_extract(tiny_llama_dir, prep, tmp_path / "ref", cfg, show_progress=False)
    _FlakyOnce.at, _FlakyOnce.failed = 2, False
    real = er.make_backend
    monkeypatch.setattr(er, "make_backend", lambda *a, **k: _FlakyOnce(real(*a, **k)))
    monkeypatch.setattr(extract_range_task, "retry_delay_seconds", [0, 0])
    two = cfg.model_copy(update={"workers": 2})
    m = extract(str(tiny_llama_dir), str(prep), str(tmp_path / "out"), two)
    assert _FlakyOnce.failed
    assert [(s.file, s.sha256) for s in m.shards] == [(s.file, s.sha256) for s in ref.shards]
    assert m.fingerprint == ref.fingerprint and not (tmp_path / "out" / RANGES).exists()
    assert sorted(r["shards_skipped"] for r in m.stats["ranges"]) == [0, 1]  # the retried range resumed
    assert [r["shards"] for r in m.stats["ranges"]] == [3, 3]
    # Again: the ranges and the commit come from the cache (no backend is built).
    monkeypatch.setattr(er, "make_backend", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    assert extract(str(tiny_llama_dir), str(prep), str(tmp_path / "out"), two).fingerprint == ref.fingerprint
