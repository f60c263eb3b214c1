"""The shard plan and its filling: which shards a run owes (a pure function of the prepared manifest and the
config), which are committed already (their plan keys match), the samples reused from earlier stores, the
disk check, each shard computed and written atomically, the index and the manifest. Shared by the whole
store's run (eagle3/extract/run.py) and a range's (eagle3/extract/ranges.py)."""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import ExtractConfig
from eagle3.extract.backend import Backend, compute_dtype, make_backend
from eagle3.extract.resume import Previous, committed_shards, drop_stale_shards, open_out
from eagle3.extract.samples import Samples, check_engine_length, load_samples
from eagle3.model.target import Target
from eagle3.runtime.progress import Meter, silent
from eagle3.storage.atomic import atomic_path
from eagle3.storage.hashing import sha256_file, sha256_file_cached
from eagle3.storage.manifests import HiddenShardInfo, HiddenStates, PreparedData
from eagle3.storage.store import (
    FORMAT_VERSION,
    INDEX_FILE,
    HiddenStateStore,
    ShardPlan,
    ShardWriter,
    bytes_per_token,
    plan_key,
)

Progress = Callable[[int, int], None]  # (tokens done, tokens to do) of this run


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
        theirs = {"model": m.model_fingerprint, "layer_ids": m.layer_ids, "storage": m.storage,
                  "dtype": m.inputs.get("dtype")}
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
def compute(out: Path, prepared: Path, cfg: ExtractConfig, target: Target, prev: "Previous",
             reuse: Sequence[str | Path], backend: Backend | None, progress: Progress | None, show_progress: bool,
             part: tuple[int, int] | None = None) -> tuple["ExtractRun", int, float]:
    """The computing part of the whole store's and a range's run, into `out` (the store or the range's dir): the
    samples read and checked, the shard plan (of range `part`), every shard not committed yet written, the shards
    of an older plan dropped. Returns (the run, tokens computed, seconds)."""
    open_out(out)
    run = plan_run(out, cfg, target, read_samples(prepared, cfg, target), prev, reuse, backend, part=part)
    tokens, seconds = fill(run, cfg, progress, show_progress)
    drop_stale_shards(out, run.plans)
    return run, tokens, seconds


def read_samples(prepared: Path, cfg: ExtractConfig, target: Target) -> Samples:
    samples = load_samples(prepared, PreparedData.read(prepared), cfg.splits, target.vocab_rows)
    if cfg.backend == "vllm":
        check_engine_length(samples, target.max_position_embeddings)
    return samples


def fill(run: "ExtractRun", cfg: ExtractConfig, progress: Progress | None,
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
    committed in `out` and which samples the `reuse` dirs hold (a reuse dir of another model, layer ids,
    storage or compute dtype is named and skipped)."""
    layer_ids = target.layer_ids(cfg.aux_layer_ids)
    model_fp = target.fingerprint()
    # A shard's bytes depend on these and on its sample ids (content hashes) only -- not on the
    # prepared manifest as a whole, so an in-place rerun on grown data keeps unchanged shards.
    common = {
        "format_version": FORMAT_VERSION,
        "model": model_fp,
        "layer_ids": layer_ids,
        "storage": cfg.storage,
        "dtype": compute_dtype(cfg),  # a shard computed in bf16 is not kept by a float32 rerun, nor reused by one
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


def write_index(out: Path, plans: list[ShardPlan]) -> str:
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
