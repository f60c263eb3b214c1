"""`eagle3 prepare`: conversations -> loss-masked token ids in Parquet shards + the draft vocab map.

Streams the source once: read -> normalize -> dedup -> render -> tokenize (batched, fast
tokenizer) -> truncate -> split -> write. Shards are written atomically and the manifest is
written last, so its presence means the stage finished; a rerun with the same inputs and
config returns that manifest without redoing any work.
"""
from __future__ import annotations

import hashlib
import logging
import tempfile
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
from eagle3.runtime.progress import Meter, silent
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


def _progress(total: int | None, enabled: bool) -> Meter:
    """Records read (of `total`, the limit, when there is one): a bar on a terminal, else a line every 20 s."""
    return Meter("prepare", total or 0, "records", say=None if enabled else silent, bar=enabled)


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


def _finished(out: Path, fp: dict[str, Any]) -> PreparedData | None:
    """The manifest in `out` if it was written for exactly these inputs (`fp`, see `inputs`), else None."""
    if (out / MANIFEST).is_file():
        try:
            done = PreparedData.read(out)
            if done.inputs == fp:
                return done
        except ValueError:
            pass
    return None


@dataclass
class _Setup:
    """What the stream needs from the target, all checked before anything is written."""

    renderer: ChatRenderer
    vocab_rows: int  # V: the target embedding's rows, the size of the frequency counts and the vocab map
    draft_vocab: int  # requested draft vocab size (a reused map brings its own)
    maps: tuple[Any, Any] | None  # (d2t, t2d) loaded from cfg.vocab_from, else None


def _check_target(model: Path, target: Target, cfg: PrepareConfig) -> _Setup:
    """Check the settings against the target (max_len vs the template's overhead, the draft vocab size,
    a reused vocab map's size) and return what the stream needs. Raises ValueError; writes nothing."""
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
    maps = None
    if cfg.vocab_from:  # checked before anything is written
        maps = load_maps(_vocab_path(cfg.vocab_from))
        if len(maps[1]) != V:
            raise ValueError(f"{cfg.vocab_from}: vocab map is for a {len(maps[1])}-row vocab, "
                             f"this target's embedding has {V}")
    return _Setup(renderer, V, draft_vocab, maps)


def _clear(out: Path) -> None:
    """Make `out` exist and hold no manifest, temp file or shard of an earlier run."""
    # A stale manifest must never describe the shards we are about to overwrite.
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    clean_temp_files(out)
    for old in out.glob("*.parquet"):
        old.unlink()


