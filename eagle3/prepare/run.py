"""`eagle3 prepare`: conversations -> loss-masked token ids in Parquet shards + the draft vocab map.

Streams the source once: read -> normalize -> dedup -> render -> tokenize (batched, fast
tokenizer) -> truncate -> split -> write. Shards are written atomically and the manifest is
written last, so its presence means the stage finished; a rerun with the same inputs and
config returns that manifest without redoing any work.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3.config import DEFAULT_DRAFT_VOCAB, PrepareConfig
from eagle3.data.normalize import Skip, normalize
from eagle3.data.readers import Bad, ReadStats, fingerprint_source, iter_source, resolve_source
from eagle3.data.template import ChatRenderer, Rendered, show
from eagle3.data.vocab import build_maps, load_maps, save_maps, select_draft_tokens
from eagle3.model.target import Target
from eagle3.storage.atomic import atomic_path, clean_temp_files
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import MANIFEST, PreparedData, ShardInfo, VocabMapInfo
from eagle3.storage.shards import SCHEMA, read_split

log = logging.getLogger("eagle3.prepare")

VOCAB_FILE = "vocab_map.safetensors"
_EXAMPLES = 3  # record ids kept per skip reason, for the report


def _vocab_path(src: str | Path) -> Path:
    p = Path(src)
    p = p / VOCAB_FILE if p.is_dir() else p
    if not p.is_file():
        raise ValueError(f"vocab_from: {p} does not exist")
    return p


def sample_id(ids: np.ndarray, mask: np.ndarray) -> str:
    """Content key of a sample: what later stages reuse work by."""
    return hashlib.sha256(ids.astype(np.int32).tobytes() + b"|" + mask.astype(np.int8).tobytes()).hexdigest()[:32]


def split_key(seed: int, sid: str) -> float:
    """Deterministic uniform [0, 1) per sample; stable as the dataset grows (nightly runs)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sid}".encode()).digest()[:8], "big") / 2**64


@dataclass
class _Shards:
    """Buffers one split and writes a Parquet shard each `size` samples."""

    out: Path
    split: str
    size: int
    rows: list[tuple[str, str, np.ndarray, np.ndarray]] = field(default_factory=list)
    infos: list[ShardInfo] = field(default_factory=list)

    def add(self, row) -> None:
        self.rows.append(row)
        if len(self.rows) >= self.size:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        name = f"{self.split}-{len(self.infos):05d}.parquet"
        ids = [r[2] for r in self.rows]
        masks = [r[3] for r in self.rows]
        offsets = pa.array(np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int32))
        table = pa.table(
            [
                pa.array([r[0] for r in self.rows], pa.string()),
                pa.array([r[1] for r in self.rows], pa.string()),
                pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(ids), pa.int32())),
                pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(masks), pa.int8())),
            ],
            schema=SCHEMA,
        )
        with atomic_path(self.out / name) as tmp:
            pq.write_table(table, tmp, compression="zstd")
            digest = sha256_file(tmp)
        self.infos.append(ShardInfo(
            file=name, sha256=digest, num_samples=len(self.rows),
            num_tokens=int(sum(len(x) for x in ids)), num_trainable_tokens=int(sum(int(m.sum()) for m in masks)),
        ))
        self.rows = []


def _progress(total: int | None, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="conv", desc="prepare", disable=not enabled, dynamic_ncols=True, mininterval=1.0)


def inputs(model: str | Path, cfg: PrepareConfig, trust_remote_code: bool = False) -> dict[str, Any]:
    """What the prepared data depends on: the source's, the tokenizer's and template's and a reused vocab
    map's content, and the settings (the source and vocab map by content, not path). The stage's "already
    done" check and the Prefect task's cache key are both this dict."""
    return {
        "source": fingerprint_source(resolve_source(cfg.data)),
        "tokenizer": Target.open(model, trust_remote_code).tokenizer_fingerprint(),
        "vocab_from": sha256_file(_vocab_path(cfg.vocab_from)) if cfg.vocab_from else None,
        "config": cfg.model_dump(mode="json", exclude={"data", "vocab_from"}),
    }


