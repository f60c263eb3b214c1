"""Atomic file and directory writes (fingerprints and file hashes: storage/hashing.py).

Every stage writes through these helpers: a file is written to a temp path in the same
directory, fsynced, then renamed over its final name, so a reader (or a resumed run)
sees either the old file, the new file, or nothing -- never half a file.

A write that fails because the disk is full raises `DiskFullError`, naming the file and the
free space, after removing its temp file: a full disk leaves no half-written output behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from eagle3.runtime import stop
from eagle3.storage.faults import point

_CHUNK = 1 << 20
_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_dir(path: str | os.PathLike) -> None:
    """Persist a rename: fsync the directory entry (no-op where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class DiskFullError(OSError, ValueError):
    """No space left for a write. A ValueError too (like io.UnsupportedOperation is both), so every
    entry point reports it in one line; and retrying without freeing space cannot help."""


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _disk_full(e: BaseException, where: Path) -> bool:
    """Did `e` come from a full disk? Libraries word it differently: OSError(ENOSPC), safetensors'
    "os error 28", and torch.save's bare "unexpected pos" -- so the free space decides too."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left" in str(e) or "os error 28" in str(e):
        return True
    if isinstance(e, ValueError):  # a refused input, whatever the disk holds
        return False
    with contextlib.suppress(OSError):
        return _free_bytes(where) < 1 << 20
    return False


def _raise_if_disk_full(e: BaseException, final: Path) -> None:
    if isinstance(e, DiskFullError) or not isinstance(e, Exception) or not _disk_full(e, final.parent):
        return
    free = _free_bytes(final.parent)
    raise DiskFullError(
        errno.ENOSPC,
        f"no space left on device writing {final} ({free / (1 << 20):,.1f} MiB free under {final.parent}); "
        f"the partial output was removed and committed work is kept: free some space (or use another "
        f"directory) and rerun the same command",
    ) from e


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `final`; on success fsync and rename it to `final`.

    On any exception the temp file is removed and `final` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        with stop.temp(tmp):  # a second Ctrl-C removes it before exiting
            yield tmp
            os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; the final file gets the usual mode
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            point("file.written", final)
            os.replace(tmp, final)
        fsync_dir(final.parent)
        stop.committed(final)
        point("file.renamed", final)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        _raise_if_disk_full(e, final)
        raise


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp dir beside `final`; on success it replaces `final` (an older one is removed).

    An existing `final` is swapped with the new dir in one atomic exchange, so a kill at any
    moment leaves `final` old or new, never missing (removing it first and then renaming lost a
    `best` checkpoint to a kill between the two). A killed writer leaves only a `.NAME.*.tmp` dir,
    which `clean_temp_files` removes.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        with stop.temp(tmp):  # a second Ctrl-C removes it before exiting
            yield tmp
            tmp.chmod(0o777 & ~_UMASK)
            point("dir.written", final)
            swapped = final.exists() and _exchange(tmp, final)
            if not swapped:
                if final.exists():
                    shutil.rmtree(final)
                tmp.rename(final)
        stop.committed(final)
        point("dir.renamed", final)
        if swapped:
            shutil.rmtree(tmp)  # now the old dir
        fsync_dir(final.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_if_disk_full(e, final)
        raise


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd = -100
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append to a log file; a full disk raises DiskFullError naming it (a torn last line is the
    reader's to skip: appends are not atomic)."""
    path = Path(path)
    try:
        with open(path, "a") as f:
            f.write(text)
    except OSError as e:
        if _disk_full(e, path.parent):
            free = _free_bytes(path.parent)
            raise DiskFullError(errno.ENOSPC, f"no space left on device appending to {path} ({free / (1 << 20):,.1f} "
                                f"MiB free under {path.parent}); free some space and rerun the same command") from e
        raise


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> None:
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(final: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(final, text.encode("utf-8"))


def atomic_write_json(final: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(final, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


# ---------------------------------------------------------------- tensor files, written piece by piece
# Both writers pass every piece through `point("file.writing", path)`, so a fault drill can kill the
# process while a tensor file is half on disk (inside the write itself, not only before its rename).
_PIECE = 64 << 20
# torch dtype -> (safetensors name, rank in safetensors' Dtype enum: its writer orders tensors by
# that rank, descending, then by name -- largest elements first, so every tensor starts aligned)
_ST = {"bool": ("BOOL", 0), "uint8": ("U8", 4), "int8": ("I8", 5), "float8_e5m2": ("F8_E5M2", 6),
       "float8_e4m3fn": ("F8_E4M3", 7), "int16": ("I16", 9), "float16": ("F16", 11), "bfloat16": ("BF16", 12),
       "int32": ("I32", 13), "float32": ("F32", 15), "float64": ("F64", 16), "int64": ("I64", 17)}


def write_safetensors(path: str | os.PathLike, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """`tensors` (contiguous CPU tensors) as a safetensors file at `path` (write it to a temp path).

    The bytes of safetensors' own `save_file` (tested): an 8-byte little-endian header length, the
    JSON header (dtype, shape, data_offsets per tensor, optional `__metadata__` of strings) padded
    with spaces to a multiple of 8, then the data in safetensors' order. The data come straight from
    the tensors' memory in pieces of at most 64 MiB: no serialized copy of the file is ever built.
    """
    import struct

    import torch

    def dt(k: str) -> tuple[str, int]:
        return _ST[str(tensors[k].dtype).removeprefix("torch.")]

    order = sorted(tensors, key=lambda k: (-dt(k)[1], k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for k in order:
        t = tensors[k]
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{path}: tensor {k} must be a contiguous CPU tensor")
        n = t.numel() * t.element_size()
        header[k] = {"dtype": dt(k)[0], "shape": list(t.shape),
                     "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        point("file.writing", path)
        for k in order:
            raw = tensors[k].reshape(-1).view(torch.uint8).numpy()  # a view of the tensor's bytes
            for a in range(0, raw.size, _PIECE):
                f.write(memoryview(raw[a:a + _PIECE]))
                point("file.writing", path)


class _Pieces:
    """A binary file whose every write is a `file.writing` point (torch.save writes one record per call)."""

    def __init__(self, f, path: str | os.PathLike):
        self.f, self.path = f, path
        self.error: OSError | None = None

    def write(self, b) -> int:
        try:
            n = self.f.write(b)
        except OSError as e:  # torch's C++ writer reports it as a bare "unexpected pos": keep the cause
            self.error = e
            raise
        point("file.writing", self.path)
        return n

    def flush(self) -> None:
        self.f.flush()


def write_torch(path: str | os.PathLike, obj: Any) -> None:
    """torch.save(obj) to `path` (write it to a temp path), record by record through `_Pieces`."""
    import torch

    with open(path, "wb") as f:
        w = _Pieces(f, path)
        try:
            torch.save(obj, w)
        except Exception as e:
            if w.error is not None:
                raise w.error from e  # ENOSPC stays ENOSPC
            raise


def clean_temp_files(directory: str | os.PathLike) -> int:
    """Remove leftovers of killed writers (`.NAME.*.tmp`); returns how many were removed."""
    n = 0
    d = Path(directory)
    if not d.is_dir():
        return 0
    for p in d.glob(".*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
            n += 1
    return n


def read_json_object(path: str | os.PathLike, what: str = "a JSON object") -> dict[str, Any]:
    """The JSON object in file `path` (which must exist). Bad UTF-8 or JSON, or another top-level value, is a
    ValueError naming the file: `what` says what the object should have been."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON {type(data).__name__}, not {what}")
    return data
