"""Deterministic kill points: prove that a SIGKILL at the worst moment loses nothing.

    EAGLE3_KILL_AT="<point>[@<path part>]:<n>"   SIGKILL this process the n-th time <point> is
                                                 reached (counting only hits whose path contains
                                                 <path part>, when one is given)
    EAGLE3_KILL_MARKER=<file>                    optional: fire only while <file> does not exist, and
                                                 create it just before dying (so a retry survives)
    EAGLE3_KILL_RANK=<r>                         optional: fire only in the process whose RANK (set by
                                                 torchrun) is r; unset, every process counts its own hits

Points, each at a moment where a crash could lose or corrupt work:

    extract.batch      the hf backend finished a forward batch (its samples are not committed yet)
    file.writing       inside a tensor file's write: one piece of a safetensors file (its header, then
                       at most 64 MiB of data) or one record of a torch.save is on disk, the rest is not
    file.written       an atomic file write: the temp file is complete, not yet renamed
    file.renamed       ... renamed into place; the caller has not recorded it anywhere yet
    dir.written        an atomic dir write (a checkpoint): every file written, not yet swapped in
    dir.renamed        ... swapped in; the old one not yet removed
    train.step         an optimizer step finished (a torch optimizer post-hook: no trainer code)

Examples: `file.written@shards/:3` (the 3rd hidden-state shard, before its rename),
`file.writing@shards/:7` (a bf16 shard is 5 pieces: header, ids, aux, final, mask -- so the 2nd
shard with its header and ids on disk and its states not),
`file.writing@state.pt:3` (the 3rd record of the first checkpoint's optimizer state),
`file.written@meta.json:2` (inside the 2nd checkpoint save: weights and optimizer state are
written, its meta.json is not), `train.step:5`. Unset, `point` is one `None` check.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

ENV, MARKER_ENV, RANK_ENV = "EAGLE3_KILL_AT", "EAGLE3_KILL_MARKER", "EAGLE3_KILL_RANK"
POINTS = ("extract.batch", "file.writing", "file.written", "file.renamed", "dir.written", "dir.renamed", "train.step")


def parse(spec: str | None) -> tuple[str, str, int] | None:
    """'point[@part]:n' -> (point, part, n); ValueError for a malformed spec (a silent no-op would
    make a fault drill pass without ever firing)."""
    if not spec:
        return None
    where, _, n = spec.rpartition(":")
    name, _, part = where.partition("@")
    if name not in POINTS or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{ENV}={spec!r}: expected '<point>[@<path part>]:<n>' with n >= 1 and a point in {POINTS}")
    return name, part, int(n)


_SPEC = parse(os.environ.get(ENV))
if _SPEC is not None and os.environ.get(RANK_ENV, os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    _SPEC = None  # another rank is the one to kill
_hits = 0


def point(name: str, path: str | os.PathLike = "") -> None:
    """Count a hit of kill point `name` (at `path`); SIGKILL this process on the chosen hit."""
    global _hits
    if _SPEC is None or _SPEC[0] != name or _SPEC[1] not in str(path):
        return
    _hits += 1
    if _hits != _SPEC[2]:
        return
    marker = os.environ.get(MARKER_ENV)
    if marker:
        if Path(marker).exists():
            return
        Path(marker).write_text(f"{name}@{path}:{_hits} pid {os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _install_step_hook() -> None:
    # A global optimizer post-hook counts optimizer steps without a line of fault code in the trainer.
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(lambda opt, args, kwargs: point("train.step"))


if _SPEC is not None and _SPEC[0] == "train.step":
    _install_step_hook()
