"""A clean stop on SIGINT (Ctrl-C) and SIGTERM (`kill`, a scheduler, a Prefect worker being stopped).

The first signal raises `Stopped` in the main thread, so the work unwinds like any error: every atomic
write removes its temp file, the run dir's lock is released, child processes (torchrun and its ranks,
`eagle3 replay-set`) get SIGTERM and then, after `GRACE_S`, SIGKILL, and the command prints one line
naming the signal and the last file it committed. What was committed stays, so the same command resumes
from there. A second signal while that unwinds stops at once: the live temp files are removed, the
children are SIGKILLed, and the process exits 128 + the signal's number, leaving nothing half-written.

`STOP` is also set when a flow's main thread unwinds from any stop (Prefect raises its own
`TerminationSignal` for SIGTERM inside a flow run), so a child started by a task on another thread
is stopped too instead of holding the process open.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

GRACE_S = 20.0  # a child's time to stop after SIGTERM (torchrun gives its ranks its own 30 s at most)
STOP = threading.Event()

_temps: set[Path] = set()      # atomic writes in progress: removed by a hard stop
_children: dict[int, tuple[Path, ...]] = {}  # a running child's process group -> the dirs it writes: on a hard
# stop the group is SIGKILLed, then the `.*.tmp` files it left there are removed
_last: list[str] = []          # the last file or dir committed by an atomic write


class Stopped(BaseException):
    """A stop was asked for by a signal. A BaseException, like KeyboardInterrupt, so no `except Exception`
    treats it as a failure to retry or to skip past."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Stop cleanly on SIGINT and SIGTERM while in this block (the main thread of a command or a rank); the
    handlers before it are restored after."""
    before = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _on_signal(signum: int, frame) -> None:
    if STOP.is_set():
        hard_exit(signum)
    STOP.set()
    raise Stopped(signum)


def hard_exit(signum: int) -> None:
    """Remove the temp files of writes in progress, SIGKILL the children, exit 128 + signum now."""
    for p in list(_temps):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    for pg, dirs in list(_children.items()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pg, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(pg, 0)
        for d in dirs:
            for p in Path(d).rglob(".*.tmp"):
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    os._exit(128 + signum)


def exit_code(e: BaseException) -> int:
    """128 + the signal's number, as a shell reports a process ended by it (SIGINT: 130, SIGTERM: 143)."""
    signum = getattr(e, "signum", None) or getattr(e, "signal", None) or signal.SIGINT
    return 128 + int(signum)


def message(e: BaseException) -> str:
    """One line: the signal, the last file committed, and how to go on."""
    signum = getattr(e, "signum", None) or getattr(e, "signal", None) or signal.SIGINT
    last = f"; the last file committed was {_last[-1]}" if _last else ""
    return (f"stopped by {signal.Signals(int(signum)).name}{last}; committed work is kept and no temp file is "
            f"left: rerun the same command to resume")


@contextlib.contextmanager
def temp(path: Path) -> Iterator[None]:
    """Mark `path` as an atomic write's temp file or dir for the duration of the write."""
    _temps.add(path)
    try:
        yield
    finally:
        _temps.discard(path)


def committed(path: str | os.PathLike) -> None:
    """Record the last file or dir an atomic write put in place (for the stop message)."""
    _last[:] = [str(path)]


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Atomic writes in this block are bookkeeping (a checksum stamp in the cache), not the run's work: the stop
    message keeps naming the last output file."""
    before = list(_last)
    try:
        yield
    finally:
        _last[:] = before


@contextlib.contextmanager
def on_unwind() -> Iterator[None]:
    """Set STOP when the block is left by a stop (ours, KeyboardInterrupt or Prefect's TerminationSignal), so
    children started on other threads are stopped too."""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, Exception):
            STOP.set()
        raise


def run_child(cmd: list[str], on_line: Callable[[str], None] | None = None,
              env: dict[str, str] | None = None, writes: tuple[str | os.PathLike, ...] = ()) -> int:
    """Run `cmd` in a process group of its own (setsid) and return its exit status; its output lines go to
    `on_line` (None: inherited). If this thread is stopped (an exception, `Stopped` included) or STOP is set by
    another thread, the child gets SIGTERM, then its whole process group SIGKILL after GRACE_S, before this
    returns or raises: no rank outlives its parent. `writes`: the dirs the child writes, swept of its temp files
    on a hard stop."""
    pipe = subprocess.PIPE if on_line else None
    p = subprocess.Popen(cmd, stdout=pipe, stderr=subprocess.STDOUT if on_line else None, text=True, bufsize=1,
                         env=env, start_new_session=True)
    _children[p.pid] = tuple(Path(d) for d in writes)
    reader = None
    if on_line:
        reader = threading.Thread(target=lambda: [on_line(ln.rstrip("\n")) for ln in p.stdout], daemon=True)
        reader.start()
    try:
        while p.poll() is None:
            if STOP.is_set():
                raise Stopped(signal.SIGTERM)
            time.sleep(0.1)
        if reader is not None:
            reader.join()
        return p.returncode
    except BaseException:
        _end(p)
        raise
    finally:
        _children.pop(p.pid, None)


def _end(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        p.send_signal(signal.SIGTERM)
    try:
        p.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)  # what the child left behind (its own children) goes too
    p.wait()
