"""Where a regeneration stands in its output dir: progress.json (the committed length of regenerated.jsonl and
the counters, replaced atomically after each chunk), the chunk commit itself, and the index of earlier outputs
whose lines are copied instead of regenerated (`reuse` dirs, and this dir's previous file when the source or the
limit changed). See eagle3/regenerate/run.py for the record format and the resume contract."""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.storage.atomic import atomic_write_json, clean_temp_files, fsync_dir
from eagle3.storage.manifests import MANIFEST, RegeneratedData

OUT_FILE = "regenerated.jsonl"
PROGRESS = "progress.json"
PREVIOUS = ".previous.jsonl"  # this dir's earlier output, kept as a reuse source until the run ends
FORMAT = 1  # of the JSONL records and of progress.json
_EXAMPLES = 3  # record ids kept per skip reason


@dataclass
class State:
    """What progress.json holds: enough to continue a killed run at the next chunk."""

    signature: str
    bytes: int = 0
    records_read: int = 0
    records_written: int = 0
    turns_written: int = 0
    turns_cut: int = 0
    shortened: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, list[str]] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    format: int = FORMAT

    def skip(self, rid: str, reason: str, detail: str = "") -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        ex = self.skip_examples.setdefault(reason, [])
        if len(ex) < _EXAMPLES:
            ex.append(f"{rid}: {detail}" if detail else rid)



class ReuseIndex:
    """key -> (file, byte offset, length) over earlier regenerated JSONL files; lines read on demand."""

    def __init__(self) -> None:
        self.where: dict[str, tuple[Path, int, int]] = {}

    def add_file(self, path: Path, limit: int | None = None) -> int:
        n = 0
        with open(path, "rb") as f:
            off = 0
            for line in f:
                if limit is not None and off + len(line) > limit:
                    break
                try:
                    key = json.loads(line)["provenance"]["key"]
                except (ValueError, KeyError, TypeError):
                    key = None  # not one of ours, or torn: ignored
                if isinstance(key, str) and key not in self.where:
                    self.where[key] = (path, off, len(line))
                    n += 1
                off += len(line)
        return n

    def add_dir(self, d: str | Path) -> int:
        """An earlier output dir (finished, or the committed part of an unfinished one)."""
        d = Path(d)
        f = d / OUT_FILE
        if not f.is_file():
            raise ValueError(f"--reuse {d}: no {OUT_FILE} (not a regenerate output dir)")
        limit = None if (d / MANIFEST).is_file() else _committed_bytes(d / PROGRESS)
        return self.add_file(f, limit)

    def get(self, key: str) -> dict[str, Any] | None:
        hit = self.where.get(key)
        if hit is None:
            return None
        path, off, n = hit
        try:  # the file may have been rewritten since it was indexed: then the key check fails
            with open(path, "rb") as f:
                f.seek(off)
                rec = json.loads(f.read(n))
        except (OSError, ValueError):
            return None
        return rec if isinstance(rec, dict) and rec.get("provenance", {}).get("key") == key else None



def _committed_bytes(progress: Path) -> int:
    """Length of the committed part of an unfinished output (0 when unknown)."""
    try:
        return int(json.loads(progress.read_text()).get("bytes", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0



def _open_state(out: Path, signature: str, reuse: ReuseIndex) -> State:
    """Continue a run with the same signature, or start over keeping the old output as a reuse source."""
    f, prog, prev = out / OUT_FILE, out / PROGRESS, out / PREVIOUS
    if prog.is_file():
        try:
            st = State(**json.loads(prog.read_text()))
        except (ValueError, TypeError):
            st = None
        if st is not None and st.signature == signature and st.format == FORMAT and f.is_file() \
                and f.stat().st_size >= st.bytes:
            with open(f, "rb+") as fh:  # drop a chunk that was appended but never committed
                fh.truncate(st.bytes)
                os.fsync(fh.fileno())
            if prev.is_file():
                reuse.add_file(prev)
            return st
    # A different run (or none) was here: what it committed may still be reused.
    finished = (out / MANIFEST).is_file()
    (out / MANIFEST).unlink(missing_ok=True)  # first: a manifest must never describe a file being replaced
    if f.is_file():
        size = f.stat().st_size
        committed = size if finished else min(_committed_bytes(prog), size)
        if committed > 0:
            with open(f, "rb+") as fh:
                fh.truncate(committed)
                os.fsync(fh.fileno())
            os.replace(f, prev)  # replaces an even older .previous.jsonl: this one has all we kept
        else:
            f.unlink()
    if prev.is_file():
        reuse.add_file(prev)
    st = State(signature=signature)
    atomic_write_json(prog, st.__dict__)  # before the empty file: a crash in between starts over cleanly
    f.write_bytes(b"")
    return st



def finished(out: Path, fp: dict[str, Any]) -> RegeneratedData | None:
    """The manifest in `out` if it was written for exactly these inputs (`fp`, see `inputs`) and its output
    file is there, else None."""
    if (out / MANIFEST).is_file():
        try:
            done = RegeneratedData.read(out)
            if done.inputs == fp and (out / OUT_FILE).is_file():
                return done
        except ValueError:
            pass
    return None



def resume(out: Path, signature: str, reuse: Sequence[str | Path]) -> tuple[State, ReuseIndex]:
    """Open `out` for the run named by `signature`: the committed state to continue from (see `_open_state`)
    and the index of earlier outputs (`reuse` dirs, other than `out` itself) whose lines can be copied."""
    out.mkdir(parents=True, exist_ok=True)
    clean_temp_files(out)
    index = ReuseIndex()
    for d in reuse:
        if Path(d).resolve() != out.resolve():
            index.add_dir(d)
    return _open_state(out, signature, index), index



def commit(out: Path, st: State, lines: list[bytes]) -> None:
    """Append a chunk's lines (fsynced), then record the new committed length atomically."""
    data = b"".join(lines)
    with open(out / OUT_FILE, "ab") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    st.bytes += len(data)
    atomic_write_json(out / PROGRESS, st.__dict__)
    fsync_dir(out)
