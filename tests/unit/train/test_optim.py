"""Muon's Newton-Schulz iteration in fp32 (for CPUs without bf16 units) against torch's own bf16 one."""
from __future__ import annotations

import pytest
import torch
from torch.optim import _muon

from eagle3.train.optim import MuonAdamW, newton_schulz_fp32

COEFFS = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


@pytest.mark.parametrize("shape", [(64, 192), (192, 64)])
def test_the_fp32_iteration_is_torchs_iteration_at_higher_precision(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz_fp32(g, COEFFS, _muon.DEFAULT_NS_STEPS, 1e-7)
    ref = _muon._zeropower_via_newtonschulz(g, COEFFS, _muon.DEFAULT_NS_STEPS, 1e-7)
    assert ours.dtype == torch.float32 and ours.shape == g.shape == ref.shape
    assert _cos(ours, ref) > 0.999
    # orthogonalised: the singular values sit near 1 (the quintic's band, roughly 0.5-1.5), not g's spread
    sv = torch.linalg.svdvals(ours)
    assert 0.3 < sv.min() and sv.max() < 1.6 and torch.linalg.svdvals(g).max() > 10


def test_muon_steps_the_same_with_either_iteration_and_puts_torchs_back():
    torch.manual_seed(0)
    w0, b0 = torch.randn(48, 96) * 0.02, torch.randn(48)
    runs = []
    for fp32 in (False, True):
        w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
        opt = MuonAdamW(torch.optim.Muon([w], lr=1e-2, adjust_lr_fn="match_rms_adamw"),
                        torch.optim.AdamW([b], lr=1e-2), ns_fp32=fp32)
        for i in range(3):
            w.grad = torch.randn(48, 96, generator=torch.Generator().manual_seed(i))
            b.grad = torch.ones(48)
            opt.step()
        runs.append((w.detach() - w0, b.detach()))
    (dw16, b16), (dw32, b32) = runs
    assert _cos(dw16, dw32) > 0.999 and torch.equal(b16, b32)
    assert _muon._zeropower_via_newtonschulz is not newton_schulz_fp32
