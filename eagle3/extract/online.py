"""The online producer: the target engine fills the trainer's spool window by window (eagle3.storage.spool).

    produce(model, prepared, spool, cfg, order, spool_bytes) -> SpooledStates

It writes source.json and plan.json, then, in the trainer's read order, each window's shard (the
store's format, checksummed, atomic), waiting while the spool is full and deleting what the trainer
has left behind. It ends once the trainer reports it is done. Killed at any moment, a rerun keeps the
committed windows the trainer still needs and starts at the trainer's position; a trainer that resumed
from an earlier checkpoint gets its deleted windows produced again, byte for byte.

With `cfg.workers = N`, N producers fill one spool: `part=k` is producer k, which writes the windows
it owns (eagle3.storage.spool: train window j when j % N == k, the val window for k = N - 1), reserving each
under the spool's lock so that together they keep the cap. The last one to finish writes the manifest.
"""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.config import SPOOL_WAIT_S, ExtractConfig
from eagle3.extract.backend import Backend, make_backend
from eagle3.extract.resume import inputs
from eagle3.extract.samples import Samples, check_engine_length, load_samples
from eagle3.model.target import Target
from eagle3.runtime.heap import retain_freed_memory
from eagle3.storage.atomic import atomic_write_json
from eagle3.storage.liveness import Waiter, alone, beating, reporting
from eagle3.storage.manifests import PreparedData, SpooledStates, SpoolSource
from eagle3.storage.spool import (
    PLAN,
    POSITION,
    PRODUCER_BEAT,
    TRAINER_BEAT,
    Order,
    Spool,
    SpoolPlan,
    Window,
    plan_spool,
    producer_name,
    window_key,
    window_of_file,
)
from eagle3.storage.store import SHARD_DIR, ShardPlan, ShardWriter, bytes_per_token

# (tokens produced, tokens to produce, bytes in the spool now)
Progress = Callable[[int, int, int], None]


def online_inputs(model, prepared, cfg: ExtractConfig, order: Order, spool_bytes: int,
                  trust_remote_code: bool = False) -> dict[str, Any]:
    """What the producer's run depends on: what the states are (the offline stage's inputs, less the shard
    size) and what cuts them into windows (the trainer's read order, the budget)."""
    fp = {k: v for k, v in inputs(model, prepared, cfg, trust_remote_code).items() if k != "shard_bytes"}
    # the number of producers cuts the windows (plan.json); which producer this is does not change the spool
    return {**fp, "order": order.__dict__, "spool_bytes": spool_bytes, "producers": cfg.workers}


def produce(model: str | Path, prepared: str | Path, spool: str | Path, cfg: ExtractConfig, order: Order,
            spool_bytes: int, *, part: int | None = None, wait_s: float = SPOOL_WAIT_S,
            progress: Progress | None = None, backend: Backend | None = None,
            trust_remote_code: bool = False) -> SpooledStates:
    """Produce every window the trainer reading `order` will read into `spool` (`part` = k: only producer k's of
    cfg.workers); return the spool's manifest, or this producer's share of it when others are still running.

    Idempotent: a spool whose producers finished with these inputs is returned as is."""
    n = cfg.workers
    if part is None and n > 1:
        raise ValueError(f"produce: extract.workers = {n} producers fill the spool; say which this one is "
                         f"(part = 0 to {n - 1}: `eagle3 produce --workers {n} --part K`)")
    k = part or 0
    if not 0 <= k < n:
        raise ValueError(f"produce: part {k} of {n} producers (extract.workers); give 0 to {n - 1}")
    retain_freed_memory()
    model, prepared, root = Path(model), Path(prepared), Path(spool)
    fp = online_inputs(model, prepared, cfg, order, spool_bytes, trust_remote_code)
    if SpooledStates.exists(root) and (done := SpooledStates.read(root)).inputs == fp:
        return done
    root.mkdir(parents=True, exist_ok=True)
    name = producer_name(k, n)
    with alone(root / f"{name}.lock"), reporting(root / f"{name}.error"):
        run = Producer.open(root, model, prepared, cfg, order, spool_bytes, fp, wait_s, backend, trust_remote_code,
                            k)
        t0 = time.perf_counter()
        with beating(*dict.fromkeys([root / f"{name}.beat", root / PRODUCER_BEAT])):  # its own, and "any producer"
            try:
                run.loop(progress)
            finally:
                if (close := getattr(run.backend, "close", None)) is not None:
                    close()
        return run.finish(fp, model, time.perf_counter() - t0)


