"""Linear layers for few-row CPU inference: oneDNN prepacked weights, swapped in for a block of code.

Why: at batch size 1 a decode step multiplies 1 row, a verify pass k+1 rows, against every weight
of the target. On an x86 CPU with torch's stock fp32 path (MKL sgemm on [out, in] weights) a few
rows cost far more than one: with stock kernels a verify pass costs about 1.5-2x a plain step, which
no draft could win back; prepacked, about one step, as on a GPU (the weights are read once either way;
`benchmarks/speed/cpu_linear.py`, figures in benchmarks/RESULTS.md, cpu_linear). vLLM's own CPU backend does
the same: its unquantized-GEMM dispatch (`vllm/model_executor/layers/utils.py`) prepacks every linear
weight into a oneDNN matmul handler.

`packed_linears(*modules)` replaces every `nn.Linear` inside them, for the duration of a `with`
block, by a `PackedLinear` holding its weight prepacked in oneDNN's blocked layout. Which kernel is
fastest for a few rows depends on the CPU, so for each row count in `rows` (default 1-4: a step and
the verify passes of k <= 3) three are timed on the module's own layers at entry: oneDNN, a plain
GEMV on a transposed copy (`x @ W^T` contiguous) and torch's stock F.linear (the winner differs
between an AMD EPYC and an Intel Xeon host: RESULTS.md, cpu_linear). The plain greedy baseline runs on
its fastest kernel too. Results equal `F.linear` to fp32 rounding (~2e-6), not bitwise: a greedy
argmax near-tie may flip, as between any two kernels.

Inference only (no autograd through the packed copy), fp32 on CPU; anything else is left as is.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator

import torch
from torch import nn

# oneDNN picks its blocked weight layout for an expected row count; 8 serves 1..400 rows here
# (measured 1-6, 16, 32, 64, 400 rows: faster than stock F.linear at every one).
_PACK_ROWS = 8


def available() -> bool:
    """oneDNN's linear ops exist in this torch build (x86 and aarch64 CPU wheels have them)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


KERNELS = ("onednn", "gemv", "stock")


class PackedLinear(nn.Module):
    """An nn.Linear's forward on a oneDNN-prepacked copy of its weight, or, for the row counts that
    `kernel_for` ({rows: one of KERNELS}) maps to "gemv" or "stock", on a GEMV or the stock F.linear."""

    def __init__(self, lin: nn.Linear, gemv: bool = True):
        super().__init__()
        self.linear = lin  # kept: `.weight` stays readable (dtype checks, tied embeddings), and undo is exact
        w = lin.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)
        # [in, out]: the GEMV reads it in rows, one pass; only built when the GEMV may be chosen
        self.wt: torch.Tensor | None = w.t().contiguous() if gemv else None
        self.bias = None if lin.bias is None else lin.bias.detach()
        self.kernel_for: dict[int, str] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kernel = self.kernel_for.get(rows, "onednn")
        if kernel == "gemv":
            y = x @ self.wt
            return y if self.bias is None else y + self.bias
        if kernel == "stock":
            return self.linear(x)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _swappable(m: nn.Module) -> bool:
    return type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32


def _time_kernels(layers: list[PackedLinear], rows: int, rounds: int = 7) -> dict[str, float]:
    """Fastest seconds of one pass of `rows` random rows through every layer, per kernel.

    The kernels alternate pass by pass and the minimum counts: load from other processes only
    ever adds time, so the minimum is the kernel's own cost, and alternation exposes both alike."""
    xs = {n: torch.randn(rows, n) for n in {p.linear.in_features for p in layers}}
    best = dict.fromkeys(KERNELS, float("inf"))
    for i in range(rounds + 1):  # round 0 warms caches and oneDNN's primitive cache
        for name in KERNELS:
            for p in layers:
                p.kernel_for = {rows: name}
            t = time.perf_counter()
            for p in layers:
                p(xs[p.linear.in_features])
            if i:
                best[name] = min(best[name], time.perf_counter() - t)
    return best


@contextlib.contextmanager
def packed_linears(*modules: nn.Module, timed: bool = True, rows: Iterable[int] = (1, 2, 3, 4)
                   ) -> Iterator[dict[str, str]]:
    """Swap every fp32 CPU nn.Linear under `modules` for a PackedLinear inside the block; restore on exit.

    Yields the kernel chosen per row count ({"1": "gemv", "2": "stock", ..., "5+": "onednn"}), for the
    report; empty when nothing was swapped (no oneDNN, or no fp32 CPU linears). `rows`: the row counts
    to time (a caller verifying k+1 rows passes 1..k+1); any other count runs on oneDNN. `timed=False`
    times nothing and uses oneDNN for every row count: for many-row work (extraction), where a choice
    made by a clock would make reruns differ in their last bits.
    """
    counts = sorted(set(rows)) if timed else []
    swaps: list[tuple[nn.Module, str, nn.Linear, PackedLinear]] = []
    if available():
        with torch.inference_mode():
            for mod in modules:
                for parent in list(mod.modules()):
                    for name, child in list(parent.named_children()):
                        if _swappable(child):
                            swaps.append((parent, name, child, PackedLinear(child, gemv=bool(counts))))
    choice: dict[str, str] = {}
    try:
        if swaps:
            layers = [p for *_, p in swaps]
            kernel_for: dict[int, str] = {}
            with torch.inference_mode():
                for r in counts:
                    t = _time_kernels(layers, r)
                    kernel_for[r] = min(t, key=t.get)
            for p in layers:
                p.kernel_for = kernel_for
                if "gemv" not in kernel_for.values():
                    p.wt = None  # the transposed copy only served the timing: free its memory (a second weight)
            choice = {str(r): k for r, k in kernel_for.items()} | {f"{counts[-1] + 1}+" if counts else "1+": "onednn"}
            for parent, name, _, packed in swaps:
                setattr(parent, name, packed)
        yield choice
    finally:
        for parent, name, lin, _ in swaps:
            setattr(parent, name, lin)
