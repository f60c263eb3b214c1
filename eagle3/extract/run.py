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

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle3.config import ExtractConfig
from eagle3.model.target import Target
from eagle3.runtime.heap import retain_freed_memory
from eagle3.runtime.progress import Meter, silent
from eagle3.storage.atomic import atomic_path, clean_temp_files
from eagle3.storage.hashing import sha256_file, sha256_file_cached
from eagle3.storage.lock import RunLock
from eagle3.storage.manifests import HiddenRange, HiddenShardInfo, HiddenStates, PreparedData
from eagle3.storage.store import (
    FORMAT_VERSION,
    INDEX_FILE,
    SHARD_DIR,
    HiddenStateStore,
    ShardPlan,
    ShardWriter,
    bytes_per_token,
    plan_key,
    shard_meta,
    shard_problem,
)

Progress = Callable[[int, int], None]  # (tokens done, tokens to do) of this run


class Backend(Protocol):
    name: str

    def extract(self, samples, on_tokens=None):  # -> Iterator[(sample_id, token_ids [T], hidden [T, L, H])]
        ...


# ---------------------------------------------------------------- prepared samples
@dataclass
class Samples:
    """All prepared samples of the chosen splits, in manifest order (split, shard file, row)."""

    split: list[str]
    sample_id: list[str]
    input_ids: list[Any]  # pyarrow list scalars, materialized per shard
    loss_mask: list[Any]
    length: list[int]

    def tensors(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(self.input_ids[row].values.to_numpy(zero_copy_only=False), dtype=torch.int64)
        mask = torch.tensor(self.loss_mask[row].values.to_numpy(zero_copy_only=False), dtype=torch.int8)
        return ids, mask


def load_samples(prepared_dir: str | Path, prep: PreparedData, splits: Sequence[str],
                 rows: int | None = None) -> Samples:
    """The prepared samples of `splits`, each shard checked against its checksum, each sample's ids against its
    mask and, given the target's embedding `rows`, every id against them: an id the target has no row for
    would fail deep in its forward pass (or read another row on an engine), so it is refused here, by record."""
    import pyarrow.compute as pc

    from eagle3.storage.shards import read_shard

    s = Samples([], [], [], [], [])
    for split in splits:
        if split not in prep.splits:
            continue  # e.g. no val split in a tiny dataset
        for info in prep.splits[split]:
            path = Path(prepared_dir) / info.file
            t = read_shard(prepared_dir, info, columns=["sample_id", "input_ids", "loss_mask"])
            n_ids = pc.list_value_length(t["input_ids"]).to_pylist()
            n_mask = pc.list_value_length(t["loss_mask"]).to_pylist()
            sids = t["sample_id"].to_pylist()
            for sid, a, b in zip(sids, n_ids, n_mask, strict=True):
                if not a or a != b:
                    raise ValueError(f"{path}: sample {sid}: {a} input ids but {b} loss-mask values")
            if rows is not None and t.num_rows:
                lo, hi = pc.min_max(pc.list_flatten(t["input_ids"])).values()
                if lo.as_py() < 0 or hi.as_py() >= rows:
                    bad = next(i for i, ids in enumerate(t["input_ids"].to_pylist())
                               if min(ids) < 0 or max(ids) >= rows)
                    ids = t["input_ids"][bad].as_py()
                    tok = next(x for x in ids if x < 0 or x >= rows)
                    raise ValueError(f"{path}: sample {sids[bad]}: token id {tok} is outside the target's {rows} "
                                     "embedding rows (prepared with another tokenizer or model?)")
            s.split += [split] * t.num_rows
            s.sample_id += sids
            s.input_ids += list(t["input_ids"])
            s.loss_mask += list(t["loss_mask"])
            s.length += n_ids
    if not s.sample_id:
        raise ValueError(f"{prepared_dir}: no samples in splits {list(splits)}")
    return s


def plan_shards(s: Samples, tok_bytes: int, shard_bytes: int, common: dict[str, Any]) -> list[ShardPlan]:
    """Cut each split, in order, into shards of about `shard_bytes` (at least one sample each)."""
    plans: list[ShardPlan] = []
    idx: dict[str, int] = {}
    cur: ShardPlan | None = None
    for row, (split, sid, n) in enumerate(zip(s.split, s.sample_id, s.length, strict=True)):
        if cur is None or cur.split != split or (cur.rows and (cur.num_tokens + n) * tok_bytes > shard_bytes):
            cur = ShardPlan(split, idx.get(split, 0), [], [], [])
            idx[split] = cur.index + 1
            plans.append(cur)
        cur.rows.append(row)
        cur.sample_ids.append(sid)
        cur.lengths.append(n)
    for p in plans:
        p.key = plan_key(common, p.sample_ids)
    return plans


# ---------------------------------------------------------------- reuse
def _open_reuse(dirs: Sequence[str | Path], out: Path, common: dict[str, Any]) -> list[HiddenStateStore]:
    stores = []
    for d in dirs:
        d = Path(d)
        if d.resolve() == out.resolve():
            raise ValueError(f"--reuse {d}: cannot reuse the output dir itself (its shards are being rewritten)")
        st = HiddenStateStore(d)
        m = st.manifest
        theirs = {"model": m.model_fingerprint, "layer_ids": m.layer_ids, "storage": m.storage}
        ours = {k: common[k] for k in theirs}
        if theirs != ours:
            print(f"eagle3 extract: not reusing {d}: it differs in {[k for k in ours if ours[k] != theirs[k]]}",
                  file=sys.stderr)
            continue
        stores.append(st)
    return stores


def disk_preflight(out: Path, todo: list[ShardPlan], n_aux: int, hidden: int, storage: str) -> None:
    """Refuse, before the target is loaded, to start writing shards that cannot fit under `out`.

    A shard is written whole, reused samples included: every uncommitted shard's tokens x bytes per
    token, plus its header (~100 bytes per sample id), plus 1% and 1 MiB of slack."""
    from eagle3.storage.space import PreflightError, disk_free, human

    tokens = sum(p.num_tokens for p in todo)
    need = int((tokens * bytes_per_token(n_aux, hidden, storage) + 100 * sum(len(p.sample_ids) for p in todo))
               * 1.01) + (1 << 20)
    free = disk_free(out)
    if todo and need > free:
        fp8 = bytes_per_token(n_aux, hidden, "fp8") / bytes_per_token(n_aux, hidden, storage)
        raise PreflightError(
            f"{out}: not enough disk to extract: {len(todo)} shard(s) of {tokens:,} tokens at "
            f"{bytes_per_token(n_aux, hidden, storage):,} bytes/token ({storage}) need about {human(need)}, "
            f"{human(free)} is free there; free some space, or use --storage fp8 (~{fp8:.0%} of this) or fp8-aux, "
            f"fewer samples (prepare --limit / --max-len), or another --out")


# ---------------------------------------------------------------- the stage
def inputs(model: str | Path, prepared: str | Path, cfg: ExtractConfig,
           trust_remote_code: bool = False, target: Target | None = None) -> dict[str, Any]:
    """What the stored states depend on: the prepared data's and the target's content, the layer ids, the
    storage and the shard plan's settings (backend, batch and parallelism settings change speed, not bytes).
    The stage's "already done" check and the Prefect task's cache key are both this dict. `target`: `model`
    already open."""
    target = target or Target.open(model, trust_remote_code)
    return {
        "format": FORMAT_VERSION,
        "prepared": PreparedData.read(prepared).fingerprint,
        "model": target.fingerprint(),
        "layer_ids": target.layer_ids(cfg.aux_layer_ids),
        "storage": cfg.storage,
        "splits": cfg.splits,
        "shard_bytes": cfg.shard_bytes,
    }


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
        with RunLock(out):  # the whole store is this process's: no other run may commit it meanwhile
            fp = inputs(model, prepared, cfg, trust_remote_code)
            if (prev := previous_run(Path(out), fp)).done is not None:
                return prev.done
            for k in range(cfg.workers):
                run_range(model, prepared, out, cfg, k, reuse=reuse, progress=progress, show_progress=show_progress,
                          backend=backend, trust_remote_code=trust_remote_code)
            return _commit(Path(model), Path(prepared), Path(out), cfg, trust_remote_code)
    with RunLock(out):
        return _extract_whole(Path(model), Path(prepared), Path(out), cfg, reuse, progress, show_progress, backend,
                              trust_remote_code)


def _extract_whole(model: Path, prepared: Path, out: Path, cfg: ExtractConfig, reuse: Sequence[str | Path],
                   progress: Progress | None, show_progress: bool, backend: Backend | None,
                   trust_remote_code: bool) -> HiddenStates:
    """One worker: every shard of the plan, straight into `out`, then the index and the manifest."""
    retain_freed_memory()  # batch after batch of the same large buffers: reuse them in place
    target, fp = _open(model, prepared, cfg, trust_remote_code)
    prev = previous_run(out, fp)
    if prev.done is not None:
        return prev.done
    run, tokens, seconds = _compute(out, prepared, cfg, target, prev, reuse, backend, progress, show_progress)
    index_sha = _write_index(out, run.plans)
    man = run.manifest(fp, model, index_sha, tokens, seconds)
    man.write(out)
    return man


def _open(model: Path, prepared: Path, cfg: ExtractConfig, trust_remote_code: bool) -> tuple[Target, dict[str, Any]]:
    """The target, opened once, and the stage's `inputs` (the "already done" check) read from it."""
    target = Target.open(model, trust_remote_code)
    return target, inputs(model, prepared, cfg, trust_remote_code, target)


def _compute(out: Path, prepared: Path, cfg: ExtractConfig, target: Target, prev: "Previous",
             reuse: Sequence[str | Path], backend: Backend | None, progress: Progress | None, show_progress: bool,
             part: tuple[int, int] | None = None) -> tuple["ExtractRun", int, float]:
    """The computing part of the whole store's and a range's run, into `out` (the store or the range's dir): the
    samples read and checked, the shard plan (of range `part`), every shard not committed yet written, the shards
    of an older plan dropped. Returns (the run, tokens computed, seconds)."""
    open_out(out)
    run = plan_run(out, cfg, target, _samples(prepared, cfg, target), prev, reuse, backend, part=part)
    tokens, seconds = _fill(run, cfg, progress, show_progress)
    drop_stale_shards(out, run.plans)
    return run, tokens, seconds


def _samples(prepared: Path, cfg: ExtractConfig, target: Target) -> Samples:
    samples = load_samples(prepared, PreparedData.read(prepared), cfg.splits, target.vocab_rows)
    if cfg.backend == "vllm":
        check_engine_length(samples, target.max_position_embeddings)
    return samples


def _fill(run: "ExtractRun", cfg: ExtractConfig, progress: Progress | None,
          show_progress: bool) -> tuple[int, float]:
    """Write every shard of `run` not committed yet (after checking the disk can hold them); close the backend.
    Returns (tokens computed, seconds). The backends call `on_tokens(k)` after each batch: the meter moves (a
    bar on a terminal, else a line every 20 s; silent without `show_progress`, where the caller's `progress`,
    called as (tokens done, tokens to do), reports instead)."""
    disk_preflight(run.out, run.todo_shards(), run.n_aux, run.hidden, cfg.storage)
    todo = run.todo_tokens()
    meter = Meter("extract", todo, "tokens", say=None if show_progress else silent, bar=show_progress)
    done = 0

    def on_tokens(k: int) -> None:
        nonlocal done
        done += k
        meter.update(done)
        if progress is not None:
            progress(done, todo)

    t0 = time.perf_counter()
    try:
        for p in run.plans:
            run.fill_shard(p, on_tokens)
        if run.final_check is None and run.plans:
            run.check_final(run.plans[0])  # nothing computed here (an earlier run wrote every shard)
    finally:
        meter.close()
        close = getattr(run.backend, "close", None)
        if close is not None:
            close()
    return done, time.perf_counter() - t0


# ---------------------------------------------------------------- several workers: ranges, then one commit
RANGES = "ranges"


def range_dir(out: str | Path, k: int, n: int) -> Path:
    """Where range k of n is extracted before the commit moves its shards into `out/shards/`."""
    return Path(out) / RANGES / f"{k:03d}-of-{n:03d}"


def split_plans(plans: Sequence[ShardPlan], n: int) -> list[list[ShardPlan]]:
    """The shard plan cut into n contiguous ranges of about equal tokens: a shard goes to the range its middle
    token falls in (integer arithmetic, so every host cuts the same ranges). A range may be empty when there
    are fewer shards than ranges."""
    total = sum(p.num_tokens for p in plans)
    out: list[list[ShardPlan]] = [[] for _ in range(n)]
    before = 0
    for p in plans:
        out[min(n - 1, (2 * before + p.num_tokens) * n // (2 * max(total, 1)))].append(p)
        before += p.num_tokens
    return out


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
        target, fp = _open(model, prepared, cfg, trust_remote_code)
        want = range_inputs(fp, k, n)
        if (done := _range_done(out, rdir, want)) is not None:
            return done
        run, tokens, seconds = _compute(rdir, prepared, cfg, target, Previous(), reuse, backend, progress,
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
    target, fp = _open(model, prepared, cfg, trust_remote_code)
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
    samples = _samples(prepared, cfg, target)
    # checked: every shard as sound (just checked above), so that nothing is hashed again here
    run = plan_run(out, cfg, target, samples, Previous(known=known, checked=dict.fromkeys(known)), (), None)
    missing = [p.file for p in run.plans if p.file not in known]
    if missing:  # the ranges cut another plan (cannot happen for the same inputs): say so rather than guess
        raise ValueError(f"{out}: the ranges hold no shard {missing[:3]} of the plan; rerun every range")
    run.shard_sha = dict(known)
    drop_stale_shards(out, run.plans)
    index_sha = _write_index(out, run.plans)
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


@dataclass
class Previous:
    """What `out` holds from an earlier run of this stage."""

    done: HiddenStates | None = None  # a finished run of these exact inputs, every shard sound: the result
    known: dict[str, str] = field(default_factory=dict)  # shard file -> sha256 a finished run recorded
    # shard file -> its problem (None: sound), for the shards `previous_run` hashed
    checked: dict[str, str | None] = field(default_factory=dict)


def previous_run(out: Path, fp: dict[str, Any]) -> Previous:
    """Read `out`'s manifest, if any. A finished run of inputs `fp` whose shards all hash to the recorded
    sha256s is returned as `done`; otherwise the manifest is removed (out is about to change: it is no
    longer a finished stage), and the recorded sha256s are kept to check committed shards against."""
    prev = Previous()
    if HiddenStates.exists(out):
        done = HiddenStates.read(out)
        prev.known = {s.file: s.sha256 for s in done.shards}
        if done.inputs == fp:
            prev.checked = {s.file: shard_problem(out / s.file, s.sha256) for s in done.shards}
            if not any(prev.checked.values()):
                prev.done = done
                return prev
        (out / "manifest.json").unlink()  # out is about to change: it is no longer a finished stage
    return prev


def open_out(out: Path) -> None:
    """Create `out/shards` and remove the temp files a killed run left there (their renames never happened)."""
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    clean_temp_files(out)
    clean_temp_files(out / SHARD_DIR)


@dataclass
class ExtractRun:
    """One extraction's shard plan, what is already done, and what this run wrote so far (`plan_run` builds it;
    `fill_shard` fills it in shard by shard)."""

    out: Path
    cfg: ExtractConfig
    target: Target
    layer_ids: list[int]  # the aux layers' ids, then the last layer's
    model_fp: str
    samples: Samples
    plans: list[ShardPlan]
    known: dict[str, str]  # shard file -> sha256 a finished run recorded
    committed: set[str]  # shard files already on disk with their plan's key, whole: kept as they are
    reusable: dict[str, tuple[HiddenStateStore, int]]  # sample id -> (a reuse dir's store, its row there)
    backend: Backend | None  # built by the first shard with a sample to compute, unless the caller gave one
    shard_sha: dict[str, str] = field(default_factory=dict)  # shard file -> its sha256, for every shard done
    n_reused: int = 0
    n_computed: int = 0
    final_check: dict[str, Any] | None = None  # eagle3.extract.check's result, once run

    @property
    def n_aux(self) -> int:
        return len(self.layer_ids) - 1

    @property
    def hidden(self) -> int:
        return self.target.hidden_size

    def todo_shards(self) -> list[ShardPlan]:
        return [p for p in self.plans if p.file not in self.committed]

    def todo_tokens(self) -> int:
        """Tokens the backend will compute: those of the uncommitted shards' samples that no reuse dir holds
        (a sample twice in one shard is computed once)."""
        return sum(
            n_tok
            for p in self.todo_shards()
            for sid, n_tok in dict(zip(p.sample_ids, p.lengths, strict=True)).items() if sid not in self.reusable
        )

    def fill_shard(self, p: ShardPlan, on_tokens: Callable[[int], None]) -> None:
        """Record the sha256 of shard `p`: a committed one as it is, else after writing it (temp file, then
        rename: `ShardWriter.write`) from its reused and newly computed samples."""
        if p.file in self.committed:
            # a known one was just checked
            self.shard_sha[p.file] = self.known.get(p.file) or sha256_file_cached(self.out / p.file)
            return
        w = ShardWriter(p, self.n_aux, self.hidden, self.cfg.storage)
        todo = self.add_reused(p, w)
        if todo:
            self.compute(p, w, todo, on_tokens)
        self.shard_sha[p.file] = w.write(self.out)
        if todo and self.final_check is None:
            self.check_final(p)  # on the first shard this run computes: a wrong layer stops the run at once

    def check_final(self, p: ShardPlan) -> None:
        """The final-layer check (eagle3.extract.check) on a few samples of shard `p`, which is on disk: its
        result goes into the manifest; a refused store loses every shard of its plan on disk (all were computed
        the same way), and the run stops with the layer named."""
        from eagle3.extract import check

        if self.backend is None:  # every shard was committed by an earlier run: check one of them
            self.backend = make_backend(self.cfg, self.target, self.layer_ids, self.out, max(self.samples.length))
        self.final_check = check.on_shard(self.backend, self.target, self.out / p.file, p.sample_ids, p.lengths,
                                          lambda i: self.samples.tensors(p.rows[i])[0], self.layer_ids[-1],
                                          self.cfg.storage)
        if self.final_check["passed"] is False:
            for q in self.plans:
                (self.out / q.file).unlink(missing_ok=True)
            check.refuse(self.final_check, str(self.out))

    def add_reused(self, p: ShardPlan, w: ShardWriter) -> list[int]:
        """Copy into `w` the samples of `p` a reuse dir holds, as stored; return the rows left to compute,
        each distinct sample id once."""
        todo = []
        seen: set[str] = set()
        for row, sid in zip(p.rows, p.sample_ids, strict=True):
            if sid in seen:
                continue  # the same content twice: compute it once, store it twice
            seen.add(sid)
            if sid in self.reusable:
                st, i = self.reusable[sid]
                w.add_stored(sid, st.raw(i))
                self.n_reused += 1
            else:
                todo.append(row)
        return todo

    def compute(self, p: ShardPlan, w: ShardWriter, todo: list[int], on_tokens: Callable[[int], None]) -> None:
        """Run the backend (built here on first use) over prepared rows `todo` and add each result to `w`:
        token ids [T], hidden [T, L, H] per sample, checked against the sample's own ids and mask."""
        if self.backend is None:
            self.backend = make_backend(self.cfg, self.target, self.layer_ids, self.out, max(self.samples.length))
        batch = []
        for row in todo:
            ids, _ = self.samples.tensors(row)
            batch.append((self.samples.sample_id[row], ids))
        rows_by_id = {self.samples.sample_id[r]: r for r in todo}
        # closing(): on a bad sample the backend's generator cleans up at once (vLLM files)
        with contextlib.closing(self.backend.extract(batch, on_tokens=on_tokens)) as results:
            for sid, tok, h in results:
                if sid not in rows_by_id:
                    raise ValueError(f"shard {p.file}: backend returned unknown sample {sid}")
                ids, mask = self.samples.tensors(rows_by_id[sid])
                w.add(sid, ids, mask, tok, h)
                self.n_computed += 1

    def manifest(self, fp: dict[str, Any], model: Path, index_sha: str, tokens_computed: int,
                 seconds: float) -> HiddenStates:
        """The stage's manifest once every planned shard is on disk (`shard_sha` full), with this run's stats."""
        out, cfg, hidden = self.out, self.cfg, self.hidden
        shards = [
            HiddenShardInfo(
                file=p.file, sha256=self.shard_sha[p.file], split=p.split, num_samples=len(p.rows),
                num_tokens=p.num_tokens, num_bytes=(out / p.file).stat().st_size,
            )
            for p in self.plans
        ]
        splits: dict[str, dict[str, int]] = {}
        for s in shards:
            acc = splits.setdefault(s.split, {"num_samples": 0, "num_tokens": 0})
            acc["num_samples"] += s.num_samples
            acc["num_tokens"] += s.num_tokens
        num_tokens = sum(s.num_tokens for s in shards)
        num_bytes = sum(s.num_bytes for s in shards)
        backend = self.backend
        return HiddenStates(
            config=cfg.model_dump(mode="json"),
            inputs=fp,
            model_dir=str(model),
            model_fingerprint=self.model_fp,
            backend=getattr(backend, "name", cfg.backend) if backend is not None else cfg.backend,
            num_hidden_layers=self.target.num_layers,
            hidden_size=hidden,
            aux_layer_ids=self.layer_ids[:-1],
            layer_ids=self.layer_ids,
            storage=cfg.storage,
            index_file=INDEX_FILE,
            index_sha256=index_sha,
            shards=shards,
            splits=splits,
            num_samples=sum(s.num_samples for s in shards),
            num_tokens=num_tokens,
            num_bytes=num_bytes,
            stats={
                "tokens_computed": tokens_computed,
                "seconds": round(seconds, 3),
                "tokens_per_second": round(tokens_computed / seconds, 1) if tokens_computed and seconds > 0 else None,
                "bytes_per_token": round(num_bytes / num_tokens, 3),
                "bytes_ratio": round(num_bytes / num_tokens / (4 * hidden * 2), 4),
                "samples_computed": self.n_computed,
                "samples_reused": self.n_reused,
                "shards_skipped": len(self.committed),
                "shards_written": len(self.plans) - len(self.committed),
                "final_check": self.final_check,
            },
        )


def plan_run(out: Path, cfg: ExtractConfig, target: Target, samples: Samples, prev: Previous,
             reuse: Sequence[str | Path], backend: Backend | None, part: tuple[int, int] | None = None) -> ExtractRun:
    """Plan the shards of `samples` (only range k of n of them for `part` = (k, n)), and find which are already
    committed in `out` and which samples the `reuse` dirs hold (a reuse dir of another model, layer ids or
    storage is named and skipped)."""
    layer_ids = target.layer_ids(cfg.aux_layer_ids)
    model_fp = target.fingerprint()
    # A shard's bytes depend on these and on its sample ids (content hashes) only -- not on the
    # prepared manifest as a whole, so an in-place rerun on grown data keeps unchanged shards.
    common = {
        "format_version": FORMAT_VERSION,
        "model": model_fp,
        "layer_ids": layer_ids,
        "storage": cfg.storage,
    }
    tok_bytes = bytes_per_token(len(layer_ids) - 1, target.hidden_size, cfg.storage)
    plans = plan_shards(samples, tok_bytes, cfg.shard_bytes, common)
    if part is not None:
        plans = split_plans(plans, part[1])[part[0]]
    committed = committed_shards(out, plans, prev)
    reusable: dict[str, tuple[HiddenStateStore, int]] = {}
    for st in _open_reuse(reuse, out, common):
        for i, sid in enumerate(st.sample_ids):
            reusable.setdefault(sid, (st, i))
    return ExtractRun(out, cfg, target, layer_ids, model_fp, samples, plans, prev.known, committed, reusable, backend)


def committed_shards(out: Path, plans: list[ShardPlan], prev: Previous) -> set[str]:
    """The planned shard files already committed in `out`."""
    # Which shards are already committed (same plan key, whole, and the bytes a finished run recorded,
    # when one did). A damaged shard is named and recomputed.
    committed = set()
    for p in plans:
        if (m := shard_meta(out / p.file)) is None or m.get("key") != p.key:
            continue
        bad = prev.checked[p.file] if p.file in prev.checked else shard_problem(out / p.file, prev.known.get(p.file))
        if bad:
            print(f"eagle3 extract: {bad}; rebuilding it", file=sys.stderr)
        else:
            committed.add(p.file)
    return committed


def drop_stale_shards(out: Path, plans: list[ShardPlan]) -> None:
    """Drop shards of an older plan (a different config or input) that this plan does not name."""
    planned = {p.file for p in plans}
    for f in (out / SHARD_DIR).glob("*.safetensors"):
        if f"{SHARD_DIR}/{f.name}" not in planned:
            f.unlink()


def _write_index(out: Path, plans: list[ShardPlan]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols: dict[str, list] = {"sample_id": [], "split": [], "shard": [], "offset": [], "length": []}
    for k, p in enumerate(plans):
        off = 0
        for sid, n in zip(p.sample_ids, p.lengths, strict=True):
            cols["sample_id"].append(sid)
            cols["split"].append(p.split)
            cols["shard"].append(k)
            cols["offset"].append(off)
            cols["length"].append(n)
            off += n
    schema = pa.schema([("sample_id", pa.string()), ("split", pa.string()), ("shard", pa.int32()),
                        ("offset", pa.int64()), ("length", pa.int32())])
    with atomic_path(out / INDEX_FILE) as tmp:
        pq.write_table(pa.table(cols, schema=schema), tmp)
    return sha256_file(out / INDEX_FILE)


def check_engine_length(samples: Samples, limit: int) -> None:
    """vLLM refuses a prompt (and an engine whose max_model_len is) past the model's context: say so up
    front, naming the samples, instead of failing after the engine started. +1: the one sampled token."""
    over = [(sid, n) for sid, n in zip(samples.sample_id, samples.length, strict=True) if n + 1 > limit]
    if over:
        named = (", ".join(f"{sid} ({n} tokens)" for sid, n in over[:5])
                 + (f" and {len(over) - 5} more" if len(over) > 5 else ""))
        raise ValueError(
            f"extract --backend vllm: {len(over)} sample(s) longer than the engine allows "
            f"(max_position_embeddings {limit}, one position kept for the sampled token): {named}; "
            "prepare with a smaller max_len"
        )


# One backend built at a time per process. Ranges (and online producers) may run as threads of one process, and
# transformers' loading swaps process-wide hooks while it builds a model on the meta device: two loads interleaving
# can leave them swapped, and every model built after that in the process has meta weights (seen in the tests).
_BUILD = threading.Lock()


def make_backend(cfg: ExtractConfig, target: Target, layer_ids: list[int], out: Path, max_len: int) -> Backend:
    """Build the backend `cfg.backend` names (heavy: loads the model), one at a time in a process."""
    with _BUILD:
        return _make_backend(cfg, target, layer_ids, out, max_len)


def _make_backend(cfg: ExtractConfig, target: Target, layer_ids: list[int], out: Path, max_len: int) -> Backend:
    if cfg.backend == "hf":
        from eagle3.extract.hf import HFBackend

        return HFBackend(target.load_model(head=False), layer_ids, cfg.batch_tokens)
    from eagle3.extract.vllm import VllmBackend

    return VllmBackend(target.path, layer_ids, cfg, max_len=max_len, tmp_dir=out / ".vllm-hidden-states",
                       trust_remote_code=target.trust_remote_code)
