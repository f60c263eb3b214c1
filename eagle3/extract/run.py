"""Stage 2 driver: plan shards over the prepared samples, fill each one from a backend, commit it.

Resume is by construction: the shard plan is a pure function of the prepared manifest and the
config, a shard is written atomically (temp file + rename) and carries its plan key in its
metadata, so a rerun skips every committed shard whose key matches and recomputes the rest.
Each shard is computed from its own samples only (its batches never depend on what was done
before), so a resumed run writes the same bytes as an uninterrupted one.

Several workers (`cfg.workers = N`): the shard plan is cut into N contiguous ranges of about equal
tokens (`split_plans`). Range k is extracted into its own dir, `out/ranges/{k:03d}-of-{N:03d}/`, with
its own engine, lock, temp files and manifest (`HiddenRange`), so ranges run at once on different
hosts and a killed one resumes alone. `commit_ranges` then moves (renames: every host writes to the
same shared filesystem, so nothing is copied) each range's shards into `out/shards/` and writes the
one index and manifest. A shard's bytes depend on its own samples only, so the committed store is
bitwise the one a single worker writes; the manifest's inputs are the same too (the number of workers
changes speed, not bytes).

Incremental runs: samples an earlier extract dir (`reuse=`) already holds -- same sample_id (a
content hash of ids + mask), same model fingerprint, layer ids and storage -- are copied from it
as stored, so a dataset that grew by 5% costs about 5% of a full extraction.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from eagle3.config import ExtractConfig
from eagle3.extract.backend import Backend
from eagle3.extract.ranges import extract_in_ranges
from eagle3.extract.resume import open_target, previous_run
from eagle3.extract.shards import Progress, compute, write_index
from eagle3.runtime.heap import retain_freed_memory
from eagle3.storage.lock import RunLock
from eagle3.storage.manifests import HiddenStates


def run_extract(
    model: str | Path,
    prepared: str | Path,
    out: str | Path,
    cfg: ExtractConfig | None = None,
    *,
    reuse: Sequence[str | Path] = (),
    progress: Progress | None = None,
    show_progress: bool = True,
    backend: Backend | None = None,
    trust_remote_code: bool = False,
) -> HiddenStates:
    """Extract aux + final hidden states of `prepared` with `model` into `out`; return its manifest.

    Idempotent and resumable: a finished `out` with the same inputs is returned as is; a partial
    one keeps its committed shards. `backend` overrides the one `cfg.backend` would build.
    With cfg.workers > 1 the ranges run here one after another (each resumable alone), then are
    committed: the store a pipeline gets by running the ranges on several workers at once.
    """
    cfg = cfg or ExtractConfig()
    if cfg.workers > 1:
        return extract_in_ranges(model, prepared, out, cfg, reuse=reuse, progress=progress,
                                 show_progress=show_progress, backend=backend, trust_remote_code=trust_remote_code)
    with RunLock(out):
        return _extract_whole(Path(model), Path(prepared), Path(out), cfg, reuse, progress, show_progress, backend,
                              trust_remote_code)


def _extract_whole(model: Path, prepared: Path, out: Path, cfg: ExtractConfig, reuse: Sequence[str | Path],
                   progress: Progress | None, show_progress: bool, backend: Backend | None,
                   trust_remote_code: bool) -> HiddenStates:
    """One worker: every shard of the plan, straight into `out`, then the index and the manifest."""
    retain_freed_memory()  # batch after batch of the same large buffers: reuse them in place
    target, fp = open_target(model, prepared, cfg, trust_remote_code)
    prev = previous_run(out, fp)
    if prev.done is not None:
        return prev.done
    run, tokens, seconds = compute(out, prepared, cfg, target, prev, reuse, backend, progress, show_progress)
    index_sha = write_index(out, run.plans)
    man = run.manifest(fp, model, index_sha, tokens, seconds)
    man.write(out)
    return man
