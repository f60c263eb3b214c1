"""The bounded spool of online training: hidden states go from the target engine to the trainer through
a directory capped at a byte budget, so no run needs the full store on disk.

Layout of a spool dir (a pipeline's extract dir in online mode):

    source.json                       SpoolSource: model, layer ids, storage, every sample's token count
                                      (the producer writes it first; the trainer waits for it)
    plan.json                         the windows, the budget, the number of producers and the read order
    position.json                     the trainer's position: the first train window it still needs
    spool.lock                        the producers' lock around "check the budget + reserve a window"
    producer.lock                     held by the running producer (a second one of the same part fails)
    shards/val-00000.safetensors      the samples validation reads, kept for the whole run
    shards/train-{j:05d}.safetensors  window j: every sample that optimizer steps [first, end) read
    shards/{name}.json                a shard's commit record (key, sha256, bytes), written after it
    producer.beat, trainer.beat       touched every few seconds by a live producer (any) / the trainer
    producer.error, trainer.error     the error a side failed with (cleared when it starts again)
    producer.reserve                  the window a producer is writing and its planned bytes
    producer.stats.json               a producer's own figures, once the trainer is done
    manifest.json                     SpooledStates: every producer's, once the trainer read every window

Shards are the store's own format (`eagle3.storage.store.ShardWriter`), checksummed. The trainer's read
order is a pure function of the samples' lengths and its order settings (`eagle3.storage.order`), so
the producers know before the trainer starts which samples each step reads, and both sides compute the
same windows from the same `Order`, budget and number of producers (the trainer reads the last two from
plan.json); the trainer refuses a plan.json that differs from its own.

Several producers (`extract.workers = N`, producer k of N: `part=k`) fill one spool, each with its own engine, on
hosts that all see the spool dir. Producer k owns the train windows j with j % N == k (and producer N - 1 the val
window, so that producer 0 starts on train window 0 beside it): it writes only those, under its own name `producer-k`
(its .beat, .error, .lock, .reserve and .stats.json; with one producer the name is `producer`). Any producer deletes
the windows behind the trainer's position (under spool.lock, which orders it against reservations): a producer busy
computing a window, or killed, then holds no room the trainer has left. The last producer to finish merges every
producer's stats.json into manifest.json (`SpooledStates.read(spool)`). Every live producer also touches
producer.beat, so the trainer fails when all producers are silent for wait_s, when the owner of the window it waits
for is, or when any producer's error file stays past ERROR_GRACE.

Budget: the val shard plus the train shards on disk (temp files included) never exceed `spool_bytes`.
A producer writes a window only after reserving it under spool.lock (an flock, so producers on several
hosts of one shared file system and several in one process exclude each other): it checks that the
shards on disk plus every reservation (a reserved window counts at its planned size, or at what of it is
on disk when that is more) plus this window's planned size fit, then writes `{name}.reserve`, which counts
until the window is committed. A producer (re)starting clears its own reservation and temp files.
Reservations are taken in the trainer's read order: a producer reserves only the first window (val, then
train from the trainer's position) that is neither committed nor reserved, when it owns it. So the room
always goes to the window the trainer needs first: no window ahead can starve an earlier one.
Windows are cut at 1 / (N + 1) of what the val shard leaves, so N windows can be written while the
trainer reads one (with one producer: half).
Resume: position.json moves back to a resumed trainer's checkpoint; windows it needs again are
produced again (the same bytes: a window is a pure function of its samples), and windows produced
ahead of it are evicted, furthest first, when room is needed for an earlier one. The producer that needs
the room evicts, whichever producer wrote them (a committed window has no writer; its owner writes it
again in its turn): otherwise windows ahead, whose owners have nothing to write, could hold the room of
an earlier one forever.
"""
from __future__ import annotations

import bisect
import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.storage.atomic import atomic_write_json
from eagle3.storage.hashing import sha256_json
from eagle3.storage.liveness import BEAT_EVERY, Waiter
from eagle3.storage.manifests import SpoolSource
from eagle3.storage.order import epoch_packs, micro_packs, steps_per_epoch, val_packs
from eagle3.storage.store import SHARD_DIR, as_sample, mmap_shard, shard_meta, shard_problem

