"""Fault drills: EAGLE3_FAIL_ONCE="<stage>:<marker file>" makes that stage fail once, midway.

Operators use it to rehearse the 3 a.m. case (a stage dies, Prefect retries it, the retry
resumes from what was committed); tests use it to prove exactly that. The marker file records
that the fault fired, so the retry, and every later run, proceeds.
"""
from __future__ import annotations

import os
from pathlib import Path


class InjectedFault(RuntimeError):
    """A transient failure raised on purpose by EAGLE3_FAIL_ONCE."""


def fail_once(stage: str) -> None:
    """Raise InjectedFault if EAGLE3_FAIL_ONCE names `stage` and its marker file does not exist yet."""
    name, _, marker = os.environ.get("EAGLE3_FAIL_ONCE", "").partition(":")
    if name != stage or not marker or Path(marker).exists():
        return
    Path(marker).parent.mkdir(parents=True, exist_ok=True)
    Path(marker).write_text(f"{stage} failed here once (pid {os.getpid()})\n")
    raise InjectedFault(f"{stage}: injected transient failure (EAGLE3_FAIL_ONCE, marker {marker})")
