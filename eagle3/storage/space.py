"""Disk space and sizes, for the checks that refuse a write that cannot fit (the preflight before a run, extraction
before its shards)."""
from __future__ import annotations

import shutil
from pathlib import Path

GIB = 1 << 30


class PreflightError(ValueError):
    """A stage cannot finish with the resources at hand."""


def disk_free(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def human(b: float) -> str:
    if b >= 1 << 40:
        return f"{b / (1 << 40):,.2f} TiB"
    return f"{b / GIB:,.2f} GiB" if b >= GIB / 10 else f"{b / (1 << 20):,.1f} MiB"