PLAN, POSITION, LOCK = "plan.json", "position.json", "spool.lock"
PRODUCER_BEAT, TRAINER_BEAT = "producer.beat", "trainer.beat"  # producer.beat: touched by every live producer
PRODUCER_ERROR, TRAINER_ERROR = "producer.error", "trainer.error"
PRODUCER_ERRORS = "producer*.error"  # every producer's error file (the trainer fails on any)
# A shard's bytes beyond its tokens: the safetensors header (per sample: its 64-hex id and length; per
# tensor: name, dtype, shape, offsets) and alignment. Measured headers stay under half of this.
HEADER_PER_SAMPLE, HEADER_FIXED = 128, 4096


@dataclass(frozen=True)
class Order:
    """What fixes the trainer's read order: its config's order fields and its world size."""

    seed: int
    pack_tokens: int
    epochs: int
    max_steps: int | None
    grad_accum: int
    world: int
    val_max_packs: int | None


@dataclass
class Window:
    """One spool shard: the distinct samples (`rows`, indices into the split, in first-read order) that
    optimizer steps [first, end) read; the val window has first == end == 0."""

    split: str
    index: int
    first: int
    end: int
    rows: list[int]
    tokens: int
    bytes: int  # planned upper bound of the shard file

    @property
    def name(self) -> str:
        return f"{self.split}-{self.index:05d}"

    @property
    def file(self) -> str:
        return f"{SHARD_DIR}/{self.name}.safetensors"

    @property
    def record(self) -> str:
        return f"{SHARD_DIR}/{self.name}.json"


@dataclass
class SpoolPlan:
    """Every window of a run, val first; `key` names the whole plan (and so the source, order and budget)."""

    spool_bytes: int
    order: Order
    total_steps: int
    val: Window | None
    train: list[Window]
    producers: int = 1
    key: str = ""
    _firsts: list[int] = field(default_factory=list, repr=False)

    def owner(self, w: Window) -> int:
        """The producer that writes window `w`: train window j is producer j % N's, the val window the last one's
        (it is reserved first: producer 0 then starts on train window 0 at once, beside it)."""
        return self.producers - 1 if w.split == "val" else w.index % self.producers

    def window_of(self, step: int) -> int:
        """The train window that optimizer step `step` reads."""
        if not self._firsts:
            self._firsts = [w.first for w in self.train]
        return bisect.bisect_right(self._firsts, step) - 1

    def windows(self) -> list[Window]:
        return ([self.val] if self.val else []) + self.train

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "spool_bytes": self.spool_bytes, "producers": self.producers,
                "order": asdict(self.order), "total_steps": self.total_steps,
                "windows": [asdict(w) for w in self.windows()]}


def shard_bytes(tokens: int, samples: int, bytes_per_token: int) -> int:
    return tokens * bytes_per_token + HEADER_PER_SAMPLE * samples + HEADER_FIXED


def step_rows(lengths: Sequence[int], order: Order) -> Iterator[list[int]]:
    """The distinct samples each optimizer step of the run reads, over every rank, step by step."""
    step, epoch = 0, 0
    total = None
    while total is None or step < total:
        packs = epoch_packs(lengths, order.seed, epoch, order.pack_tokens)
        spe = steps_per_epoch(len(packs), order.world, order.grad_accum)
        total = order.max_steps or order.epochs * spe
        for s in range(spe):
            if step >= total:
                return
            rows = [i for r in range(order.world) for p in micro_packs(packs, s, r, order.world, order.grad_accum)
                    for i in p]
            yield list(dict.fromkeys(rows))
            step += 1
        epoch += 1


def producer_name(part: int, producers: int) -> str:
    """Producer `part` of `producers`' name: its beat, error, reservation and stats files are `{name}.*`."""
    return "producer" if producers == 1 else f"producer-{part}"


