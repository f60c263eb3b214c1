"""Keep freed memory in the process heap instead of handing it back to the OS after every step.

Why: every CPU stage allocates and frees the same large tensors over and over (a training step's
[L, Vd] logits and activations, an extraction batch's [B, T, H] states). glibc serves any block
above its mmap threshold (128 KiB, rising to at most 32 MiB) with a fresh mmap and returns it on
free, and gives the top of the heap back above its trim threshold; either way the next step
touches new pages and the kernel zero-fills them on first touch: millions of page faults per
extraction batch, a large share of its CPU time in the kernel. With both thresholds raised the
blocks are reused in place, faster for a few hundred MB more peak RSS (`benchmarks/speed/heap.py`; the
figures: benchmarks/RESULTS.md, heap).

This is what jemalloc / tcmalloc give torch CPU workloads, with nothing to install. glibc only;
elsewhere (macOS, musl) nothing is changed. Process-wide and idempotent: each CPU-heavy stage
calls `retain_freed_memory()` as it starts. `EAGLE3_HEAP=release` keeps glibc's defaults and has
`release()` hand the freed heap back at each training step (a host short of RAM, where returning
memory matters more than speed; this was the trainer's behaviour before).

`trim()` hands the freed heap back at the end of a phase whose buffers will not be reused (a decoded
batch: its KV cache). `PeakRSS` measures a block's peak resident memory (the pipeline logs it per stage).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import resource
import sys

log = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap and stay there once freed: above the largest tensor a
# step allocates (a 2048-token row's [L, 32000] fp32 logits are 262 MB; a 16k-token extraction
# batch's [B*T, 1536] MLP activations 100 MB). Bigger ones are still mmapped and returned.
_RETAIN_BYTES = 1 << 30

_state: str | None = None  # None: not tried yet; else "retain", "release" (opted out) or "unavailable"


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def retain_freed_memory() -> str:
    """Raise glibc's mmap and trim thresholds to 1 GiB (once per process); returns the state."""
    global _state
    if _state is not None:
        return _state
    if os.environ.get("EAGLE3_HEAP", "retain") == "release":
        _state = "release"
        return _state
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc
        _state = "unavailable"
        return _state
    # glibc rejects an mmap threshold above its own cap on some builds: then the cap is the best it allows
    ok = any(mallopt(_M_MMAP_THRESHOLD, v) for v in (_RETAIN_BYTES, 32 << 20))
    ok = mallopt(_M_TRIM_THRESHOLD, _RETAIN_BYTES) and ok
    _state = "retain" if ok else "unavailable"
    if not ok:
        log.debug("heap: glibc refused the mmap/trim thresholds; its defaults stay")
    return _state


# retain mode: trim once every this many `release()` calls (steps), bounding how far RSS can drift
_TRIM_EVERY = 16
_calls = 0


def release() -> None:
    """Called between steps: by the trainer after each optimizer step, by extraction after each batch.

    release mode: give the heap's free memory back to the OS now (glibc's malloc_trim, ~1 ms).
    retain mode: the same, once every 16 calls. Retained blocks do not always fit the next request:
    torch asks for 64-byte aligned blocks, so a freed block of exactly the size asked for again is too
    small and the heap grows past it. Blocks of varying sizes (real steps) get reused, but one 64 MiB
    size allocated over and over grew RSS by 64 MiB nearly every round (283 -> 731 MB in 10 rounds).
    A trim every 16 steps bounds that drift and costs 1/16 of the page faults of trimming every step."""
    global _calls
    if _state == "retain":
        _calls += 1
        if _calls % _TRIM_EVERY:
            return
    elif _state != "release":
        return
    trim()


def trim() -> None:
    """Hand the heap's free pages back to the OS now (glibc's malloc_trim, which also releases whole free
    pages inside the heap); for the end of a phase whose buffers will not be reused, whatever the mode."""
    fn = getattr(_libc(), "malloc_trim", None)
    if fn is not None:
        fn(0)


class PeakRSS:
    """Peak resident memory of a block of code, in bytes: this process's (`own`) and its children's.

    `own`: Linux lets a process reset its high-water mark (writing 5 to /proc/self/clear_refs sets
    VmHWM to the current RSS), so stages run one after another in one process each get their own
    peak; it includes what earlier blocks left resident (the heap kept by `retain_freed_memory`, the
    imported libraries), as the OS sees it. Where that is refused (not Linux, or no /proc) `own` is
    the process's lifetime peak and `own_reset` is False. `children`: the largest resident set of any
    child process that ended inside the block (torchrun's workers, a replay-set subprocess), from
    RUSAGE_CHILDREN, which only ever grows: None when no child inside the block beat an earlier child's."""

    def __enter__(self) -> "PeakRSS":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.own_reset = True
        except OSError:
            self.own_reset = False
        self._children0 = _maxrss(resource.RUSAGE_CHILDREN)
        return self

    def __exit__(self, *exc) -> None:
        hwm = proc_bytes("/proc/self/status", "VmHWM") if self.own_reset else None
        self.own: int = hwm if hwm is not None else _maxrss(resource.RUSAGE_SELF)
        c = _maxrss(resource.RUSAGE_CHILDREN)
        self.children: int | None = c if c > self._children0 else None

    def line(self) -> str:
        """'peak RSS 6.95 GiB (subprocesses 2.10 GiB)', for a stage's log line."""
        s = f"peak RSS {self.own / 2**30:.2f} GiB" + ("" if self.own_reset else " (process lifetime)")
        return s + (f" (subprocesses {self.children / 2**30:.2f} GiB)" if self.children else "")


def _maxrss(who: int) -> int:
    """ru_maxrss in bytes (Linux reports KiB, macOS bytes)."""
    r = resource.getrusage(who).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def proc_bytes(path: str, key: str) -> int | None:
    """A `key:  N kB` line of a /proc file (status, meminfo) in bytes; None without /proc or the key."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
