"""TTT attention: the blockwise Function equals a plain dense-mask reference, forward and backward; its exp
flushes what would be denormal, and so does the trainer's float mode."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from eagle3.model.attention import (
    SCRATCH_ELEMENTS,
    auto_block,
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    ttt_attention,
)
from eagle3.runtime.floats import EXP_FLUSH, denormals_flushed, exp_

pytestmark = pytest.mark.usefixtures("one_thread")

FLT_MIN = torch.finfo(torch.float32).tiny  # 1.18e-38: the smallest normal float32


def test_exp_equals_torch_exp_above_the_flush_and_is_zero_below():
    x = torch.cat([torch.linspace(-200, 20, 200_001), torch.tensor([float("-inf"), -87.0, -86.8, -86.7, 0.0])])
    ref = torch.exp(x)
    got = exp_(x.clone())
    keep = ref > EXP_FLUSH
    assert torch.equal(got[keep], ref[keep])  # bitwise torch's exp wherever the result is kept
    assert (got[~keep] == 0).all() and (~keep).sum() > 100_000
    assert not ((got > 0) & (got < FLT_MIN)).any()  # no denormal result
    # the flush is below float32's resolution against a softmax's sum (its largest term is 1)
    assert float(ref[~keep].max()) <= EXP_FLUSH and 1.0 + EXP_FLUSH == 1.0


def test_denormals_flushed_inside_the_block_only():
    a, b = torch.tensor([1e-30]), torch.tensor([1e-10])
    assert 0 < float(a * b) < FLT_MIN  # IEEE: a denormal product
    with denormals_flushed() as ok:
        if not ok:
            pytest.skip("this CPU has no flush-to-zero mode")
        assert float(a * b) == 0.0
    assert 0 < float(a * b) < FLT_MIN  # the default again after the block


def dense_reference(q, k0, v0, kd, vd, doc):
    """All keys concatenated, one dense boolean mask [L, L*(j+1)]: causal same-document, then identities."""
    B, Hq, L, D = q.shape
    G = Hq // k0.shape[1]
    j = len(kd)
    k = torch.cat([k0, *kd], 2).repeat_interleave(G, 1)  # [B, Hq, L*(j+1), D]
    v = torch.cat([v0, *vd], 2).repeat_interleave(G, 1)
    t = torch.arange(L)
    causal = (t[None, :] <= t[:, None])[None].expand(B, L, L)
    if doc is not None:
        causal = causal & (doc[:, None, :] == doc[:, :, None])
    eye = torch.eye(L, dtype=torch.bool)[None].expand(B, L, L)
    mask = torch.cat([causal] + [eye] * j, -1)[:, None]  # [B, 1, L, L*(j+1)]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def _inputs(B, Hq, Hkv, L, D, j, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g).requires_grad_()

    return r(B, Hq, L, D), r(B, Hkv, L, D), r(B, Hkv, L, D), [r(B, Hkv, L, D) for _ in range(j)], [
        r(B, Hkv, L, D) for _ in range(j)
    ]


def _check(B, Hq, Hkv, L, D, j, doc, block):
    q, k0, v0, kd, vd = _inputs(B, Hq, Hkv, L, D, j)
    leaves = [q, k0, v0, *kd, *vd]
    out = ttt_attention(q, k0, v0, kd, vd, doc, block=block)
    ref = dense_reference(q, k0, v0, kd, vd, doc)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    dout = torch.randn_like(out)
    g_out = torch.autograd.grad(out, leaves, dout)
    g_ref = torch.autograd.grad(ref, leaves, dout)
    for name, a, b in zip(["q", "k0", "v0"] + [f"kd{i}" for i in range(j)] + [f"vd{i}" for i in range(j)], g_out, g_ref,
                          strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("j", [0, 1, 3])
@pytest.mark.parametrize("block", [1, 7, 64])
def test_unpacked_equals_dense(j, block):
    # GQA 6 query heads over 2 kv heads; L not a multiple of the block
    _check(B=2, Hq=6, Hkv=2, L=29, D=16, j=j, doc=None, block=block)


@pytest.mark.parametrize("j", [0, 2, 6])
@pytest.mark.parametrize("block", [4, 16])
def test_packed_equals_dense_across_document_boundaries(j, block):
    # two packed rows with different boundaries; a block straddles each boundary
    pos = torch.tensor([list(range(9)) + list(range(14)) + list(range(10)), list(range(20)) + list(range(13))])
    doc = doc_ids_from_position_ids(pos)
    assert doc.tolist()[0] == [0] * 9 + [1] * 14 + [2] * 10
    _check(B=2, Hq=4, Hkv=4, L=33, D=8, j=j, doc=doc, block=block)


def test_packed_equals_separate_documents():
    # a packed row gives each document exactly what running it alone gives
    lens = [11, 5, 16]
    L = sum(lens)
    q, k0, v0, kd, vd = _inputs(1, 4, 2, L, 8, 2, seed=3)
    doc = doc_ids_from_cu_seqlens(torch.tensor([0, 11, 16, 32]))
    packed = ttt_attention(q, k0, v0, kd, vd, doc, block=8)
    a = 0
    for n in lens:
        sl = slice(a, a + n)
        alone = ttt_attention(q[:, :, sl], k0[:, :, sl], v0[:, :, sl], [x[:, :, sl] for x in kd],
                              [x[:, :, sl] for x in vd])
        torch.testing.assert_close(packed[:, :, sl], alone, atol=1e-6, rtol=0)
        a += n


def test_doc_ids_helpers_agree():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu = torch.tensor([0, 3, 5, 9])
    assert doc_ids_from_position_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    assert doc_ids_from_cu_seqlens(cu).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2]]
    # a filler tail past the last document becomes its own document
    assert doc_ids_from_cu_seqlens(torch.tensor([0, 2]), total=4).tolist() == [[0, 0, 1, 1]]


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max = max(self.max, t.numel())
        return out


def test_no_tensor_of_size_L_by_L():
    # Extra memory is O(L * (block + k)) per head: at L=512, block=32 no op may produce a
    # tensor anywhere near heads * L * L (the dense score of the causal part alone).
    B, Hq, Hkv, L, D, j, block = 1, 4, 2, 512, 16, 6, 32
    q, k0, v0, kd, vd = _inputs(B, Hq, Hkv, L, D, j)
    with _MaxNumel() as mode:
        out = ttt_attention(q, k0, v0, kd, vd, block=block)
        out.backward(torch.ones_like(out))
    assert mode.max <= Hq * block * L  # the largest thing is one block of scores
    assert mode.max < Hq * L * L // 8


def test_errors():
    q, k0, v0, kd, vd = _inputs(1, 3, 2, 8, 4, 1)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ttt_attention(q, k0, v0)
    q, k0, v0, kd, vd = _inputs(1, 4, 2, 8, 4, 1)
    with pytest.raises(ValueError, match="doc must be"):
        ttt_attention(q, k0, v0, kd, vd, doc=torch.zeros(1, 7, dtype=torch.long))


def test_auto_block_bounds_the_scratch():
    # SmolLM2's draft (9 heads): 512 up to L=4096, then halving so heads*block*L stays <= 32M
    assert [auto_block(1, 9, L) for L in (64, 2048, 4096, 8192, 16384)] == [512, 512, 512, 256, 128]
    for B, H, L in [(1, 9, 8192), (4, 32, 8192), (2, 32, 65536)]:
        b = auto_block(B, H, L)
        assert B * H * b * L <= SCRATCH_ELEMENTS or b == 16
    # and the default (auto) path still equals the reference
    _check(B=1, Hq=2, Hkv=1, L=40, D=8, j=2, doc=None, block=None)
