"""Training-time-test (TTT) attention without an L x (L*k) mask.

In TTT step j the query at position t attends to
  * the step-0 keys at positions s <= t of the same document (causal, packed-aware), and
  * the keys that steps 1..j produced at position t itself (the "diagonal").
(EAGLE-3, arXiv 2503.01840; SpecForge and speculators agree.) The usual implementation concatenates all keys
and builds a dense [L, L*(j+1)] mask, which is B*heads*L*(L*k) scores: the field's main OOM.

Here the two parts are merged with a log-sum-exp instead. `TTTAttention` is an autograd
Function that walks over blocks of queries: the forward pass keeps only the output and the
log-sum-exp per query; the backward pass recomputes each block's probabilities from them
(FlashAttention's trick). Extra memory is O(L*(block + k)) per head, never O(L^2).
Why not a kernel: on CPU (torch 2.13) SDPA's flash kernel returns a logsumexp with no
gradient, and flex_attention has no CPU backward. The Function is plain torch, so it also
runs on CUDA.

Shapes: B batch rows, Hq query heads, Hkv kv heads (GQA: q head h uses kv head h // G,
G = Hq // Hkv, the convention of HF's repeat_kv), L positions, D head dim, j diagonal steps.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from eagle3.runtime.floats import exp_

DEFAULT_BLOCK = None  # auto: see auto_block
SCRATCH_ELEMENTS = 1 << 25  # 32M scores (128 MiB in fp32) per scratch buffer at most
MAX_BLOCK = 512


def auto_block(batch: int, heads: int, length: int) -> int:
    """Query block for [batch, heads, length]: the largest power of two <= MAX_BLOCK whose score
    scratch (batch * heads * block * length) fits SCRATCH_ELEMENTS, and at least 16.

    Bigger blocks mean fewer, larger ops (fewer kernel launches on GPU, fewer OpenMP barriers on
    a shared CPU); the cap keeps the scratch, the only O(L * block) term, bounded.
    """
    fit = SCRATCH_ELEMENTS // max(1, batch * heads * length)
    return max(16, min(MAX_BLOCK, 1 << max(0, fit.bit_length() - 1)))


def doc_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document index per position of packed rows whose position ids restart at 0 per document.

    position_ids: [B, L] -> doc: [B, L] (int64, 0-based within each row).
    """
    return (position_ids == 0).long().cumsum(-1) - (position_ids[..., :1] == 0).long()


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Document index per position of one packed row from cumulative lengths [0, l0, l0+l1, ...].

    cu_seqlens: [n_docs + 1] -> doc: [1, L]. Positions past cu_seqlens[-1] (if total is larger)
    form one more document, so a filler tail never attends into real data.
    """
    cu = cu_seqlens.long()
    total = int(cu[-1]) if total is None else total
    pos = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:], pos, right=True)[None]


def _doc_starts(doc: torch.Tensor) -> torch.Tensor:
    """First index of each position's document, min over rows. doc: [B, L] -> [L] int64."""
    L = doc.shape[-1]
    idx = torch.arange(L, device=doc.device)
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    start = torch.where(new, idx, torch.zeros_like(idx)).cummax(-1).values  # [B, L]
    return start.min(0).values


