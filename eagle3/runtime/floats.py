"""Floating point on the CPU: denormal floats never made by the trainer's exp (`exp_`) and flushed to zero while
it trains (`denormals_flushed`); whether the CPU has bf16 units (`cpu_bf16`), the trainer's autocast
(`autocast`) and the target's compute dtype (`resolve_compute_dtype`).

Why: an x86 core computes with a denormal operand or result (|x| < 1.18e-38 in fp32) through a microcode
assist that costs tens to hundreds of cycles instead of one. Training makes them: as the draft sharpens, its
softmax probabilities, their gradients and AdamW's second moments of rarely-hit rows fall under that bound, and
every matmul that reads them slows down. On an Intel Xeon host the trainer on its own step-400 weights ran at
716 tok/s against 1,429 at step 0 on the same packs; with both fixes here it ran at 1,379
(`python -m benchmarks.speed.denormals`). The values lost are under 1.2e-38: below float32's resolution
against any sum or update they join.

exp(x) under x = ln(FLT_MIN) = -87.34 is a denormal float, or 0, and torch's CPU exp (2.13, AVX-512) takes a slow
path for every such lane, -inf included: 60-350 M/s against ~6,000 M/s. The TTT attention's scores minus their max
(and its -inf masks) and the loss's log-probabilities fall there in most lanes once the draft sharpens; `exp_`
keeps them off that path. (`torch.softmax`, `log_softmax` and SDPA have their own exp and keep their speed.)

The flush mode lives in each thread's floating-point control register, and a thread inherits it from the thread that
starts it. torch's OpenMP workers are started at its first parallel op, so a process that sets the mode
before that (a torchrun worker's first act) has it on every thread; set later, it holds on the calling thread
and on the workers started after.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

EXP_FLOOR = -87.0  # exp: 1.65e-38, a normal float32
EXP_FLUSH = 2e-38  # results at or under it become 0: exp(EXP_FLOOR) whatever its last bit, and e^-86.8 and below


def exp_(x: torch.Tensor) -> torch.Tensor:
    """x.exp_() with every result at or under 2e-38 (x <= -86.8) set to 0, as a flush-to-zero unit would: the
    same values as exp to float32's resolution against any sum of probabilities they join (its largest term is
    1), without the CPU's slow path. Other devices: plain exp_ (GPUs do denormals at full speed). Returns x."""
    if x.device.type != "cpu":
        return x.exp_()
    # clamp, exp, flush: three passes at 4-6 G elements/s, against one at 0.06-0.35 G where the lanes underflow
    return torch.nn.functional.threshold_(x.clamp_(min=EXP_FLOOR).exp_(), EXP_FLUSH, 0.0)


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


@functools.cache
def cpu_bf16() -> bool:
    """This CPU has bf16 matmul units: `avx512_bf16` (AMD Zen 4, Intel Cooper Lake on) or AMX (`amx_bf16`, Intel
    Sapphire Rapids on), as /proc/cpuinfo flags them. With them oneDNN runs bf16 matmuls 2-2.6x faster than fp32
    (`python -m benchmarks.speed.train --bf16`); without them it emulates bf16 and runs it slower than fp32."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """`auto` -> "bf16" on CUDA, "fp32" elsewhere; `fast` -> "bf16" on CUDA and on a CPU with bf16 units
    (`cpu_bf16`), "fp32" elsewhere; "bf16" / "fp32" as given."""
    kind = torch.device(device).type
    if precision == "auto":
        return "bf16" if kind == "cuda" else "fp32"
    if precision == "fast":
        return "bf16" if kind == "cuda" or (kind == "cpu" and cpu_bf16()) else "fp32"
    return precision


def resolve_compute_dtype(choice: str, device: torch.device | str) -> str:
    """A target's compute dtype setting (extract, regenerate) -> "float32" or "bfloat16": `auto` and `fast` as in
    `resolve_precision`, "float32" / "bfloat16" as given."""
    if choice in ("float32", "bfloat16"):
        return choice
    return {"bf16": "bfloat16", "fp32": "float32"}[resolve_precision(choice, device)]


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The trainer's compute context: bf16 autocast of the matmuls on `device` for "bf16" (resolved), else none.
    Reused for every step (an autocast object can be entered again once exited)."""
    if resolve_precision(precision, device) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()
