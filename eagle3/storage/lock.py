"""Run-directory locks: one writer per directory, the holder named, a dead holder's lock recovered.

The lock is `fcntl.flock` on `<dir>/.eagle3.lock`. The kernel drops it when the holding process
dies, however it dies (SIGKILL included), so a stale lock never needs guessing from a pid. The
file also records the holder (pid, host, start time, command) so a refused run can name it.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

LOCK_NAME = ".eagle3.lock"


class LockedError(RuntimeError):
    """Another live process holds the directory."""


class RunLock:
    def __init__(self, directory: str | Path, wait_s: float = 0.0):
        self.dir = Path(directory)
        self.wait_s = wait_s
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _read(fd)
                    os.close(fd)
                    raise LockedError(
                        f"{self.dir} is in use by pid {holder.get('pid')} on {holder.get('host')} since "
                        f"{holder.get('started')} ({holder.get('cmd', '?')}); wait for it or use another directory"
                    ) from None
                time.sleep(0.5)
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "cmd": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