def prepare(
    model: str | Path,
    out: str | Path,
    cfg: PrepareConfig,
    progress: bool = True,
    on_sample: Callable[[str, np.ndarray, np.ndarray], None] | None = None,
    trust_remote_code: bool = False,
) -> PreparedData:
    """Run stage 1. Returns the manifest (also written to `out/manifest.json`)."""
    model, out = Path(model), Path(out)
    target = Target.open(model, trust_remote_code)
    src = resolve_source(cfg.data)
    fp = inputs(model, cfg, trust_remote_code)
    config = cfg.model_dump(mode="json")
    if (out / MANIFEST).is_file():
        try:
            done = PreparedData.read(out)
            if done.inputs == fp:
                log.info("prepare: %s already holds this exact result; nothing to do", out)
                return done
        except ValueError:
            pass
    tok = target.tokenizer()
    renderer = ChatRenderer(tok, name=f"the tokenizer of {model}")
    overhead = renderer.template_overhead()
    if cfg.max_len <= overhead:
        raise ValueError(
            f"--max-len {cfg.max_len} leaves no room for an answer: this chat template spends "
            f"{overhead} tokens before the first assistant token of a one-word exchange; use --max-len > {overhead}"
        )
    # The map is sized by the embedding's rows (vLLM's `vocab_size`), not by len(tok): Qwen3 pads
    # the embedding past the tokenizer, Kimi's tokenizer names two ids past the embedding.
    V = target.vocab_rows
    draft_vocab = cfg.draft_vocab or min(DEFAULT_DRAFT_VOCAB, V)
    if draft_vocab > V:
        raise ValueError(f"--draft-vocab {draft_vocab} exceeds the target vocab size {V} (embedding rows)")
    if cfg.vocab_from:  # checked before anything is written
        d2t, t2d = load_maps(_vocab_path(cfg.vocab_from))
        if len(t2d) != V:
            raise ValueError(f"{cfg.vocab_from}: vocab map is for a {len(t2d)}-row vocab, "
                             f"this target's embedding has {V}")

    # A stale manifest must never describe the shards we are about to overwrite.
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    clean_temp_files(out)
    for old in out.glob("*.parquet"):
        old.unlink()

    stats = ReadStats()
    skipped: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}
    seen: set[str] = set()
    shards = {s: _Shards(out, s, cfg.shard_samples) for s in ("train", "val")}
    counts = np.zeros(V, dtype=np.int64)  # loss-masked token frequencies, train split
    n_read = n_kept = n_tok = n_train_tok = 0
    last_train: tuple[float, tuple] | None = None  # smallest-key train sample still in the buffer

    def skip(rid: str, reason: str, detail: str = "") -> None:
        skipped[reason] += 1
        ex = examples.setdefault(reason, [])
        if len(ex) < _EXAMPLES:
            ex.append(f"{rid}: {detail}" if detail else rid)

    pending: list[tuple[str, Rendered]] = []
    bar = _progress(cfg.limit, progress)
    t0 = time.perf_counter()

    def flush_pending() -> None:
        nonlocal n_kept, n_tok, n_train_tok, last_train
        if not pending:
            return
        encoded = renderer.encode([r for _, r in pending], cfg.max_len)
        for (rid, _), (ids, mask) in zip(pending, encoded, strict=True):
            if not mask.any():
                skip(rid, "no_trainable_tokens", f"no assistant token within the first {cfg.max_len} tokens")
                continue
            if ids.max() >= V:  # a tokenizer id the embedding has no row for (e.g. a reserved special token)
                skip(rid, "token_beyond_embedding", f"token id {int(ids.max())} >= {V} embedding rows")
                continue
            sid = sample_id(ids, mask)
            key = split_key(cfg.seed, sid)
            split = "val" if key < cfg.val_fraction else "train"
            row = (sid, rid, ids, mask)
            shards[split].add(row)
            if on_sample is not None:
                on_sample(rid, ids, mask)
            if split == "train":
                np.add.at(counts, ids[mask == 1], 1)
                if last_train is None or key < last_train[0]:
                    last_train = (key, row)
                if not shards["train"].rows:  # buffer flushed: that sample is on disk now
                    last_train = None
            n_kept += 1
            n_tok += len(ids)
            n_train_tok += int(mask.sum())
        pending.clear()
        dt = max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix_str(f"{n_tok / dt:,.0f} tok/s, kept {n_kept}")

    try:
        for rec in iter_source(src, stats):
            if cfg.limit is not None and n_read >= cfg.limit:
                break
            n_read += 1
            bar.update(1)
            if isinstance(rec, Bad):
                skip(rec.record_id, rec.reason, rec.detail)
                continue
            try:
                msgs = normalize(rec.obj, cfg.same_role)
                key = hashlib.sha256(repr([(m["role"], m["content"]) for m in msgs]).encode()).hexdigest()
                if key in seen:
                    raise Skip("duplicate", "same conversation as an earlier record")
                seen.add(key)
                pending.append((rec.record_id, renderer.render(msgs)))
            except Skip as s:
                skip(rec.record_id, s.reason, s.detail)
                continue
            if len(pending) >= cfg.batch_size:
                flush_pending()
        flush_pending()
    except BaseException:
        # A source that fails midway (an unreadable file in a dir) leaves no half a stage behind.
        for sh in shards.values():
            for info in sh.infos:
                (out / info.file).unlink(missing_ok=True)
        raise
    finally:
        bar.close()  # before any error line, so the two never share a line

    # Guarantee a validation set: move the train sample with the smallest split key
    # (deterministic) if the hash split left val empty. Only a buffered sample can move.
    if not shards["val"].rows and not shards["val"].infos and cfg.min_val and n_kept >= 2 and last_train:
        row = last_train[1]
        shards["train"].rows = [r for r in shards["train"].rows if r is not row]
        shards["val"].add(row)
        np.add.at(counts, row[2][row[3] == 1], -1)
    for s in shards.values():
        s.flush()
    if n_kept == 0:
        raise ValueError(
            f"{cfg.data}: no usable conversation among {n_read} read; skipped: {dict(skipped)}; "
            f"examples: {examples}"
        )

    if cfg.vocab_from:
        target_ids = t2d.nonzero().flatten().numpy()
        draft_vocab = len(target_ids)
    else:
        target_ids = select_draft_tokens(counts, draft_vocab)
        d2t, t2d = build_maps(target_ids, V)
    save_maps(out / VOCAB_FILE, d2t, t2d)
    total = int(counts.sum())
    coverage = float(counts[target_ids].sum() / total) if total else 0.0

    m = PreparedData(
        config=config,
        inputs=fp,
        model_dir=str(model),
        tokenizer_fingerprint=fp["tokenizer"],
        source=str(src),
        source_fingerprint=fp["source"],
        splits={s: v.infos for s, v in shards.items()},
        records_read=n_read,
        records_kept=n_kept,
        skipped=dict(sorted(skipped.items())),
        skip_examples=examples,
        num_tokens=n_tok,
        num_trainable_tokens=n_train_tok,
        vocab_map=VocabMapInfo(
            sha256=sha256_file(out / VOCAB_FILE), draft_vocab_size=draft_vocab,
            target_vocab_size=V, coverage=coverage,
        ),
        unreadable_tail_bytes=stats.unreadable_tail_bytes,
    )
    m.write(out)
    dt = time.perf_counter() - t0
    log.info(
        "prepare: read %d, kept %d, skipped %s; %d tokens (%d trainable) in %.1fs = %.0f tok/s; "
        "draft vocab %d covers %.2f%% of trainable tokens",
        n_read, n_kept, dict(skipped), n_tok, n_train_tok, dt, n_tok / max(dt, 1e-9), draft_vocab, 100 * coverage,
    )
    for note in stats.notes:
        log.warning("prepare: %s", note)
    return m


def show_samples(model: str | Path, out: str | Path, n: int, trust_remote_code: bool = False,
                 color: bool = True) -> Iterator[str]:
    """The first `n` prepared train samples as text, each under a header line, their trainable (loss-masked)
    spans highlighted: what `eagle3 prepare --show N` prints."""
    tok = Target.open(model, trust_remote_code).tokenizer()
    for row in read_split(out, "train").slice(0, n).to_pylist():
        yield (f"\n===== record {row['record_id']} ({len(row['input_ids'])} tokens, "
               f"{sum(row['loss_mask'])} trainable) =====")
        yield show(tok, row["input_ids"], row["loss_mask"], color=color)
