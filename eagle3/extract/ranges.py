"""Extraction over several workers: the shard plan cut into contiguous ranges of about equal tokens, each
extracted into its own dir with its own engine, lock and manifest (`HiddenRange`), then one commit that renames
every range's shards into the store and writes its index and manifest (see eagle3/extract/run.py)."""
from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3.config import ExtractConfig
from eagle3.extract.backend import Backend
from eagle3.extract.resume import Previous, drop_stale_shards, inputs, open_out, open_target, previous_run
from eagle3.extract.shards import Progress, compute, plan_run, read_samples, split_plans, write_index
from eagle3.runtime.heap import retain_freed_memory
from eagle3.storage.lock import RunLock
from eagle3.storage.manifests import HiddenRange, HiddenStates
from eagle3.storage.store import (
    ShardPlan,
    shard_problem,
)

RANGES = "ranges"


def range_dir(out: str | Path, k: int, n: int) -> Path:
    """Where range k of n is extracted before the commit moves its shards into `out/shards/`."""
    return Path(out) / RANGES / f"{k:03d}-of-{n:03d}"


def range_inputs(fp: dict[str, Any], k: int, n: int) -> dict[str, Any]:
    """What range k of n holds: the store's inputs and which range of its plan."""
    return {**fp, "range": [k, n]}


def run_range(
    model: str | Path,
    prepared: str | Path,
    out: str | Path,
    cfg: ExtractConfig,
    k: int,
    *,
    reuse: Sequence[str | Path] = (),
    progress: Progress | None = None,
    show_progress: bool = True,
    backend: Backend | None = None,
    trust_remote_code: bool = False,
) -> HiddenRange:
    """Extract range k of cfg.workers into `range_dir(out, k, n)`; return its manifest. One process per range
    (its own lock): ranges run at once on several workers, a killed one resumes alone, keeping its committed
    shards. A range already committed into `out` (or a finished `out`) is returned as is."""
    n = cfg.workers
    if not 0 <= k < n:
        raise ValueError(f"extract range {k} does not exist: workers {n} makes ranges 0 to {n - 1}")
    retain_freed_memory()
    model, prepared, out = Path(model), Path(prepared), Path(out)
    rdir = range_dir(out, k, n)
    with RunLock(rdir):
        target, fp = open_target(model, prepared, cfg, trust_remote_code)
        want = range_inputs(fp, k, n)
        if (done := _range_done(out, rdir, want)) is not None:
            return done
        run, tokens, seconds = compute(rdir, prepared, cfg, target, Previous(), reuse, backend, progress,
                                        show_progress, part=(k, n))
        part = run.manifest(fp, model, "", tokens, seconds)  # its shards and stats; never written as such
        m = HiddenRange(config=cfg.model_dump(mode="json"), inputs=want, part=k, parts=n, shards=part.shards,
                        num_tokens=part.num_tokens, stats={**part.stats, "backend": part.backend})
        m.write(rdir)
        return m


def _range_done(out: Path, rdir: Path, want: dict[str, Any]) -> HiddenRange | None:
    """Range `want` as finished before: its manifest, every shard sound in its dir or already moved into `out`
    by a commit; or, when `out` holds the finished store, the range's part of it. None: (re)run it."""
    k, n = want["range"]
    fp = {key: v for key, v in want.items() if key != "range"}
    if HiddenStates.exists(out) and (whole := HiddenStates.read(out)).inputs == fp:
        by_file = {s.file: s for s in whole.shards}
        mine = [s for s in _range_files(whole, k, n) if s in by_file]
        shards = [by_file[f] for f in mine]
        return HiddenRange(config=whole.config, inputs=want, part=k, parts=n, shards=shards,
                           num_tokens=sum(s.num_tokens for s in shards),
                           stats={"shards_skipped": len(shards), "tokens_computed": 0}).seal()
    if not HiddenRange.exists(rdir) or (m := HiddenRange.read(rdir)).inputs != want:
        return None
    for s in m.shards:
        here = rdir / s.file
        if shard_problem(here if here.exists() else out / s.file) is not None:
            return None
    return m


def _range_files(whole: HiddenStates, k: int, n: int) -> list[str]:
    """The shard files of range k of n of a finished store, cut as `split_plans` cuts its plan."""
    plans = [ShardPlan(s.split, 0, [], [], [s.num_tokens]) for s in whole.shards]
    names = {id(p): s.file for p, s in zip(plans, whole.shards, strict=True)}
    return [names[id(p)] for p in split_plans(plans, n)[k]]


def commit_ranges(model: str | Path, prepared: str | Path, out: str | Path, cfg: ExtractConfig, *,
                  trust_remote_code: bool = False) -> HiddenStates:
    """One store from the cfg.workers finished ranges: each range's shards renamed into `out/shards/` (the ranges
    are on the filesystem `out` is on: a rename, never a copy), then the index and the manifest. Killed midway, a
    rerun moves what is left (a shard already in place is kept). A range not finished is an error naming it."""
    with RunLock(out):
        return _commit(Path(model), Path(prepared), Path(out), cfg, trust_remote_code)