def _view(buf: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous view of the first prod(shape) elements of a flat scratch buffer."""
    return buf[: math.prod(shape)].view(shape)


def _block_scores(q_blk, k0, kd, doc, a, b, lo, scale, buf):
    """Scores of one query block [a, b) against step-0 keys [lo, b) and the diagonal.

    q_blk: [B, Hkv, G, n, D]; k0: [B, Hkv, L, D]; kd: j tensors [B, Hkv, L, D]; doc: [B, L] or None;
    buf: flat scratch of >= B*Hkv*G*n*(b-lo) elements, reused across blocks (one allocation per
    call instead of one per block: large allocations are fresh, zero-filled pages every time).
    Returns s0: [B, Hkv, G, n, b-lo] (masked entries -inf) in buf, sd: [B, Hkv, G, j, n] and the
    block's diagonal keys kd_blk: [B, Hkv, j, n, D].
    """
    B, Hkv, G, n, D = q_blk.shape
    # s0 = q @ k^T over the key window only; all G query heads of a kv head share one matmul.
    s0 = _view(buf, B, Hkv, G * n, b - lo)
    torch.matmul(q_blk.reshape(B, Hkv, G * n, D), k0[:, :, lo:b].transpose(-1, -2), out=s0)
    s0 = s0.view(B, Hkv, G, n, b - lo).mul_(scale)
    tq = torch.arange(a, b, device=q_blk.device)
    if doc is None:
        # keys before a are visible to the whole block: only the [n, n] corner needs the causal mask
        tk = torch.arange(a, b, device=q_blk.device)
        s0[..., a - lo :].masked_fill_(tk[None, :] > tq[:, None], float("-inf"))
    else:
        tk = torch.arange(lo, b, device=q_blk.device)
        allowed = (tk[None, :] <= tq[:, None]) & (doc[:, None, lo:b] == doc[:, a:b, None])  # [B, n, b-lo]
        s0.masked_fill_(~allowed[:, None, None], float("-inf"))  # causal, same document
    # sd[.., i, t] = q_t . kd_i,t: one dot product per (step, position), no L x L anything.
    kd_blk = _stack_block(kd, a, b, q_blk)
    sd = torch.einsum("bhgnd,bhjnd->bhgjn", q_blk, kd_blk).mul_(scale)
    return s0, sd, kd_blk


def _stack_block(xs, a, b, like):
    """j tensors [B, Hkv, L, D] -> their rows [a, b) stacked: [B, Hkv, j, b-a, D]."""
    if not xs:
        B, Hkv, G, n, D = like.shape
        return like.new_empty(B, Hkv, 0, b - a, D)
    return torch.stack([x[:, :, a:b] for x in xs], 2)


class TTTAttention(torch.autograd.Function):
    """Blockwise TTT attention; see the module docstring. Inputs already carry RoPE.

    The diagonal keys/values come as separate tensors (`*kvd` = k_1..k_j, v_1..v_j), so a
    TTT loop never re-stacks (and autograd never re-saves) the keys of earlier steps.
    """

    @staticmethod
    def forward(ctx, q, k0, v0, doc, scale, block, *kvd):
        # q: [B, Hq, L, D]; k0, v0: [B, Hkv, L, D]; kvd: 2j tensors [B, Hkv, L, D]; doc: [B, L] or None
        B, Hq, L, D = q.shape
        Hkv = k0.shape[1]
        G = Hq // Hkv
        j = len(kvd) // 2
        kd, vd = kvd[:j], kvd[j:]
        qg = q.view(B, Hkv, G, L, D)
        out = torch.empty_like(qg)  # [B, Hkv, G, L, D]
        # lse in at least fp32: the backward pass rebuilds probabilities as exp(s - lse)
        lse = torch.empty(B, Hkv, G, L, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        starts = _doc_starts(doc) if doc is not None else None
        buf = q.new_empty(B * Hq * min(block, L) * L)  # the one O(L * block) scratch
        for a in range(0, L, block):
            b = min(a + block, L)
            lo = int(starts[a]) if starts is not None else 0  # keys before lo are other documents
            s0, sd, _ = _block_scores(qg[:, :, :, a:b], k0, kd, doc, a, b, lo, scale, buf)
            # m: [B, Hkv, G, n] max over both parts, for a stable exp
            m = torch.maximum(s0.amax(-1), sd.amax(-2)) if j else s0.amax(-1)
            p0 = exp_(s0.sub_(m[..., None]))  # in place: the scores are not needed again
            pd = exp_(sd.sub_(m[..., None, :]))  # [B, Hkv, G, j, n]
            z = p0.sum(-1) + pd.sum(-2)  # [B, Hkv, G, n]
            o = torch.matmul(p0.view(B, Hkv, G * (b - a), b - lo), v0[:, :, lo:b]).view(B, Hkv, G, b - a, D)
            o += torch.einsum("bhgjn,bhjnd->bhgnd", pd, _stack_block(vd, a, b, o))
            out[:, :, :, a:b] = o / z[..., None]
            lse[:, :, :, a:b] = m + z.log()
        ctx.save_for_backward(q, k0, v0, doc, out, lse, *kvd)
        ctx.scale, ctx.block, ctx.j = scale, block, j
        return out.view(B, Hq, L, D)

    @staticmethod
    def backward(ctx, dout):
        q, k0, v0, doc, out, lse, *kvd = ctx.saved_tensors
        scale, block, j = ctx.scale, ctx.block, ctx.j
        kd, vd = kvd[:j], kvd[j:]
        B, Hq, L, D = q.shape
        Hkv = k0.shape[1]
        G = Hq // Hkv
        qg = q.view(B, Hkv, G, L, D)
        do = dout.reshape(B, Hkv, G, L, D)
        # delta_t = sum_s P_ts dP_ts = dO_t . O_t (FlashAttention-2's trick for dS)
        delta = (do * out).sum(-1)  # [B, Hkv, G, L]
        dq = torch.empty_like(qg)
        dk0, dv0 = torch.zeros_like(k0), torch.zeros_like(v0)
        dkd = [torch.empty_like(x) for x in kd]  # each row is written by exactly one block
        dvd = [torch.empty_like(x) for x in vd]
        starts = _doc_starts(doc) if doc is not None else None
        buf = q.new_empty(B * Hq * min(block, L) * L)  # scores, then probabilities, then dS
        dbuf = torch.empty_like(buf)  # dP
        for a in range(0, L, block):
            b = min(a + block, L)
            n = b - a
            lo = int(starts[a]) if starts is not None else 0
            q_blk, do_blk = qg[:, :, :, a:b], do[:, :, :, a:b]
            s0, sd, kd_blk = _block_scores(q_blk, k0, kd, doc, a, b, lo, scale, buf)
            l_blk, d_blk = lse[:, :, :, a:b, None], delta[:, :, :, a:b, None]
            p0 = exp_(s0.sub_(l_blk))  # [B, Hkv, G, n, b-lo]: the exact probabilities again
            pd = exp_(sd.sub_(l_blk.transpose(-1, -2)))  # [B, Hkv, G, j, n]
            p0f = p0.view(B, Hkv, G * n, b - lo)
            do_f = do_blk.reshape(B, Hkv, G * n, D)
            q_f = q_blk.reshape(B, Hkv, G * n, D)
            # step-0 part: dV = P^T dO; dP = dO V^T; dS = P * (dP - delta)
            dv0[:, :, lo:b] += torch.matmul(p0f.transpose(-1, -2), do_f)
            dp = _view(dbuf, B, Hkv, G * n, b - lo)
            torch.matmul(do_f, v0[:, :, lo:b].transpose(-1, -2), out=dp)
            dp = dp.view_as(p0)
            ds = p0.mul_(dp.sub_(d_blk)).mul_(scale)  # reuses p0's memory
            dsf = ds.view(B, Hkv, G * n, b - lo)
            dq_blk = torch.matmul(dsf, k0[:, :, lo:b]).view(B, Hkv, G, n, D)
            dk0[:, :, lo:b] += torch.matmul(dsf.transpose(-1, -2), q_f)
            if j:  # diagonal part: one term per (step i, position t)
                vd_blk = _stack_block(vd, a, b, q_blk)
                dvd_blk = torch.einsum("bhgjn,bhgnd->bhjnd", pd, do_blk)
                dpd = torch.einsum("bhgnd,bhjnd->bhgjn", do_blk, vd_blk)
                dsd = pd.mul_(dpd.sub_(d_blk.transpose(-1, -2))).mul_(scale)
                dq_blk += torch.einsum("bhgjn,bhjnd->bhgnd", dsd, kd_blk)
                dkd_blk = torch.einsum("bhgjn,bhgnd->bhjnd", dsd, q_blk)
                for i in range(j):
                    dkd[i][:, :, a:b] = dkd_blk[:, :, i]
                    dvd[i][:, :, a:b] = dvd_blk[:, :, i]
            dq[:, :, :, a:b] = dq_blk
        return (dq.view(B, Hq, L, D), dk0, dv0, None, None, None, *dkd, *dvd)


def ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    kd: Sequence[torch.Tensor] | torch.Tensor | None = None,
    vd: Sequence[torch.Tensor] | torch.Tensor | None = None,
    doc: torch.Tensor | None = None,
    scale: float | None = None,
    block: int | None = DEFAULT_BLOCK,
) -> torch.Tensor:
    """Attention of TTT step j = len(kd) (0 when kd is None).

    q: [B, Hq, L, D] step-j queries; k0, v0: [B, Hkv, L, D] step-0 keys/values;
    kd, vd: the keys/values of steps 1..j, as j tensors [B, Hkv, L, D] or one [B, Hkv, j, L, D];
    doc: [B, L] document index of each position in packed rows (None: one document per row);
    block: queries per block (None: `auto_block`). Returns [B, Hq, L, D].
    """
    B, Hq, L, D = q.shape
    if k0.shape != v0.shape or k0.shape[0] != B or k0.shape[2:] != (L, D):
        raise ValueError(f"k0/v0 must be [B, Hkv, L, D] = [{B}, Hkv, {L}, {D}], "
                         f"got {tuple(k0.shape)}, {tuple(v0.shape)}")
    Hkv = k0.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    kd = [] if kd is None else list(kd.unbind(2) if isinstance(kd, torch.Tensor) else kd)
    vd = [] if vd is None else list(vd.unbind(2) if isinstance(vd, torch.Tensor) else vd)
    if len(kd) != len(vd) or any(x.shape != k0.shape for x in kd + vd):
        raise ValueError(f"kd/vd must be equally many tensors shaped like k0 {tuple(k0.shape)}")
    dtypes = {str(t.dtype).removeprefix("torch.") for t in (q, k0, v0, *kd, *vd)}
    if len(dtypes) > 1:  # the backward pass runs without autocast: its matmuls need one dtype
        raise ValueError(f"q, k and v must share one dtype, got {sorted(dtypes)}")
    if doc is not None and doc.shape != (B, L):
        raise ValueError(f"doc must be [B, L] = [{B}, {L}], got {tuple(doc.shape)}")
    if doc is not None and not bool((doc != doc[:, :1]).any()):
        doc = None  # one document per row: the cheaper plain-causal path gives the same result
    block = auto_block(B, Hq, L) if block is None else block
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    q, k0, v0 = q.contiguous(), k0.contiguous(), v0.contiguous()
    return TTTAttention.apply(q, k0, v0, doc, scale, block, *kd, *vd)
