"""Stage 2 driver: plan shards over the prepared samples, fill each one from a backend, commit it.

Resume is by construction: the shard plan is a pure function of the prepared manifest and the
config, a shard is written atomically (temp file + rename) and carries its plan key in its
metadata, so a rerun skips every committed shard whose key matches and recomputes the rest.
Each shard is computed from its own samples only (its batches never depend on what was done
before), so a resumed run writes the same bytes as an uninterrupted one.

Incremental runs: samples an earlier extract dir (`reuse=`) already holds -- same sample_id (a
content hash of ids + mask), same model fingerprint, layer ids and storage -- are copied from it
as stored, so a dataset that grew by 5% costs about 5% of a full extraction.
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle3.config import ExtractConfig
from eagle3.model.target import Target
from eagle3.runtime.heap import retain_freed_memory
from eagle3.storage.atomic import atomic_path, clean_temp_files
from eagle3.storage.hashing import sha256_file, sha256_file_cached
from eagle3.storage.manifests import HiddenShardInfo, HiddenStates, PreparedData
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


def load_samples(prepared_dir: str | Path, prep: PreparedData, splits: Sequence[str]) -> Samples:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    s = Samples([], [], [], [], [])
    for split in splits:
        if split not in prep.splits:
            continue  # e.g. no val split in a tiny dataset
        for info in prep.splits[split]:
            path = Path(prepared_dir) / info.file
            if not path.is_file():
                raise ValueError(f"{path}: prepared shard listed in the manifest is missing")
            if sha256_file_cached(path) != info.sha256:
                raise ValueError(f"{path}: sha256 does not match the prepare manifest (corrupt or replaced)")
            t = pq.read_table(path, columns=["sample_id", "input_ids", "loss_mask"])
            n_ids = pc.list_value_length(t["input_ids"]).to_pylist()
            n_mask = pc.list_value_length(t["loss_mask"]).to_pylist()
            sids = t["sample_id"].to_pylist()
            for sid, a, b in zip(sids, n_ids, n_mask, strict=True):
                if not a or a != b:
                    raise ValueError(f"{path}: sample {sid}: {a} input ids but {b} loss-mask values")
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
    from eagle3.preflight import PreflightError, disk_free, human

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
           trust_remote_code: bool = False) -> dict[str, Any]:
    """What the stored states depend on: the prepared data's and the target's content, the layer ids, the
    storage and the shard plan's settings (backend, batch and parallelism settings change speed, not bytes).
    The stage's "already done" check and the Prefect task's cache key are both this dict."""
    target = Target.open(model, trust_remote_code)
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
    """
    cfg = cfg or ExtractConfig()
    retain_freed_memory()  # batch after batch of the same large buffers: reuse them in place
    model, prepared, out = Path(model), Path(prepared), Path(out)
    prep = PreparedData.read(prepared)
    target = Target.open(model, trust_remote_code)
    n, hidden = target.num_layers, target.hidden_size
    layer_ids = target.layer_ids(cfg.aux_layer_ids)
    n_aux = len(layer_ids) - 1
    model_fp = target.fingerprint()
    # A shard's bytes depend on these and on its sample ids (content hashes) only -- not on the
    # prepared manifest as a whole, so an in-place rerun on grown data keeps unchanged shards.
    common = {
        "format_version": FORMAT_VERSION,
        "model": model_fp,
        "layer_ids": layer_ids,
        "storage": cfg.storage,
    }
    fp = inputs(model, prepared, cfg, trust_remote_code)
    cfg_dump = cfg.model_dump(mode="json")

    known: dict[str, str] = {}  # shard file -> sha256 a finished run recorded
    checked: dict[str, str | None] = {}  # shard file -> its problem (None: sound), for shards hashed below
    if HiddenStates.exists(out):
        done = HiddenStates.read(out)
        known = {s.file: s.sha256 for s in done.shards}
        if done.inputs == fp:
            checked = {s.file: shard_problem(out / s.file, s.sha256) for s in done.shards}
            if not any(checked.values()):
                return done
        (out / "manifest.json").unlink()  # out is about to change: it is no longer a finished stage
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    clean_temp_files(out)
    clean_temp_files(out / SHARD_DIR)

    samples = load_samples(prepared, prep, cfg.splits)
    if cfg.backend == "vllm":
        check_engine_length(samples, target.max_position_embeddings)
    tok_bytes = bytes_per_token(n_aux, hidden, cfg.storage)
    plans = plan_shards(samples, tok_bytes, cfg.shard_bytes, common)

    # Which shards are already committed (same plan key, whole, and the bytes a finished run recorded,
    # when one did), which samples an earlier run has. A damaged shard is named and recomputed.
    committed = set()
    for p in plans:
        if (m := shard_meta(out / p.file)) is None or m.get("key") != p.key:
            continue
        bad = checked[p.file] if p.file in checked else shard_problem(out / p.file, known.get(p.file))
        if bad:
            print(f"eagle3 extract: {bad}; rebuilding it", file=sys.stderr)
        else:
            committed.add(p.file)
    stores = _open_reuse(reuse, out, common)
    reusable: dict[str, tuple[HiddenStateStore, int]] = {}
    for st in stores:
        for i, sid in enumerate(st.sample_ids):
            reusable.setdefault(sid, (st, i))
    todo_tokens = sum(
        n_tok
        for p in plans if p.file not in committed
        for sid, n_tok in dict(zip(p.sample_ids, p.lengths, strict=True)).items() if sid not in reusable
    )
    disk_preflight(out, [p for p in plans if p.file not in committed], n_aux, hidden, cfg.storage)

    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc="extract", dynamic_ncols=True)
    done_tokens = 0

    def on_tokens(k: int) -> None:
        nonlocal done_tokens
        done_tokens += k
        if bar is not None:
            bar.update(k)
        if progress is not None:
            progress(done_tokens, todo_tokens)

    t0 = time.perf_counter()
    shard_sha: dict[str, str] = {}
    n_reused = n_computed = 0
    try:
        for p in plans:
            if p.file in committed:
                # a known one was just checked
                shard_sha[p.file] = known.get(p.file) or sha256_file_cached(out / p.file)
                continue
            w = ShardWriter(p, n_aux, hidden, cfg.storage)
            todo = []
            seen: set[str] = set()
            for row, sid in zip(p.rows, p.sample_ids, strict=True):
                if sid in seen:
                    continue  # the same content twice: compute it once, store it twice
                seen.add(sid)
                if sid in reusable:
                    st, i = reusable[sid]
                    w.add_stored(sid, st.raw(i))
                    n_reused += 1
                else:
                    todo.append(row)
            if todo:
                if backend is None:
                    backend = make_backend(cfg, target, layer_ids, out, max(samples.length))
                batch = []
                for row in todo:
                    ids, _ = samples.tensors(row)
                    batch.append((samples.sample_id[row], ids))
                rows_by_id = {samples.sample_id[r]: r for r in todo}
                # closing(): on a bad sample the backend's generator cleans up at once (vLLM files)
                with contextlib.closing(backend.extract(batch, on_tokens=on_tokens)) as results:
                    for sid, tok, h in results:
                        if sid not in rows_by_id:
                            raise ValueError(f"shard {p.file}: backend returned unknown sample {sid}")
                        ids, mask = samples.tensors(rows_by_id[sid])
                        w.add(sid, ids, mask, tok, h)
                        n_computed += 1
            shard_sha[p.file] = w.write(out)
    finally:
        if bar is not None:
            bar.close()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    seconds = time.perf_counter() - t0

    # Drop shards of an older plan (a different config or input) that this plan does not name.
    planned = {p.file for p in plans}
    for f in (out / SHARD_DIR).glob("*.safetensors"):
        if f"{SHARD_DIR}/{f.name}" not in planned:
            f.unlink()

    index_sha = _write_index(out, plans)
    shards = [
        HiddenShardInfo(
            file=p.file, sha256=shard_sha[p.file], split=p.split, num_samples=len(p.rows),
            num_tokens=p.num_tokens, num_bytes=(out / p.file).stat().st_size,
        )
        for p in plans
    ]
    splits: dict[str, dict[str, int]] = {}
    for s in shards:
        acc = splits.setdefault(s.split, {"num_samples": 0, "num_tokens": 0})
        acc["num_samples"] += s.num_samples
        acc["num_tokens"] += s.num_tokens
    num_tokens = sum(s.num_tokens for s in shards)
    num_bytes = sum(s.num_bytes for s in shards)
    man = HiddenStates(
        config=cfg_dump,
        inputs=fp,
        model_dir=str(model),
        model_fingerprint=model_fp,
        backend=getattr(backend, "name", cfg.backend) if backend is not None else cfg.backend,
        num_hidden_layers=n,
        hidden_size=hidden,
        aux_layer_ids=layer_ids[:-1],
        layer_ids=layer_ids,
        storage=cfg.storage,
        index_file=INDEX_FILE,
        index_sha256=index_sha,
        shards=shards,
        splits=splits,
        num_samples=sum(s.num_samples for s in shards),
        num_tokens=num_tokens,
        num_bytes=num_bytes,
        stats={
            "tokens_computed": done_tokens,
            "seconds": round(seconds, 3),
            "tokens_per_second": round(done_tokens / seconds, 1) if done_tokens and seconds > 0 else None,
            "bytes_per_token": round(num_bytes / num_tokens, 3),
            "bytes_ratio": round(num_bytes / num_tokens / (4 * hidden * 2), 4),
            "samples_computed": n_computed,
            "samples_reused": n_reused,
            "shards_skipped": len(committed),
            "shards_written": len(plans) - len(committed),
        },
    )
    man.write(out)
    return man


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


def make_backend(cfg: ExtractConfig, target: Target, layer_ids: list[int], out: Path, max_len: int) -> Backend:
    """Build the backend `cfg.backend` names (heavy: loads the model)."""
    if cfg.backend == "hf":
        from eagle3.extract.hf import HFBackend

        return HFBackend(target.load_model(head=False), layer_ids, cfg.batch_tokens)
    from eagle3.extract.vllm import VllmBackend

    return VllmBackend(target.path, layer_ids, cfg, max_len=max_len, tmp_dir=out / ".vllm-hidden-states",
                       trust_remote_code=target.trust_remote_code)