def plan_spool(source: SpoolSource, order: Order, spool_bytes: int, bytes_per_token: int,
               producers: int = 1) -> SpoolPlan:
    """Cut the run's train reads into windows that fit the budget beside the val shard, `producers` + 1 at once
    (see the module doc). A budget that cannot hold the val shard and the largest single step is an error that
    says what fits."""
    lengths = source.lengths["train"]
    val = None
    vlen = source.lengths.get("val") or []
    if vlen:
        rows = sorted({i for p in val_packs(vlen, order.seed, order.pack_tokens, order.val_max_packs) for i in p})
        tokens = sum(vlen[i] for i in rows)
        val = Window("val", 0, 0, 0, rows, tokens, shard_bytes(tokens, len(rows), bytes_per_token))
    room = spool_bytes - (val.bytes if val else 0)
    cap = room // (producers + 1)  # N windows written while the trainer reads one
    windows: list[Window] = []
    cur: dict[int, None] = {}  # the open window's samples, in first-read order
    tokens = first = step = 0  # tokens: of `cur`, kept as it grows (no re-sum per step)

    def cut(end: int) -> None:
        windows.append(Window("train", len(windows), first, end, list(cur), tokens,
                              shard_bytes(tokens, len(cur), bytes_per_token)))

    for step, rows in enumerate(step_rows(lengths, order)):
        fresh = [i for i in rows if i not in cur]
        need = shard_bytes(tokens + sum(lengths[i] for i in fresh), len(cur) + len(fresh), bytes_per_token)
        if cur and need > cap:
            cut(step)
            cur, first, tokens = dict.fromkeys(rows), step, sum(lengths[i] for i in rows)
            need = shard_bytes(tokens, len(cur), bytes_per_token)
        else:
            cur.update(dict.fromkeys(fresh))
            tokens += sum(lengths[i] for i in fresh)
        if need > room:
            raise ValueError(
                f"spool_bytes {spool_bytes:,} is too small: optimizer step {step} alone reads {len(rows)} samples "
                f"({need:,} bytes stored){f' beside the val shard ({val.bytes:,} bytes)' if val else ''}; "
                f"give it at least {(producers + 1) * need + (val.bytes if val else 0):,} bytes to overlap "
                f"{'two' if producers == 1 else producers + 1} windows")
    cut(step + 1)
    p = SpoolPlan(spool_bytes, order, step + 1, val, windows, producers)
    p.key = sha256_json({"source": source.fingerprint, **{k: v for k, v in p.to_json().items() if k != "key"}})
    return p


def window_key(p: SpoolPlan, w: Window) -> str:
    """What a window's shard holds: the plan's source and the window's samples (its bytes follow from them)."""
    return sha256_json({"plan": p.key, "split": w.split, "rows": w.rows})


# ---------------------------------------------------------------- the spool dir
_IN_PROCESS = threading.Lock()  # an flock excludes open files, not threads: producers in one process take this too


def window_of_file(name: str) -> str:
    """The window a file under shards/ belongs to: `train-00003.safetensors`, its record `train-00003.json`
    and their temp files `.train-00003.*.tmp` all name `train-00003`."""
    return name.lstrip(".").split(".", 1)[0]


