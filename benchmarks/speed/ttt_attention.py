"""TTT attention at long context: ours (blockwise LSE) vs eager (scores materialized) vs SDPA + mask.

Measures one TTT step at j = 6 (k = 7 key blocks: the causal step-0 block + 6 diagonals),
forward + backward in fp32, for L = 2048, 4096, 8192. Each implementation runs in its own
child process; the child resets its peak RSS after setup (inputs built, kernels warmed up),
so "extra" is the peak resident memory that the forward + backward pass added.

Configurations whose estimated extra memory exceeds 80% of MemAvailable are reported as
skipped (null, with the reason) instead of being run. The last line is JSON keyed by L:
{"4096": {"memory_ratio_eager": ..., "memory_ratio_sdpa": ..., "time_ratio_sdpa": ...}, ...}
with ratios ours / theirs.

    .venv/bin/python -m benchmarks.speed.ttt_attention [--lengths 2048 4096 8192] [--block N]
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMPLS = ("ours", "eager", "sdpa")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def estimate_extra_bytes(impl: str, L: int, j: int, heads: int, kv_heads: int, dim: int, block: int) -> int:
    """Rough peak extra bytes of one forward + backward (fp32), used only to skip what cannot fit."""
    k = j + 1
    grads = 4 * dim * L * (heads + 2 * kv_heads * k)  # dq, dk, dv of all inputs
    if impl == "eager":
        # scores, probabilities and their gradient, each [heads, L, L*k] fp32, plus the bool mask
        return 3 * 4 * heads * L * L * k + L * L * k + grads
    if impl == "sdpa":
        # the bool mask, its float copy inside the CPU kernel, repeated k/v and their grads
        return 5 * L * L * k + 3 * grads
    # ours: a few [heads, block, L] score buffers, the output and lse, and the grads
    return 6 * 4 * heads * block * L + 4 * heads * L * (dim + 2) + grads


def _inputs(L, j, heads, kv_heads, dim, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    q = rnd(1, heads, L, dim)
    k0, v0 = rnd(1, kv_heads, L, dim), rnd(1, kv_heads, L, dim)
    kd, vd = rnd(1, kv_heads, j, L, dim), rnd(1, kv_heads, j, L, dim)
    return q, k0, v0, kd, vd


def _dense_mask(L: int, j: int):
    import torch

    # [L, L*(j+1)]: causal over step-0 keys, then one identity block per diagonal step
    causal = torch.ones(L, L, dtype=torch.bool).tril_()
    eye = torch.eye(L, dtype=torch.bool)
    return torch.cat([causal] + [eye] * j, 1)


def _cat_kv(k0, v0, kd, vd):
    import torch

    j = kd.shape[2]
    k = torch.cat([k0] + [kd[:, :, i] for i in range(j)], 2)  # [1, Hkv, L*(j+1), D]
    v = torch.cat([v0] + [vd[:, :, i] for i in range(j)], 2)
    return k, v


def run_eager(q, k0, v0, kd, vd, mask):
    """Scores materialized: [1, H, L, L*(j+1)] logits, softmax, then P @ V."""
    k, v = _cat_kv(k0, v0, kd, vd)
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def run_sdpa(q, k0, v0, kd, vd, mask):
    import torch.nn.functional as F

    k, v = _cat_kv(k0, v0, kd, vd)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def child(a) -> None:
    """Run one implementation once; print one JSON line with its time and peak extra RSS."""
    import torch

    from eagle3.model.attention import ttt_attention

    torch.manual_seed(0)
    mask = _dense_mask(a.L, a.j) if a.impl != "ours" else None

    def fwd(inp, m):
        if a.impl == "ours":
            return ttt_attention(*inp, block=a.block)
        return (run_eager if a.impl == "eager" else run_sdpa)(*inp, m)

    # warm up kernels and thread pools on a small problem so the timed run measures steady state
    small = _inputs(256, a.j, a.heads, a.kv_heads, a.dim, seed=1)
    o = fwd(small, _dense_mask(256, a.j) if mask is not None else None)
    o.backward(torch.ones_like(o))
    del small, o

    inp = _inputs(a.L, a.j, a.heads, a.kv_heads, a.dim)
    dout = torch.randn(1, a.heads, a.L, a.dim)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status_kb("VmRSS")
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    out = fwd(inp, mask)
    t1 = time.perf_counter()
    out.backward(dout)
    t2 = time.perf_counter()
    cpu = time.process_time() - cpu0  # user + sys of all threads: shows how shared the cores were
    peak = _status_kb("VmHWM")
    print(json.dumps({"impl": a.impl, "L": a.L, "fwd_s": t1 - t0, "bwd_s": t2 - t1, "total_s": t2 - t0,
                      "cpu_s": cpu, "extra_bytes": (peak - base) * 1024, "threads": torch.get_num_threads()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--j", type=int, default=6, help="TTT step (diagonal blocks); k = j + 1")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3, help="GQA kv heads (SmolLM2's draft: 3)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=None, help="query block of ours (default: auto_block)")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--child", dest="impl", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--L", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.impl:
        return child(a)
    from eagle3.model.attention import auto_block

    results: dict[int, dict[str, dict | None]] = {}
    reasons: dict[str, str] = {}
    for L in a.lengths:
        results[L] = {}
        for impl in a.impls:
            block = a.block or auto_block(1, a.heads, L)
            est = estimate_extra_bytes(impl, L, a.j, a.heads, a.kv_heads, a.dim, block)
            avail = _mem_available()
            if est > 0.8 * avail:
                results[L][impl] = None
                reasons[f"{L}/{impl}"] = f"skipped: needs ~{est / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"
                print(f"L={L:5d} {impl:5s} {reasons[f'{L}/{impl}']}", flush=True)
                continue
            cmd = [sys.executable, "-m", __spec__.name, "--child", impl, "--L", str(L), "--j", str(a.j),
                   "--heads", str(a.heads), "--kv-heads", str(a.kv_heads), "--dim", str(a.dim),
                   "--block", str(block)]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            if p.returncode != 0:
                results[L][impl] = None
                reasons[f"{L}/{impl}"] = f"failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-1:]}"
                print(f"L={L:5d} {impl:5s} {reasons[f'{L}/{impl}']}", flush=True)
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            results[L][impl] = r
            print(f"L={L:5d} {impl:5s} fwd {r['fwd_s']:7.2f} s  bwd {r['bwd_s']:7.2f} s  "
                  f"total {r['total_s']:7.2f} s  cpu {r['cpu_s']:7.2f} s  "
                  f"extra RSS {r['extra_bytes'] / 2**20:9.1f} MiB", flush=True)

    def ratio(L, key, other):
        ours, theirs = results[L].get("ours"), results[L].get(other)
        if not ours or not theirs or not theirs[key]:
            return None
        return round(ours[key] / theirs[key], 4)

    summary = {}
    for L in a.lengths:
        entry = {
            "memory_ratio_eager": ratio(L, "extra_bytes", "eager"),
            "memory_ratio_sdpa": ratio(L, "extra_bytes", "sdpa"),
            "time_ratio_sdpa": ratio(L, "total_s", "sdpa"),
            # CPU seconds (all threads): less sensitive than wall time to other jobs on the cores
            "cpu_time_ratio_sdpa": ratio(L, "cpu_s", "sdpa"),
        }
        skipped = {k.split("/")[1]: v for k, v in reasons.items() if k.startswith(f"{L}/")}
        if skipped:
            entry["skipped"] = skipped
        summary[str(L)] = entry
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
