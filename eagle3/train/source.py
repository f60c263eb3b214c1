"""Where the trainer reads hidden states from, chosen once per run: the extract stage's store (offline) or an
online producer's spool, read window by window as it is filled (eagle3/storage/spool.py).

Both give the trainer the same three things: the hidden states' manifest, the train and val readers (each with
`lengths` and the rows of a sample), and what names the states in the result's inputs. The spool adds its
plan (the windows, checked against the producer's), a heartbeat and an error file the producer watches while
rank 0 runs, and the position it tells the producer at the end; a silent producer fails the run after `wait_s`.
"""
from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, ContextManager

from eagle3.config import SPOOL_WAIT_S
from eagle3.storage import liveness, spool
from eagle3.storage.manifests import HiddenStates, SpoolSource
from eagle3.storage.store import bytes_per_token, open_store


@dataclass(frozen=True)
class Readers:
    """The train reader, the val reader (None without a val split) and, online, the spool's plan."""
    train: Any
    val: Any | None
    plan: spool.SpoolPlan | None = None


@dataclass(frozen=True)
class Stored:
    """Offline: the complete store the extract stage wrote in `dir`."""
    dir: Path
    online: ClassVar[bool] = False

    def manifest(self) -> HiddenStates:
        return HiddenStates.read(self.dir)

    def fingerprint(self) -> str:
        return HiddenStates.read(self.dir).fingerprint

    def open(self, hidden: HiddenStates, order, main: bool, barrier) -> Readers:
        val = open_store(self.dir, "val") if hidden.splits.get("val", {}).get("num_samples") else None
        return Readers(open_store(self.dir, "train"), val)

    def serving(self, main: bool) -> ContextManager:
        return nullcontext()

    def done(self, windows: int, main: bool) -> None:
        pass


@dataclass(frozen=True)
class Spooled:
    """Online: the spool in `dir` a producer fills in the trainer's read order (`order`), at most its cap; each
    side fails when the other is silent for `wait_s` seconds."""
    dir: Path
    wait_s: float = SPOOL_WAIT_S
    online: ClassVar[bool] = True

    def manifest(self) -> SpoolSource:
        """The spool's source.json, once the producer has written it (it waits)."""
        return spool.wait_source(self.dir, self.wait_s)

    def fingerprint(self) -> str:
        """The spool's source.json names the states by what the producer computes them from: the same states an
        offline store of those inputs holds."""
        return SpoolSource.read(self.dir).fingerprint

    def open(self, hidden: HiddenStates, order, main: bool, barrier) -> Readers:
        bpt = bytes_per_token(len(hidden.layer_ids) - 1, hidden.hidden_size, hidden.storage)
        plan, train, val = spool.reader_pair(self.dir, hidden, order, self.wait_s, main, barrier, bpt)
        return Readers(train, val, plan)

    def serving(self, main: bool) -> ContextManager:
        """On rank 0: a failure written where the producer sees it, and a heartbeat while the run lives."""
        stack = ExitStack()
        if main:
            stack.enter_context(liveness.reporting(self.dir / spool.TRAINER_ERROR))
            stack.enter_context(liveness.beating(self.dir / spool.TRAINER_BEAT))
        return stack

    def done(self, windows: int, main: bool) -> None:
        """Tell the producer the trainer is done, past train window `windows` (its position), so it may end."""
        if main:
            spool.Spool(self.dir).set_position(windows, done=True)


Source = Stored | Spooled


def source(hidden_dir: str | Path, online: bool = False, wait_s: float = SPOOL_WAIT_S) -> Source:
    """The source the command line names: `--online` reads `hidden_dir` as a spool, else as a store."""
    return Spooled(Path(hidden_dir), wait_s) if online else Stored(Path(hidden_dir))
