"""oneDNN-prepacked linear layers for live CPU decoding: equal to nn.Linear, swapped in and out exactly."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle3.decoding import cpu_linear
from eagle3.decoding.cpu_linear import PackedLinear, packed_linears

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear ops")]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 48), (1, 2, 48), (1, 4, 48), (3, 7, 48), (48,), (400, 48)])
@pytest.mark.parametrize("kernel", ["onednn", "gemv", "stock"])
def test_packed_equals_nn_linear(shape, bias, kernel):
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=bias)
    p = PackedLinear(lin)
    x = torch.randn(*shape)
    rows = x.numel() // 48
    p.kernel_for = {rows: kernel}
    with torch.inference_mode():
        got, want = p(x), lin(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert p.weight is lin.weight


def test_non_contiguous_rows():
    """A slice of a wider activation (the decoder hands such views around) multiplies as its copy."""
    torch.manual_seed(1)
    lin = nn.Linear(32, 16)
    x = torch.randn(2, 5, 64)[..., ::2]  # [2, 5, 32], stride 2
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(lin)(x), lin(x.contiguous()), rtol=1e-5, atol=1e-5)


def test_swaps_fp32_cpu_linears_and_restores_the_same_objects():
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 8)))
    half = nn.Linear(16, 16).to(torch.bfloat16)  # not fp32: left alone
    before = [net[0], net[2][0], net[2][1], half]
    x = torch.randn(3, 16)
    with torch.inference_mode():
        want = net(x)
        with packed_linears(net, half) as kernels:
            assert [type(m) for m in (net[0], net[2][0], net[2][1])] == [PackedLinear] * 3
            assert type(half) is nn.Linear
            assert set(kernels) == {"1", "2", "3", "4", "5+"} and kernels["5+"] == "onednn"
            assert {kernels[r] for r in "1234"} <= {"gemv", "stock", "onednn"}
            for rows in range(1, 7):  # each timed count on its chosen kernel, the rest on oneDNN
                assert net[0].kernel_for.get(rows, "onednn") == kernels.get(str(rows), "onednn")
            torch.testing.assert_close(net(x), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(net(x[:1]), want[:1], rtol=1e-5, atol=1e-5)
        assert [net[0], net[2][0], net[2][1], half] == before  # the very modules, not copies
        assert torch.equal(net(x), want)


def test_restores_on_error():
    net = nn.Sequential(nn.Linear(4, 4))
    lin = net[0]
    with pytest.raises(RuntimeError, match="boom"), packed_linears(net):
        raise RuntimeError("boom")
    assert net[0] is lin


def test_nothing_to_swap_yields_no_kernels():
    with packed_linears(nn.Linear(4, 4).to(torch.bfloat16)) as kernels:
        assert kernels == {}


def test_target_logits_match_stock(tiny_llama_dir):
    """The whole tiny Llama, prefill and a 4-token cached step: packed logits == stock logits to fp32 rounding."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))

    def run():
        cache = DynamicCache(config=model.config)
        a = model(input_ids=ids[:, :36], past_key_values=cache, use_cache=True).logits
        b = model(input_ids=ids[:, 36:], past_key_values=cache, use_cache=True).logits
        return torch.cat([a, b], 1)

    with torch.inference_mode():
        want = run()
        with packed_linears(model):
            got = run()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