@dataclass
class _Stream:
    """The one pass over the source: records in, kept samples out to the split shards.

    Each record is read -> normalized -> deduplicated -> rendered into `pending`; every `cfg.batch_size`
    rendered records are tokenized in one batch and each kept sample (ids, mask: int arrays of one length)
    goes to the train or val `_Shards` by its split key. The counters end up in the manifest.
    """

    out: Path
    cfg: PrepareConfig
    setup: _Setup
    on_sample: Callable[[str, np.ndarray, np.ndarray], None] | None
    bar: Meter  # records read
    pace: str = ""  # tokens/s and samples kept so far, the meter's note
    t0: float = field(default_factory=time.perf_counter)
    stats: ReadStats = field(default_factory=ReadStats)
    skipped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)  # up to _EXAMPLES record ids per skip reason
    seen: set[str] = field(default_factory=set)  # content keys of the conversations kept so far
    pending: list[tuple[str, Rendered]] = field(default_factory=list)  # (record id, rendered), not yet tokenized
    shards: dict[str, _Shards] = field(init=False)
    counts: np.ndarray = field(init=False)  # [V] int64: loss-masked token frequencies, train split
    n_read: int = 0
    n_kept: int = 0
    n_tok: int = 0
    n_train_tok: int = 0
    last_train: tuple[float, tuple] | None = None  # smallest-key train sample still in the buffer

    def __post_init__(self) -> None:
        self.shards = {s: _Shards(self.out, s, self.cfg.shard_samples) for s in ("train", "val")}
        self.counts = np.zeros(self.setup.vocab_rows, dtype=np.int64)

    def skip(self, rid: str, reason: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < _EXAMPLES:
            ex.append(f"{rid}: {detail}" if detail else rid)

    def read(self, src: Path) -> None:
        """Stream up to cfg.limit records of `src` into the shards (the last one of each split still buffered).
        On any error the shards written so far are removed, then the error is raised."""
        try:
            for rec in iter_source(src, self.stats):
                if self.cfg.limit is not None and self.n_read >= self.cfg.limit:
                    break
                self.n_read += 1
                self.bar.update(self.n_read, self.pace)
                self.admit(rec)
                if len(self.pending) >= self.cfg.batch_size:
                    self.encode_pending()
            self.encode_pending()
        except BaseException:
            # A source that fails midway (an unreadable file in a dir) leaves no half a stage behind.
            for sh in self.shards.values():
                for info in sh.infos:
                    (self.out / info.file).unlink(missing_ok=True)
            raise
        finally:
            self.bar.close()  # before any error line, so the two never share a line

    def admit(self, rec) -> None:
        """Render one read record into `pending`, or count it as skipped (unreadable, invalid, duplicate)."""
        if isinstance(rec, Bad):
            self.skip(rec.record_id, rec.reason, rec.detail)
            return
        try:
            msgs = normalize(rec.obj, self.cfg.same_role)
            key = hashlib.sha256(repr([(m["role"], m["content"]) for m in msgs]).encode()).hexdigest()
            if key in self.seen:
                raise Skip("duplicate", "same conversation as an earlier record")
            self.seen.add(key)
            self.pending.append((rec.record_id, self.setup.renderer.render(msgs)))
        except Skip as s:
            self.skip(rec.record_id, s.reason, s.detail)

    def encode_pending(self) -> None:
        """Tokenize `pending` as one batch (truncated to cfg.max_len), keep each usable sample, empty `pending`."""
        if not self.pending:
            return
        encoded = self.setup.renderer.encode([r for _, r in self.pending], self.cfg.max_len)
        for (rid, _), (ids, mask) in zip(self.pending, encoded, strict=True):
            self.keep(rid, ids, mask)
        self.pending.clear()
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.pace = f"{self.n_tok / dt:,.0f} tok/s, kept {self.n_kept}"

    def keep(self, rid: str, ids: np.ndarray, mask: np.ndarray) -> None:
        """Add one tokenized sample to its split (by its split key), or skip it when it has nothing to train on
        or a token the embedding lacks. Train samples add their loss-masked ids to `counts`."""
        cfg, V = self.cfg, self.setup.vocab_rows
        if not mask.any():
            self.skip(rid, "no_trainable_tokens", f"no assistant token within the first {cfg.max_len} tokens")
            return
        if ids.max() >= V:  # a tokenizer id the embedding has no row for (e.g. a reserved special token)
            self.skip(rid, "token_beyond_embedding", f"token id {int(ids.max())} >= {V} embedding rows")
            return
        sid = sample_id(ids, mask)
        key = split_key(cfg.seed, sid)
        split = "val" if key < cfg.val_fraction else "train"
        row = (sid, rid, ids, mask)
        self.shards[split].add(row)
        if self.on_sample is not None:
            self.on_sample(rid, ids, mask)
        if split == "train":
            np.add.at(self.counts, ids[mask == 1], 1)
            if self.last_train is None or key < self.last_train[0]:
                self.last_train = (key, row)
            if not self.shards["train"].rows:  # buffer flushed: that sample is on disk now
                self.last_train = None
        self.n_kept += 1
        self.n_tok += len(ids)
        self.n_train_tok += int(mask.sum())

    def finish(self) -> None:
        """Write the buffered shards, after making sure val is not empty. Raises ValueError if nothing was kept."""
        shards, cfg = self.shards, self.cfg
        # Guarantee a validation set: move the train sample with the smallest split key
        # (deterministic) if the hash split left val empty. Only a buffered sample can move.
        if not shards["val"].rows and not shards["val"].infos and cfg.min_val and self.n_kept >= 2 \
                and self.last_train:
            row = self.last_train[1]
            shards["train"].rows = [r for r in shards["train"].rows if r is not row]
            shards["val"].add(row)
            np.add.at(self.counts, row[2][row[3] == 1], -1)
        for s in shards.values():
            s.flush()
        if self.n_kept == 0:
            raise ValueError(
                f"{cfg.data}: no usable conversation among {self.n_read} read; skipped: {dict(self.skipped)}; "
                f"examples: {self.examples}"
            )


def _write_vocab_map(out: Path, setup: _Setup, counts: np.ndarray) -> VocabMapInfo:
    """Write `out/vocab_map.safetensors`: the reused map, or one of the `setup.draft_vocab` most frequent
    trainable train tokens (`counts`: [V] frequencies). Returns its manifest entry with its coverage."""
    V = setup.vocab_rows
    if setup.maps is not None:
        d2t, t2d = setup.maps
        target_ids = t2d.nonzero().flatten().numpy()
        draft_vocab = len(target_ids)
    else:
        draft_vocab = setup.draft_vocab
        target_ids = select_draft_tokens(counts, draft_vocab)
        d2t, t2d = build_maps(target_ids, V)
    save_maps(out / VOCAB_FILE, d2t, t2d)
    total = int(counts.sum())
    coverage = float(counts[target_ids].sum() / total) if total else 0.0
    return VocabMapInfo(sha256=sha256_file(out / VOCAB_FILE), draft_vocab_size=draft_vocab,
                        target_vocab_size=V, coverage=coverage)


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
    done = _finished(out, fp)
    if done is not None:
        log.info("prepare: %s already holds this exact result; nothing to do", out)
        return done
    setup = _check_target(model, target, cfg)
    _clear(out)

    s = _Stream(out, cfg, setup, on_sample, bar=_progress(cfg.limit, progress))
    s.read(src)
    s.finish()
    vocab = _write_vocab_map(out, setup, s.counts)

    m = PreparedData(
        config=cfg.model_dump(mode="json"),
        inputs=fp,
        model_dir=str(model),
        tokenizer_fingerprint=fp["tokenizer"],
        source=str(src),
        source_fingerprint=fp["source"],
        splits={name: sh.infos for name, sh in s.shards.items()},
        records_read=s.n_read,
        records_kept=s.n_kept,
        skipped=dict(sorted(s.skipped.items())),
        skip_examples=s.examples,
        num_tokens=s.n_tok,
        num_trainable_tokens=s.n_train_tok,
        vocab_map=vocab,
        unreadable_tail_bytes=s.stats.unreadable_tail_bytes,
    )
    m.write(out)
    dt = time.perf_counter() - s.t0
    log.info(
        "prepare: read %d, kept %d, skipped %s; %d tokens (%d trainable) in %.1fs = %.0f tok/s; "
        "draft vocab %d covers %.2f%% of trainable tokens",
        s.n_read, s.n_kept, dict(s.skipped), s.n_tok, s.n_train_tok, dt, s.n_tok / max(dt, 1e-9),
        vocab.draft_vocab_size, 100 * vocab.coverage,
    )
    for note in s.stats.notes:
        log.warning("prepare: %s", note)
    return m


def sample(model: str | Path, cfg: PrepareConfig, records: int = 1000,
           trust_remote_code: bool = False) -> tuple[int, int, int, float]:
    """(records read, kept, tokens, seconds) of the first `records` records prepare would read (cfg.limit caps
    them), by the same stream into a temporary dir; seconds: the whole call, the tokenizer's load included. The
    preflight scales this to the whole source: how many records max_len leaves without an assistant token, and how
    many tokens the kept ones keep, depend on the data, the template and max_len together (the demo's first 400
    ShareGPT records: 87% kept at 831 tokens each under max_len 1024, where one share and one mean for every
    max_len planned 95% at 1,024). Raises what prepare would raise."""
    t0 = time.perf_counter()
    target = Target.open(Path(model), trust_remote_code)
    setup = _check_target(Path(model), target, cfg)
    n = min(records, cfg.limit) if cfg.limit else records
    with tempfile.TemporaryDirectory() as tmp:
        s = _Stream(Path(tmp), cfg.model_copy(update={"limit": n}), setup, None, bar=_progress(n, False))
        s.read(resolve_source(cfg.data))
    return s.n_read, s.n_kept, s.n_tok, time.perf_counter() - t0


def show_samples(model: str | Path, out: str | Path, n: int, trust_remote_code: bool = False,
                 color: bool = True) -> Iterator[str]:
    """The first `n` prepared train samples as text, each under a header line, their trainable (loss-masked)
    spans highlighted: what `eagle3 prepare --show N` prints."""
    tok = Target.open(model, trust_remote_code).tokenizer()
    for row in read_split(out, "train").slice(0, n).to_pylist():
        yield (f"\n===== record {row['record_id']} ({len(row['input_ids'])} tokens, "
               f"{sum(row['loss_mask'])} trainable) =====")
        yield show(tok, row["input_ids"], row["loss_mask"], color=color)