class Producer:
    """One producer run: the plan, the samples, the backend (built on first use) and the run's counters."""

    def __init__(self, spool: Spool, p: SpoolPlan, source: SpoolSource, samples: Samples, target: Target,
                 cfg: ExtractConfig, wait_s: float, backend: Backend | None, part: int = 0):
        self.spool, self.plan, self.source, self.samples, self.target = spool, p, source, samples, target
        self.cfg, self.backend, self.part = cfg, backend, part
        self.name = producer_name(part, p.producers)
        self.wait = Waiter(spool.root, TRAINER_BEAT, wait_s, "the trainer")
        first = {}
        for row, split in enumerate(samples.split):
            first.setdefault(split, row)
        self.first_row = first  # split -> its first row in `samples`
        self.tokens_done = self.produced = self.reproduced = self.evicted = self.peak = 0
        self.furthest = 0  # the furthest position of the trainer seen: a window before it is written again
        self.low = 0  # train windows before this one are deleted (a killed run's leftovers: none yet)
        self.progress: Progress | None = None
        self.total = 0  # tokens of its windows, once each (a window written again counts again in tokens_done)
        self.final_check: dict[str, Any] | None = None  # eagle3.extract.check's result on its first window

    @classmethod
    def open(cls, root: Path, model: Path, prepared: Path, cfg: ExtractConfig, order: Order, spool_bytes: int,
             fp: dict[str, Any], wait_s: float, backend: Backend | None, trust_remote_code: bool,
             part: int = 0) -> "Producer":
        """Read the samples, write source.json and plan.json (a changed plan drops the old one's shards and
        the trainer's position), clear this producer's reservation and temp files of a killed run."""
        prep = PreparedData.read(prepared)
        target = Target.open(model, trust_remote_code)
        samples = load_samples(prepared, prep, cfg.splits, target.vocab_rows)
        if "train" not in samples.split:
            raise ValueError(f"{prepared}: no train samples to produce (splits {cfg.splits})")
        if cfg.backend == "vllm":
            check_engine_length(samples, target.max_position_embeddings)
        layer_ids = target.layer_ids(cfg.aux_layer_ids)
        source = spool_source(fp, model, target, layer_ids, cfg.storage, samples).seal()  # the plan keys on it
        bpt = bytes_per_token(len(layer_ids) - 1, target.hidden_size, cfg.storage)
        p = plan_spool(source, order, spool_bytes, bpt, cfg.workers)
        run = cls(Spool(root), p, source, samples, target, cfg, wait_s, backend, part)
        (root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        spool = run.spool
        # Under the lock: the others' reservations, writes and plan checks see this producer's start whole.
        with spool.locked():
            spool.release(run.name)  # a killed run's reservation: that window is written again
            mine = {w.name for w in p.windows() if p.owner(w) == part}
            for f in (root / SHARD_DIR).glob(".*.tmp"):  # temp files of its own killed writes (not the others')
                if window_of_file(f.name) in mine:
                    f.unlink(missing_ok=True)
            for f in root.glob(".*.tmp"):  # those of the files written under the lock, and of its own
                if f.name.startswith((f".{PLAN}.", f".{SpoolSource.FILE}.", ".manifest.json.", f".{run.name}.")):
                    f.unlink(missing_ok=True)
            (root / f"{run.name}.stats.json").unlink(missing_ok=True)  # an earlier run's share
            # a finished run of other inputs: no longer this run's result
            (root / "manifest.json").unlink(missing_ok=True)
            old = spool.read_plan()
            if old is None or old["key"] != p.key:
                for f in [*(root / SHARD_DIR).iterdir(), *root.glob("producer*.reserve"),
                          *root.glob("producer*.stats.json")]:
                    f.unlink()
                (root / POSITION).unlink(missing_ok=True)
            source.write(root)
            atomic_write_json(root / PLAN, p.to_json())
        return run

    # ---- the loop
    def loop(self, progress: Progress | None) -> None:
        """Until the trainer is done: drop the windows behind it, make the next one it lacks when this producer
        owns it and it fits."""
        self.progress = progress
        self.total = sum(w.tokens for w in self.plan.windows() if self.plan.owner(w) == self.part)
        while True:
            pos = self.spool.position()
            if pos.get("done"):
                return
            self.furthest = max(self.furthest, pos["window"])
            with self.spool.locked():
                self.trim(pos["window"])
                w = self.next_window(pos["window"])
                # None: every window it still needs is on disk or being written; another's: its owner reserves it
                # first (the room goes in read order); no room: the spool is full.
                ok = w is not None and self.plan.owner(w) == self.part and self.make_room(w, pos["window"])
                if ok:
                    self.spool.drop(w)  # a killed run's uncommitted shard: the new one must not sit beside it
                    self.spool.reserve(self.name, w)
            if not ok:  # wait for the trainer to move on, or for another producer to reserve or commit
                seen = self.spool.look()
                self.wait(lambda was=seen: self.spool.look() != was)
                continue
            try:
                self.write(w)
            finally:
                self.spool.release(self.name)  # committed, or failed (its temp file is gone): no longer in flight

    def next_window(self, position: int) -> Window | None:
        """The val window, then the first train window from `position` on, that is neither committed nor
        reserved (by any producer)."""
        busy = self.spool.reservations()
        for w in ([self.plan.val] if self.plan.val else []) + self.plan.train[position:]:
            if w.name not in busy and self.spool.committed(self.plan, w) is None:
                return w
        return None

    def trim(self, position: int) -> None:
        """Delete the train windows before the trainer's position, whoever wrote them: those from the lowest not
        yet deleted (a trainer that went back lowers it: the windows it reads again are written again)."""
        for w in self.plan.train[min(self.low, position):position]:
            self.spool.drop(w)
        self.low = position

    def make_room(self, w: Window, position: int) -> bool:
        """Whether `w` fits the budget now, evicting committed windows after it (furthest first, whoever wrote
        them) when a trainer that went back needs it before them."""
        while self.spool.held(w) > self.plan.spool_bytes:
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
        if self.final_check is None:  # the final-layer check on this producer's first window, before its commit
            self.check_final(sp)
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

    def check_final(self, sp: ShardPlan) -> None:
        """eagle3.extract.check on a few samples of the window just written: a refused one is deleted before its
        commit, and the producer stops with the layer named (the trainer then stops on the producer's failure)."""
        from eagle3.extract import check

        path = self.spool.root / sp.file
        self.final_check = check.on_shard(self.backend, self.target, path, sp.sample_ids, sp.lengths,
                                          lambda i: self.samples.tensors(sp.rows[i])[0], self.source.layer_ids[-1],
                                          self.cfg.storage)
        if self.final_check["passed"] is False:
            path.unlink(missing_ok=True)
            check.refuse(self.final_check, str(self.spool.root))

    def finish(self, fp: dict[str, Any], model: Path, seconds: float) -> SpooledStates:
        """Delete every shard (the trainer is done), write this producer's stats; the last producer to get here
        writes the manifest, with every producer's (the one returned; the others return their own share)."""
        for w in self.plan.windows():
            self.spool.drop(w)
        stats = {"tokens_produced": self.tokens_done, "seconds": round(seconds, 3),
                 "tokens_per_second": round(self.tokens_done / seconds, 1) if seconds > 0 else None,
                 "windows_written": self.produced, "windows_written_again": self.reproduced,
                 "windows_evicted": self.evicted, "peak_spool_bytes": self.peak,
                 "total_steps": self.plan.total_steps, "final_check": self.final_check}
        root, n = self.spool.root, self.plan.producers
        files = [root / f"{producer_name(k, n)}.stats.json" for k in range(n)]
        with self.spool.locked():  # two producers ending at once: one of them sees both shares
            atomic_write_json(files[self.part], {"plan": self.plan.key, **stats})
            shares = []
            for f in files:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    share = json.loads(f.read_text())
                    if share.pop("plan") == self.plan.key:
                        shares.append(share)
            m = SpooledStates(
                config=self.cfg.model_dump(mode="json"), inputs=fp, model_dir=str(model),
                backend=getattr(self.backend, "name", self.cfg.backend) if self.backend else self.cfg.backend,
                source_fingerprint=self.source.fingerprint, spool_bytes=self.plan.spool_bytes,
                num_windows=len(self.plan.windows()), stats=merged(shares) if len(shares) == n else stats,
            )
            if len(shares) == n:
                m.write(root)
            else:
                m.seal()  # a share is returned (and cached by the flow) as a finished manifest too
        return m


def merged(shares: list[dict[str, Any]]) -> dict[str, Any]:
    """The spool's stats from every producer's: counts add up, the run took the longest one's time, the peak is
    the highest any producer saw; with several, each producer's own under `producers`."""
    from eagle3.extract import check

    if len(shares) == 1:
        return shares[0]
    out = {k: sum(s[k] for s in shares) for k in ("tokens_produced", "windows_written", "windows_written_again",
                                                   "windows_evicted")}
    seconds = max(s["seconds"] for s in shares)
    return {**out, "seconds": seconds,
            "tokens_per_second": round(out["tokens_produced"] / seconds, 1) if seconds > 0 else None,
            "peak_spool_bytes": max(s["peak_spool_bytes"] for s in shares), "total_steps": shares[0]["total_steps"],
            "final_check": check.merge([s.get("final_check") for s in shares]), "producers": shares}


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

