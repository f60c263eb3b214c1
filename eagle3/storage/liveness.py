"""Life signs of two processes that wait on each other through a shared directory (an online producer and the
trainer): a heartbeat file each side touches while it lives, an error file a side writes when it fails, a lock
that keeps a second copy of one side from starting, and a wait that gives up once the other side is silent or
has failed. Files, not sockets: the two sides may run on different hosts that share only the directory."""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle3.storage.atomic import atomic_write_text

BEAT_EVERY = 2.0  # seconds between a live side's touches of its beat file
POLL = 0.1  # seconds between looks at the spool while waiting
SAY_EVERY = 30.0  # seconds between the log lines of a side that waits
ERROR_GRACE = 60.0  # seconds a side that failed has to be restarted (a Prefect retry) before the other fails too


@contextlib.contextmanager
def beating(*paths: Path) -> Iterator[None]:
    """Touch `paths` every BEAT_EVERY seconds while the block runs (a thread: a side busy loading a model or in
    a long step still shows it is alive); a dead process stops touching them."""
    stop = threading.Event()

    def touch() -> None:
        while True:
            for path in paths:
                with contextlib.suppress(OSError):
                    path.touch()
            if stop.wait(BEAT_EVERY):
                return

    t = threading.Thread(target=touch, name=f"beat {paths[0].name}", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


@contextlib.contextmanager
def reporting(path: Path) -> Iterator[None]:
    """A failure of the block is written to `path` (the other side, waiting on this one, fails on it once no new
    run of this side has cleared it for ERROR_GRACE seconds); a start clears an earlier run's."""
    path.unlink(missing_ok=True)
    try:
        yield
    except BaseException as e:
        with contextlib.suppress(OSError):
            atomic_write_text(path, f"{type(e).__name__}: {e}"[:4000])
        raise


@contextlib.contextmanager
def alone(path: Path) -> Iterator[None]:
    """Hold `path` (an flock, dropped by the kernel however the holder dies) while the block runs: a second
    producer of the same part of a spool fails at once instead of writing its windows beside the first."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise RuntimeError(f"{path.parent}: {path.stem} is already running ({f.read().strip() or 'pid ?'}); "
                               "wait for it, or end it first") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        yield


def silent_for(path: Path, since: float) -> float:
    """Seconds since `path` was last touched (or since `since`, when it never was)."""
    try:
        return time.time() - max(path.stat().st_mtime, since)
    except FileNotFoundError:
        return time.time() - since


class Waiter:
    """Waits for a condition while the other side lives: raises once its beat file `other` has been silent
    `wait_s` seconds, or once an error file matching `errors` (default: the beat's own) stays ERROR_GRACE."""

    def __init__(self, root: Path, other: str, wait_s: float, what: str, errors: str | None = None):
        self.beat, self.wait_s, self.what, self.since = root / other, wait_s, what, time.time()
        self.errors = errors or self.beat.with_suffix(".error").name

    def __call__(self, ready: Callable[[], Any]) -> Any:
        t0 = told = time.time()
        while not (got := ready()):
            if time.time() - told >= SAY_EVERY:  # a wait is never silent: the log shows who waits on whom
                told = time.time()
                print(f"{self.beat.parent}: waiting for {self.what} ({told - t0:.0f} s; the {self.beat.stem} was "
                      f"last seen {silent_for(self.beat, self.since):.0f} s ago)", file=sys.stderr, flush=True)
            for error in self.beat.parent.glob(self.errors):
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - error.stat().st_mtime > min(self.wait_s, ERROR_GRACE):
                        raise RuntimeError(f"{self.beat.parent}: waited for {self.what}, but the {error.stem} failed "
                                           f"({error.name}): {error.read_text()}")
            quiet = silent_for(self.beat, self.since)
            if quiet > self.wait_s:
                raise RuntimeError(f"{self.beat.parent}: waited for {self.what}, but the {self.beat.stem} has shown no "
                                   f"sign of life for {quiet:.0f} s ({self.beat.name}); is it running?")
            time.sleep(POLL)
        return got
