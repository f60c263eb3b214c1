"""The online producer: the target engine fills the trainer's spool window by window (eagle3.storage.spool).

    produce(model, prepared, spool, cfg, order, spool_bytes) -> SpooledStates

It writes source.json and plan.json, then, in the trainer's read order, each window's shard (the
store's format, checksummed, atomic), waiting while the spool is full and deleting what the trainer
has left behind. It ends once the trainer reports it is done. Killed at any moment, a rerun keeps the
committed windows the trainer still needs and starts at the trainer's position; a trainer that resumed
from an earlier checkpoint gets its deleted windows produced again, byte for byte.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.config import ExtractConfig
from eagle3.extract.run import Backend, Samples, check_engine_length, inputs, load_samples, make_backend
from eagle3.model.target import Target
from eagle3.runtime.heap import retain_freed_memory
from eagle3.storage.atomic import atomic_write_json, clean_temp_files
from eagle3.storage.manifests import PreparedData, SpooledStates, SpoolSource
from eagle3.storage.spool import (
    PLAN,
    POSITION,
    PRODUCER_BEAT,
    PRODUCER_ERROR,
    TRAINER_BEAT,
    Order,
    Plan,
    Spool,
    Waiter,
    Window,
    beating,
    plan,
    reporting,
    window_key,
)
from eagle3.storage.store import SHARD_DIR, ShardPlan, ShardWriter, bytes_per_token

# (tokens produced, tokens to produce, bytes in the spool now)
Progress = Callable[[int, int, int], None]


def online_inputs(model, prepared, cfg: ExtractConfig, order: Order, spool_bytes: int,
                  trust_remote_code: bool = False) -> dict[str, Any]:
    """What the producer's run depends on: what the states are (the offline stage's inputs, less the shard
    size) and what cuts them into windows (the trainer's read order, the budget)."""
    fp = {k: v for k, v in inputs(model, prepared, cfg, trust_remote_code).items() if k != "shard_bytes"}
    return {**fp, "order": order.__dict__, "spool_bytes": spool_bytes}


def produce(model: str | Path, prepared: str | Path, spool: str | Path, cfg: ExtractConfig, order: Order,
            spool_bytes: int, *, wait_s: float = 900.0, progress: Progress | None = None,
            backend: Backend | None = None, trust_remote_code: bool = False) -> SpooledStates:
    """Produce every window the trainer reading `order` will read into `spool`; return its manifest.

    Idempotent: a spool whose producer finished with these inputs is returned as is."""
    retain_freed_memory()
    model, prepared, root = Path(model), Path(prepared), Path(spool)
    fp = online_inputs(model, prepared, cfg, order, spool_bytes, trust_remote_code)
    if SpooledStates.exists(root) and (done := SpooledStates.read(root)).inputs == fp:
        return done
    root.mkdir(parents=True, exist_ok=True)
    with reporting(root / PRODUCER_ERROR):
        run = Producer.open(root, model, prepared, cfg, order, spool_bytes, fp, wait_s, backend, trust_remote_code)
        t0 = time.perf_counter()
        with beating(root / PRODUCER_BEAT):
            try:
                run.loop(progress)
            finally:
                if (close := getattr(run.backend, "close", None)) is not None:
                    close()
        return run.finish(fp, model, time.perf_counter() - t0)


class Producer:
    """One producer run: the plan, the samples, the backend (built on first use) and the run's counters."""

    def __init__(self, spool: Spool, p: Plan, source: SpoolSource, samples: Samples, target: Target,
                 cfg: ExtractConfig, wait_s: float, backend: Backend | None):
        self.spool, self.plan, self.source, self.samples, self.target = spool, p, source, samples, target
        self.cfg, self.backend = cfg, backend
        self.wait = Waiter(spool.root, TRAINER_BEAT, wait_s, "the trainer")
        first = {}
        for row, split in enumerate(samples.split):
            first.setdefault(split, row)
        self.first_row = first  # split -> its first row in `samples`
        self.tokens_done = self.produced = self.reproduced = self.evicted = self.peak = 0
        self.furthest = 0  # the furthest position of the trainer seen: a window before it is written again
        self.low = 0  # train windows before this one are deleted (a killed run's leftovers: none yet)
        self.progress: Progress | None = None
        self.total = 0  # tokens of every window, once each (a window written again counts again in tokens_done)

    @classmethod
    def open(cls, root: Path, model: Path, prepared: Path, cfg: ExtractConfig, order: Order, spool_bytes: int,
             fp: dict[str, Any], wait_s: float, backend: Backend | None, trust_remote_code: bool) -> "Producer":
        """Read the samples, write source.json and plan.json (a changed plan drops the old one's shards and
        the trainer's position), clear temp files of a killed run."""
        prep = PreparedData.read(prepared)
        target = Target.open(model, trust_remote_code)
        samples = load_samples(prepared, prep, cfg.splits)
        if "train" not in samples.split:
            raise ValueError(f"{prepared}: no train samples to produce (splits {cfg.splits})")
        if cfg.backend == "vllm":
            check_engine_length(samples, target.max_position_embeddings)
        layer_ids = target.layer_ids(cfg.aux_layer_ids)
        source = spool_source(fp, model, target, layer_ids, cfg.storage, samples).seal()  # the plan keys on it
        bpt = bytes_per_token(len(layer_ids) - 1, target.hidden_size, cfg.storage)
        p = plan(source, order, spool_bytes, bpt)
        spool = Spool(root)
        (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        clean_temp_files(root / SHARD_DIR)
        clean_temp_files(root)
        with contextlib.suppress(FileNotFoundError):
            (root / "manifest.json").unlink()  # a finished run of other inputs: no longer this run's result
        old = spool.read_plan()
        if old is None or old["key"] != p.key:
            for f in (root / SHARD_DIR).iterdir():
                f.unlink()
            (root / POSITION).unlink(missing_ok=True)
        source.write(root)
        atomic_write_json(root / PLAN, p.to_json())
        return cls(spool, p, source, samples, target, cfg, wait_s, backend)

    # ---- the loop
    def loop(self, progress: Progress | None) -> None:
        """Until the trainer is done: drop the windows behind it, make the next one it lacks when it fits."""
        self.progress, self.total = progress, sum(w.tokens for w in self.plan.windows())
        while True:
            pos = self.spool.position()
            if pos.get("done"):
                return
            self.furthest = max(self.furthest, pos["window"])
            self.trim(pos["window"])
            w = self.next_window(pos["window"])
            # None: every window it still needs is on disk; no room: the spool is full. Either way, wait for
            # the trainer to move on.
            if w is None or not self.make_room(w, pos["window"]):
                self.wait(lambda was=pos: self.spool.position() != was)
                continue
            self.write(w)

    def next_window(self, position: int) -> Window | None:
        """The val window, then the first train window from `position` on that is not committed."""
        for w in ([self.plan.val] if self.plan.val else []) + self.plan.train[position:]:
            if self.spool.committed(self.plan, w) is None:
                return w
        return None

    def trim(self, position: int) -> None:
        """Delete the train windows before the trainer's position: those from the lowest not yet deleted (a
        trainer that went back lowers it: the windows it reads again are written again)."""
        for w in self.plan.train[min(self.low, position):position]:
            self.spool.drop(w)
        self.low = position

    def make_room(self, w: Window, position: int) -> bool:
        """Whether `w` fits the budget now, evicting committed windows after it (furthest first) when a trainer
        that went back needs it before them."""
        while self.spool.bytes_on_disk() + w.bytes > self.plan.spool_bytes:
            ahead = [v for v in self.plan.train[max(position, w.index + 1):] if self.spool.committed(self.plan, v)]
            if w.split == "val" or not ahead:
                return False
            self.spool.drop(ahead[-1])
            self.evicted += 1
        return True

    def write(self, w: Window) -> None:
        """Compute window `w`'s samples, write its shard (atomic) and commit it."""
        base = self.first_row[w.split]
        rows = [base + i for i in w.rows]
        sp = ShardPlan(w.split, w.index, rows, [self.samples.sample_id[r] for r in rows],
                       [self.samples.length[r] for r in rows], key=window_key(self.plan, w))
        n_aux, hidden = len(self.source.layer_ids) - 1, self.source.hidden_size
        writer = ShardWriter(sp, n_aux, hidden, self.cfg.storage)
        self.compute(sp, writer)
        sha = writer.write(self.spool.root)
        self.spool.commit(self.plan, w, sha)
        self.peak = max(self.peak, self.spool.bytes_on_disk())
        self.produced += 1
        self.reproduced += w.split == "train" and w.index < self.furthest

    def compute(self, sp: ShardPlan, writer: ShardWriter) -> None:
        """Run the backend (built here on first use) over the distinct samples of `sp` into `writer`."""
        if self.backend is None:
            self.backend = make_backend(self.cfg, self.target, self.source.layer_ids, self.spool.root,
                                        max(self.samples.length))
        todo = dict(zip(sp.sample_ids, sp.rows, strict=True))  # sample id -> its row: the same content twice is
        batch = [(sid, self.samples.tensors(row)[0]) for sid, row in todo.items()]  # computed once

        def counted(k: int) -> None:  # after each batch
            self.tokens_done += k
            if self.progress is not None:
                self.progress(self.tokens_done, self.total, self.spool.bytes_on_disk())

        with contextlib.closing(self.backend.extract(batch, on_tokens=counted)) as results:
            for sid, tok, h in results:
                ids, mask = self.samples.tensors(todo[sid])
                writer.add(sid, ids, mask, tok, h)

    def finish(self, fp: dict[str, Any], model: Path, seconds: float) -> SpooledStates:
        """Delete every shard (the trainer is done) and write the manifest."""
        for w in self.plan.windows():
            self.spool.drop(w)
        m = SpooledStates(
            config=self.cfg.model_dump(mode="json"), inputs=fp, model_dir=str(model),
            backend=getattr(self.backend, "name", self.cfg.backend) if self.backend else self.cfg.backend,
            source_fingerprint=self.source.fingerprint, spool_bytes=self.plan.spool_bytes,
            num_windows=len(self.plan.windows()),
            stats={"tokens_produced": self.tokens_done, "seconds": round(seconds, 3),
                   "tokens_per_second": round(self.tokens_done / seconds, 1) if seconds > 0 else None,
                   "windows_written": self.produced, "windows_written_again": self.reproduced,
                   "windows_evicted": self.evicted, "peak_spool_bytes": self.peak,
                   "total_steps": self.plan.total_steps},
        )
        m.write(self.spool.root)
        return m


def spool_source(fp: dict[str, Any], model: Path, target: Target, layer_ids: list[int], storage: str,
                 samples: Samples) -> SpoolSource:
    """source.json: what the states are, and every sample's token count per split (in prepared order)."""
    lengths: dict[str, list[int]] = {}
    for split, n in zip(samples.split, samples.length, strict=True):
        lengths.setdefault(split, []).append(n)
    what = {k: fp[k] for k in ("format", "prepared", "model", "layer_ids", "storage", "splits")}
    return SpoolSource(
        inputs=what, model_dir=str(model), model_fingerprint=target.fingerprint(),
        num_hidden_layers=target.num_layers, hidden_size=target.hidden_size, aux_layer_ids=layer_ids[:-1],
        layer_ids=layer_ids, storage=storage, lengths=lengths,
        splits={s: {"num_samples": len(v), "num_tokens": sum(v)} for s, v in lengths.items()},
    )