@dataclass
class Spool:
    """A spool dir, as either side sees it."""

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    def position(self) -> dict[str, Any]:
        """{"window": the first train window the trainer still needs, "done": whether it finished}."""
        try:
            return json.loads((self.root / POSITION).read_text())
        except (FileNotFoundError, ValueError):
            return {"window": 0, "done": False}

    def set_position(self, window: int, done: bool = False) -> None:
        atomic_write_json(self.root / POSITION, {"window": window, "done": done})

    def read_plan(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / PLAN).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def committed(self, p: SpoolPlan, w: Window) -> dict[str, Any] | None:
        """The commit record of window `w` when its shard is on disk with this plan's key, else None."""
        try:
            rec = json.loads((self.root / w.record).read_text())
        except (FileNotFoundError, ValueError):
            return None
        return rec if rec.get("key") == window_key(p, w) and (self.root / w.file).is_file() else None

    def commit(self, p: SpoolPlan, w: Window, sha256: str) -> int:
        """Record window `w`'s shard as whole (after its atomic write); returns its size."""
        n = (self.root / w.file).stat().st_size
        if n > w.bytes:  # the budget check planned with w.bytes: a larger shard would break the cap
            raise AssertionError(f"{w.file}: {n} bytes, planned at most {w.bytes}")
        atomic_write_json(self.root / w.record, {"key": window_key(p, w), "sha256": sha256, "bytes": n})
        return n

    def bytes_on_disk(self) -> int:
        """Every file under shards/: committed shards, their records, and a shard being written."""
        d = self.root / SHARD_DIR
        total = 0
        for f in d.iterdir() if d.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):
                total += f.stat().st_size
        return total

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The producers' lock (spool.lock): held around every "check the budget + reserve", trim and eviction.
        flock on Linux NFS is a POSIX lock the server keeps, so it holds across hosts too."""
        with _IN_PROCESS, open(self.root / LOCK, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def reservations(self) -> dict[str, int]:
        """Window name -> planned bytes, of every producer's reservation (`{name}.reserve`) now."""
        out: dict[str, int] = {}
        for f in self.root.glob("producer*.reserve"):
            with contextlib.suppress(FileNotFoundError, ValueError):
                r = json.loads(f.read_text())
                out[r["window"]] = max(out.get(r["window"], 0), r["bytes"])
        return out

    def reserve(self, name: str, w: Window) -> None:
        atomic_write_json(self.root / f"{name}.reserve", {"window": w.name, "bytes": w.bytes})

    def release(self, name: str) -> None:
        (self.root / f"{name}.reserve").unlink(missing_ok=True)

    def held(self, extra: Window | None = None) -> int:
        """What the budget counts: the bytes under shards/, a reserved window's (and `extra`'s) at the larger of
        its planned size and what of it is on disk (its temp file grows to the shard, then its record comes)."""
        res = self.reservations()
        if extra is not None:
            res[extra.name] = max(res.get(extra.name, 0), extra.bytes)
        disk: dict[str, int] = {}
        d = self.root / SHARD_DIR
        for f in d.iterdir() if d.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):
                w = window_of_file(f.name)
                disk[w] = disk.get(w, 0) + f.stat().st_size
        return sum(n for w, n in disk.items() if w not in res) + sum(max(n, disk.get(w, 0)) for w, n in res.items())

    def look(self) -> tuple[Any, ...]:
        """What a waiting producer watches: the trainer's position, the files under shards/, the reservations."""
        d = self.root / SHARD_DIR
        return (self.position(), sorted(f.name for f in d.iterdir()) if d.is_dir() else [],
                sorted(self.reservations().items()))

    def drop(self, w: Window) -> None:
        """Remove window `w` (its record first: a shard without a record is not committed)."""
        for name in (w.record, w.file):
            with contextlib.suppress(FileNotFoundError):
                (self.root / name).unlink()


