"""Content fingerprints and file hashes, with a per-host stamp cache so a file is hashed once per identity.

A stamp is written atomically (storage/atomic.py); the digest of a file is trusted only while its
identity (path, size, mtime, ctime, inode, device) is the one it was hashed under.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from eagle3.runtime import stop
from eagle3.storage.atomic import atomic_write_json

_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cache_dir() -> Path:
    """This host's eagle3 cache: $EAGLE3_CACHE_DIR, default ~/.cache/eagle3."""
    return Path(os.environ.get("EAGLE3_CACHE_DIR") or Path.home() / ".cache" / "eagle3")


def _identity(p: Path) -> dict[str, Any]:
    """What changes whenever a file's bytes may have: size, mtime, inode, device, and ctime -- which
    no user can set (`touch -d` restores an mtime, not a ctime), and which a rewrite, rename-over,
    chmod or new hard link all move."""
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino, "dev": st.st_dev}


def sha256_file_cached(path: str | os.PathLike, rehash: bool = False) -> str:
    """sha256_file, computed once per file identity (path, size, mtime, ctime, inode, device) per host.

    The digest is kept as a stamp under `cache_dir()/sha256/`, one small file per file identity, so
    the 8 ranks of a trainer (or a retry, or the next run) that verify the same 1 TiB of hidden-state
    shards hash each shard once, not 8 times on every start. Ranks that ask at the same moment
    wait on a per-file lock while one of them hashes. Any change to the file changes its identity
    and so re-hashes it; `rehash=True` (`eagle3 verify --deep`) re-reads every byte regardless,
    which is what finds bit rot under an unchanged identity.
    """
    p = Path(path).resolve()
    ident = _identity(p)
    name = sha256_bytes(json.dumps(ident, sort_keys=True).encode())
    stamps = cache_dir() / "sha256" / name[:2]
    stamp = stamps / f"{name}.json"

    def known() -> str | None:
        try:
            rec = json.loads(stamp.read_text())
        except (OSError, ValueError):
            return None
        return rec.get("sha256") if {k: rec.get(k) for k in ident} == ident else None

    if not rehash and (digest := known()):
        return digest
    try:
        stamps.mkdir(parents=True, exist_ok=True)
        lock = os.open(stamps / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:  # a read-only home is no reason to fail a run: hash without remembering
        return sha256_file(p)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process hashing this file: wait for its stamp
        if not rehash and (digest := known()):
            return digest
        digest = sha256_file(p)
        if _identity(p) == ident:  # unchanged while it was read: the digest belongs to this identity
            with contextlib.suppress(OSError), stop.unrecorded():
                atomic_write_json(stamp, {**ident, "sha256": digest})
        return digest
    finally:
        # Unlinked while still held: a process already waiting on it (or opening a new one) then
        # finds the stamp before hashing, so at worst a failed hash is repeated, never a wrong one.
        with contextlib.suppress(OSError):
            os.unlink(stamps / f"{name}.lock")
        os.close(lock)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    """Fingerprint of a JSON-able object, independent of key order."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())
