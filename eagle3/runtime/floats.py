"""Denormal floats on the CPU: flushed to zero while a CPU stage trains.

Why: an x86 core computes with a denormal operand or result (|x| < 1.18e-38 in fp32) through a microcode
assist that costs tens to hundreds of cycles instead of one. Training makes them: as the draft sharpens, its
softmax probabilities, their gradients and AdamW's second moments of rarely-hit rows fall under that bound, and
every matmul that reads them slows down. On an Intel Xeon host the trainer on its own step-400 weights ran at
~650 tok/s against ~1,400 at step 0 on the same packs; with flush-to-zero and denormals-are-zero set (and the
attention's exp kept off the denormal range: eagle3/model/attention.py `exp_`) it ran at ~1,400 again
(`python -m benchmarks.speed.denormals`). The values lost are under 1.2e-38: below float32's resolution
against any sum or update they join.

The mode lives in each thread's floating-point control register, and a thread inherits it from the thread that
starts it. torch's OpenMP workers are started at its first parallel op, so a process that sets the mode
before that (a torchrun worker's first act) has it on every thread; set later, it holds on the calling thread
and on the workers started after.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def denormals_flushed() -> Iterator[bool]:
    """Flush-to-zero and denormals-are-zero on this thread (and the threads it starts) inside the block, back to
    the IEEE default on this thread after it; threads started inside keep the mode (torch's pool outlives the
    block). Yields whether the CPU supports the mode (x86 with SSE3, arm64); a no-op elsewhere."""
    ok = torch.set_flush_denormal(True)
    try:
        yield ok
    finally:
        if ok:
            torch.set_flush_denormal(False)