# ---------------------------------------------------------------- the trainer's side
class SpoolReader:
    """The trainer's view of one split of a spool: `reader[i]` is sample i as the store hands it out, for the
    samples of the window open now; `lengths` are all the split's samples' token counts (no shard read).

    Train: `at(step)` opens the window that step reads (waiting for the producer), after every rank has
    left the one before (`barrier`); rank 0 then moves position.json, so the producer may delete it."""

    def __init__(self, spool: Spool, plan: SpoolPlan, split: str, lengths: list[int], wait: list[Waiter], main: bool,
                 barrier: Callable[[], None]):
        self.spool, self.plan, self.split, self.lengths = spool, plan, split, lengths
        self.wait, self.main, self.barrier = wait, main, barrier
        self.window: Window | None = plan.val if split == "val" else None
        self._pos: dict[int, tuple[int, str]] = {}  # sample -> (token offset in the shard, sample id)
        self._tensors: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.lengths)

    def at(self, step: int) -> None:
        j = self.plan.window_of(step)
        if self.window is not None and self.window.index == j:
            return
        if self.window is not None:
            self.barrier()  # every rank is done with the window before: it may go
        self.window, self._tensors = self.plan.train[j], None
        if self.main:
            self.spool.set_position(j)

    def _open(self) -> None:
        w = self.window
        if w is None:
            raise RuntimeError(f"{self.spool.root}: no {self.split} window open (call at(step) first)")
        # the owner's beat: with several producers, a dead one is found though the others live
        rec = self.wait[self.plan.owner(w)](lambda: self.spool.committed(self.plan, w))
        path = self.spool.root / w.file
        bad = shard_problem(path, rec["sha256"])
        meta = shard_meta(path) or {}
        if bad or meta.get("key") != window_key(self.plan, w):
            raise ValueError(bad or f"{path}: holds another window's samples (key differs from plan.json)")
        self._tensors = mmap_shard(path)
        self._pos, off = {}, 0
        for k, i in enumerate(w.rows):  # the shard holds the window's rows in order, whole
            self._pos[i] = (off, meta["sample_ids"][k])
            off += self.lengths[i]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._tensors is None:
            self._open()
        if i not in self._pos:
            raise KeyError(f"{self.split} sample {i} is not in spool window {self.window.name}: the trainer reads "
                           "out of the plan's order")
        (off, sid), n = self._pos[i], self.lengths[i]
        return as_sample(sid, {name: t[off: off + n] for name, t in self._tensors.items()})


def wait_plan(spool: Spool, mine: SpoolPlan, wait: Waiter) -> None:
    """Wait until the producer's plan.json is `mine`. A different one written by a live producer (it starts
    beating after writing its plan) is an error naming both; one a dead producer left is waited past."""

    def same() -> bool:  # the key covers the budget and the number of producers too
        theirs = spool.read_plan()
        if theirs is None or theirs["key"] == mine.key:
            return theirs is not None
        try:
            beat, written = (spool.root / PRODUCER_BEAT).stat().st_mtime, (spool.root / PLAN).stat().st_mtime
        except FileNotFoundError:
            return False
        if beat >= written and time.time() - beat < 3 * BEAT_EVERY:
            raise ValueError(f"{spool.root / PLAN}: the producer planned for another source, read order or budget "
                             f"({theirs['order']}, spool_bytes {theirs['spool_bytes']:,}, "
                             f"{theirs.get('producers', 1)} producers) than this trainer "
                             f"({asdict(mine.order)}, spool_bytes {mine.spool_bytes:,}, {mine.producers} producers)")
        return False

    wait(same)


def wait_source(root: Path, wait_s: float) -> SpoolSource:
    """The spool's source.json, once the producer has written it."""
    w = Waiter(Path(root), PRODUCER_BEAT, wait_s, "source.json", PRODUCER_ERRORS)
    return w(lambda: SpoolSource.read(root) if (Path(root) / SpoolSource.FILE).is_file() else None)


def reader_pair(root: Path, source: SpoolSource, order: Order, wait_s: float, main: bool,
                barrier: Callable[[], None], bytes_per_token: int) -> tuple[SpoolPlan, SpoolReader, SpoolReader | None]:
    """The trainer's plan (checked against the producer's) and its train and val readers."""
    spool = Spool(root)
    wait = Waiter(spool.root, PRODUCER_BEAT, wait_s, "the producer's plan", PRODUCER_ERRORS)
    found = wait(spool.read_plan)
    n = found.get("producers", 1)  # the budget and the number of producers: the producers' (plan.json)
    p = plan_spool(source, order, found["spool_bytes"], bytes_per_token, n)
    wait_plan(spool, p, wait)
    shards = [Waiter(spool.root, f"{producer_name(k, n)}.beat", wait_s, "the next shard", PRODUCER_ERRORS)
              for k in range(n)]
    train = SpoolReader(spool, p, "train", source.lengths["train"], shards, main, barrier)
    val = SpoolReader(spool, p, "val", source.lengths["val"], shards, main, barrier) if p.val else None
    return p, train, val


def spool_dir_bytes(root: str | os.PathLike) -> int:
    """Bytes under a spool's shards/ now (what the budget caps)."""
    return Spool(Path(root)).bytes_on_disk()