def _commit(model: Path, prepared: Path, out: Path, cfg: ExtractConfig, trust_remote_code: bool) -> HiddenStates:
    n = cfg.workers
    target, fp = open_target(model, prepared, cfg, trust_remote_code)
    prev = previous_run(out, fp)
    if prev.done is not None:
        return prev.done
    ranges: list[HiddenRange] = []
    for k in range(n):
        rdir = range_dir(out, k, n)
        if not HiddenRange.exists(rdir) or HiddenRange.read(rdir).inputs != range_inputs(fp, k, n):
            raise ValueError(f"{rdir}: extract range {k} of {n} is not finished for these inputs; run it first "
                             f"(`eagle3 extract ... --workers {n} --part {k}`)")
        ranges.append(HiddenRange.read(rdir))
    open_out(out)
    known: dict[str, str] = {}
    for r in ranges:
        rdir = range_dir(out, r.part, n)
        for s in r.shards:
            src, dst = rdir / s.file, out / s.file
            if src.exists():
                os.replace(src, dst)  # same filesystem: a rename, so the shard's host stamp (sha256) moves too
            # The range's writer hashed the shard; after a rename only its size and header are checked here (a
            # reader checks every shard's sha256 against the manifest before trusting its bytes).
            if (bad := shard_problem(dst)) is not None:
                raise ValueError(f"{bad}; rerun extract range {r.part} of {n}: it rebuilds only this shard")
            known[s.file] = s.sha256
    samples = read_samples(prepared, cfg, target)
    # checked: every shard as sound (just checked above), so that nothing is hashed again here
    run = plan_run(out, cfg, target, samples, Previous(known=known, checked=dict.fromkeys(known)), (), None)
    missing = [p.file for p in run.plans if p.file not in known]
    if missing:  # the ranges cut another plan (cannot happen for the same inputs): say so rather than guess
        raise ValueError(f"{out}: the ranges hold no shard {missing[:3]} of the plan; rerun every range")
    run.shard_sha = dict(known)
    drop_stale_shards(out, run.plans)
    index_sha = write_index(out, run.plans)
    tokens = sum(r.stats.get("tokens_computed", 0) for r in ranges)
    man = run.manifest(fp, model, index_sha, tokens, max(r.stats.get("seconds", 0.0) for r in ranges))
    man.backend = next((r.stats["backend"] for r in ranges if r.stats.get("backend")), man.backend)
    man.stats.update(ranges_stats(ranges))
    from eagle3.extract.check import merge

    man.stats["final_check"] = merge([r.stats.get("final_check") for r in ranges])
    man.write(out)
    shutil.rmtree(out / RANGES, ignore_errors=True)
    return man


def ranges_stats(ranges: Sequence[HiddenRange]) -> dict[str, Any]:
    """The committed store's run statistics over its ranges: totals, the slowest range's wall time, the
    ranges' tok/s added up (their rate while all run at once), and each range's own figures."""
    rates = [r.stats.get("tokens_per_second") or 0.0 for r in ranges]
    return {
        "workers": len(ranges),
        "samples_computed": sum(r.stats.get("samples_computed", 0) for r in ranges),
        "samples_reused": sum(r.stats.get("samples_reused", 0) for r in ranges),
        "shards_skipped": sum(r.stats.get("shards_skipped", 0) for r in ranges),
        "shards_written": sum(r.stats.get("shards_written", 0) for r in ranges),
        "tokens_per_second": round(sum(rates), 1) or None,
        "ranges": [{"part": r.part, "shards": len(r.shards), "tokens": r.num_tokens,
                    "shards_skipped": r.stats.get("shards_skipped"),
                    "tokens_computed": r.stats.get("tokens_computed"), "seconds": r.stats.get("seconds"),
                    "tokens_per_second": r.stats.get("tokens_per_second")} for r in ranges],
    }


def extract_in_ranges(model: str | Path, prepared: str | Path, out: str | Path, cfg: ExtractConfig, *,
                      reuse: Sequence[str | Path] = (), progress: Progress | None = None, show_progress: bool = True,
                      backend: Backend | None = None, trust_remote_code: bool = False) -> HiddenStates:
    """Every range of cfg.workers here, one after another (each resumable alone), then the commit: the store a
    pipeline gets by running the ranges on several workers at once."""
    with RunLock(out):  # the whole store is this process's: no other run may commit it meanwhile
        fp = inputs(model, prepared, cfg, trust_remote_code)
        if (prev := previous_run(Path(out), fp)).done is not None:
            return prev.done
        for k in range(cfg.workers):
            run_range(model, prepared, out, cfg, k, reuse=reuse, progress=progress, show_progress=show_progress,
                      backend=backend, trust_remote_code=trust_remote_code)
        return _commit(Path(model), Path(prepared), Path(out), cfg, trust_remote_code)
