"""The draft model: config from the target, vLLM names, RoPE exactness, TTT == serving-style steps."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eagle3.model.draft import DraftConfig, Eagle3Draft, KVCache

VLLM_NAMES = {
    "fc.weight",
    "input_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    "embed_tokens.weight",
}


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(**switches) -> DraftConfig:
    return DraftConfig(
        hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
        vocab_size=50, draft_vocab_size=20, aux_layer_ids=(1, 2, 3), **switches,
    )


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def tiny_mla(**switches) -> DraftConfig:
    """An MLA draft layer (DeepSeek-V3's attention): LoRA'd queries, a latent key/value, v narrower than q/k, YaRN."""
    return DraftConfig(
        hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=12,
        intermediate_size=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=YARN, max_position_embeddings=128,
        vocab_size=50, draft_vocab_size=20, aux_layer_ids=(1, 2, 3), layer="mla", q_lora_rank=16, kv_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, **switches,
    )


def _model(seed=0, layer="llama", **switches) -> Eagle3Draft:
    torch.manual_seed(seed)
    m = Eagle3Draft(tiny_mla(**switches) if layer == "mla" else tiny(**switches))
    with torch.no_grad():  # non-trivial norms so every switch changes the numbers
        for name, p in m.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        m.embed_tokens.weight.normal_()
    return m


def test_config_from_smollm2(smollm2_dir):
    c = DraftConfig.from_target(smollm2_dir, draft_vocab_size=8000)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.draft_vocab_size) == (1536, 49152, 8000)
    assert c.rope_theta == 1e5 and c.rope_scaling is None
    assert c.aux_layer_ids == (2, 15, 27)  # vLLM's (2, N//2, N-3) for N = 30
    assert c.rms_norm_eps == pytest.approx(1e-5)
    # the measured defaults (benchmarks/experiments/norm_switches.py), the same in the draft and trainer configs
    from eagle3.config import TrainConfig

    t = TrainConfig()
    assert (c.norm_before_fc, c.norm_output, c.norm_before_residual) == (False, True, False)
    assert (t.norm_before_fc, t.norm_output, t.norm_before_residual) == (False, True, False)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        DraftConfig.from_target(smollm2_dir, 8000, aux_layer_ids=(2, 15, 31))
    with pytest.raises(ValueError, match="exceeds the target vocab"):
        DraftConfig.from_target(smollm2_dir, 50000)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                             "original_max_position_embeddings": 4096}},
        {"rope_theta": 1e5},
    ],
    ids=["legacy-llama3", "v5-yarn", "plain"],
)
def test_rope_is_exactly_the_targets(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    target = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 8,
              "vocab_size": 100, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, **rope}
    c = DraftConfig.from_target(target, draft_vocab_size=10)
    pos = torch.tensor([[0, 1, 17, 4095, 9000, 30000]])
    x = torch.zeros(1, 6, 16)
    cos, sin = Eagle3Draft(c).rope(x, pos)
    ref_cos, ref_sin = LlamaRotaryEmbedding(LlamaConfig(**target))(x, pos)
    torch.testing.assert_close(cos, ref_cos, atol=0, rtol=0)
    torch.testing.assert_close(sin, ref_sin, atol=0, rtol=0)


def test_state_dict_uses_vllm_names():
    m = _model(norm_before_fc=True)
    sd = m.state_dict()
    assert set(sd) == VLLM_NAMES
    assert sd["fc.weight"].shape == (32, 96) and sd["input_norm.weight"].shape == (96,)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # 2H in
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (16, 64)  # GQA: 2 kv heads x 8
    assert sd["lm_head.weight"].shape == (20, 32) and sd["d2t"].dtype == torch.long
    assert not m.embed_tokens.weight.requires_grad
    assert "input_norm.weight" not in Eagle3Draft(tiny(norm_before_fc=False)).state_dict()


@pytest.mark.parametrize("layer", ["llama", "mla"])
def test_ttt_forward_shapes_and_grads(layer):
    m = _model(layer=layer)
    B, L, k = 2, 11, 3
    ids = torch.randint(0, 50, (B, L))
    aux = torch.randn(B, L, 3, 32)
    pos = torch.arange(L).repeat(B, 1)
    out = m.ttt_forward(ids, aux, pos, steps=k, block=4)
    assert [tuple(o.shape) for o in out] == [(B, L, 20)] * k
    sum(o.square().mean() for o in out).backward()
    assert m.embed_tokens.weight.grad is None
    for name, p in m.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def _serving_chain(m: Eagle3Draft, ids, aux, pos, t, k):
    """Logits of steps 0..k-1 at position t, run as vLLM runs them: one prefill over the verified
    positions 0..t with combine(aux), then one token per step with the previous next-state."""
    ids_pad = F.pad(ids, (0, k + 1))
    cache = KVCache()
    normed, nxt = m.step(ids_pad[:, 1 : t + 2], m.combine(aux[:, : t + 1]), pos[:, : t + 1], cache)
    logits, h = [m.logits(normed[:, t])], nxt[:, t : t + 1]
    for j in range(1, k):
        normed, h = m.step(ids_pad[:, t + j + 1 : t + j + 2], h, pos[:, t : t + 1] + j, cache)
        logits.append(m.logits(normed[:, 0]))
    assert len(cache) == t + k
    return logits


@pytest.mark.parametrize(
    "switches",
    [{}, {"norm_before_fc": False, "norm_output": False, "norm_before_residual": False}, {"norm_output": False},
     {"fc_norm": True}],
    ids=["all-on", "all-off", "prenorm-output", "fc-norm"],
)
@pytest.mark.parametrize("layer", ["llama", "mla"])
def test_ttt_equals_serving_steps(switches, layer):
    if layer == "mla":
        switches = {k: v for k, v in switches.items() if k != "norm_before_fc"}  # no such norm in vLLM's MLA draft
    m = _model(layer=layer, **switches).eval()
    L, k = 12, 4
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (1, L), generator=g)
    aux = torch.randn(1, L, 3, 32, generator=g)
    pos = torch.arange(L)[None]
    with torch.no_grad():
        ttt = m.ttt_forward(ids, aux, pos, steps=k, block=5)
        for t in (0, 5, 11):
            for j, lg in enumerate(_serving_chain(m, ids, aux, pos, t, k)):
                torch.testing.assert_close(ttt[j][:, t], lg, atol=1e-5, rtol=0,
                                           msg=lambda s, t=t, j=j: f"t={t} j={j}: {s}")


@pytest.mark.parametrize("layer", ["llama", "mla"])
def test_packed_ttt_equals_each_document_alone(layer):
    m = _model(layer=layer).eval()
    lens, k = [7, 9], 3
    L = sum(lens)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 50, (1, L), generator=g)
    aux = torch.randn(1, L, 3, 32, generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = m.ttt_forward(ids, aux, pos, steps=k, block=4)
        doc2 = slice(7, 16)
        alone = m.ttt_forward(ids[:, doc2], aux[:, doc2], pos[:, doc2], steps=k, block=4)
        # positions whose step-j input token is still inside document 2 must agree exactly
        for j in range(k):
            n = 9 - (j + 1)
            torch.testing.assert_close(packed[j][:, 7 : 7 + n], alone[j][:, :n], atol=1e-5, rtol=0)
        # and a position of document 2 against serving-style steps on document 2 alone
        for j, lg in enumerate(_serving_chain(m, ids[:, doc2], aux[:, doc2], pos[:, doc2], 3, k)):
            torch.testing.assert_close(packed[j][:, 7 + 3], lg, atol=1e-5, rtol=0)


def test_switch_semantics():
    m_on = _model(norm_output=True, norm_before_residual=True, norm_before_fc=True)
    m_off = _model(norm_output=False, norm_before_residual=False, norm_before_fc=False)
    out = torch.randn(3, 32)
    normed, nxt = m_on.head(out)
    torch.testing.assert_close(nxt, normed)  # norm_output: the normed state goes on
    normed, nxt = m_off.head(out)
    torch.testing.assert_close(nxt, out)  # otherwise the pre-norm output does
    torch.testing.assert_close(normed, m_off.norm(out))
    e, h = torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    cos, sin = m_on.rope(e, torch.arange(2)[None])
    *_, res_on = m_on.midlayer.project(e, h, cos, sin)
    *_, res_off = m_off.midlayer.project(e, h, cos, sin)
    torch.testing.assert_close(res_on, m_on.midlayer.hidden_norm(h))  # norm_before_residual
    torch.testing.assert_close(res_off, h)
    aux = torch.randn(2, 3, 32)
    torch.testing.assert_close(m_on.combine(aux), m_on.fc(m_on.input_norm(aux.flatten(-2))))
    torch.testing.assert_close(m_off.combine(aux), m_off.fc(aux.flatten(-2)))


def test_fc_norm_is_one_rmsnorm_per_aux_layer():
    """fc_norm: each aux layer's state normed alone, after input_norm as vLLM does, so a layer whose states are
    1000x larger than the others no longer drowns them; the weights are vLLM's `fc_norm.{0,1,2}.weight`."""
    m = _model(fc_norm=True, norm_before_fc=True)
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(m.state_dict())
    assert m.state_dict()["fc_norm.2.weight"].shape == (32,)
    with torch.no_grad():
        for i, n in enumerate(m.fc_norm):
            n.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
    aux = torch.randn(2, 3, 32)
    x = m.input_norm(aux.flatten(-2))
    want = m.fc(torch.cat([m.fc_norm[i](x[:, 32 * i:32 * (i + 1)]) for i in range(3)], -1))
    torch.testing.assert_close(m.combine(aux), want, rtol=0, atol=0)
    plain = _model(fc_norm=True)
    scaled = aux.clone()
    scaled[:, 2] *= 1000.0  # one layer's scale does not reach fc
    torch.testing.assert_close(plain.combine(scaled), plain.combine(aux), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_lean_norm_and_mlp_equal_plain_autograd(dtype):
    # RMSNorm and silu(gate) * up keep less for backward than autograd would; their values and
    # gradients must be autograd's (fp32: to rounding; bf16: the dtype chain of HF/vLLM's norm).
    from eagle3.model.draft import RMSNorm, _SiluMul

    torch.manual_seed(0)
    x = (torch.randn(3, 7, 16) * 3).to(dtype).requires_grad_()
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    gy = torch.randn(3, 7, 16)
    y = norm(x)
    gx, gw = torch.autograd.grad(y, (x, norm.weight), gy.to(y.dtype))
    xf = x.float()
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    rx, rw = torch.autograd.grad(ref, (x, norm.weight), gy.to(ref.dtype))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert y.dtype == ref.dtype and torch.equal(y, ref)
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(gw, rw, **tol)

    gate, up = (torch.randn(5, 12) * 4).to(dtype).requires_grad_(), torch.randn(5, 12).to(dtype).requires_grad_()
    g = torch.randn(5, 12).to(dtype)
    out = _SiluMul.apply(gate, up)
    ref = torch.nn.functional.silu(gate) * up
    assert torch.equal(out, ref)
    for a, b in zip(torch.autograd.grad(out, (gate, up), g), torch.autograd.grad(ref, (gate, up), g), strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_mla_attention_equals_deepseek_v3s():
    """The MLA draft layer's attention (its 2H input) equals transformers' DeepseekV3Attention built on a 2H-wide
    input with the same weights, YaRN RoPE on interleaved pairs and mscale'd softmax scale included. One difference
    is set aside: transformers builds q_a_layernorm and kv_a_layernorm with eps 1e-6 whatever the config says, vLLM
    (which serves the draft) with the config's rms_norm_eps, as the draft does."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    m = _model(layer="mla").eval()
    c, a = m.config, m.midlayer.self_attn
    hc = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                          kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-5,
                          max_position_embeddings=128, rope_parameters=c.rope_parameters, attention_bias=False)
    hc._attn_implementation = "eager"
    ref = DeepseekV3Attention(hc, layer_idx=0).eval()
    names = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"]
    with torch.no_grad():
        for n in names:
            getattr(ref, n).weight.copy_(getattr(a, n).weight)
    ref.q_a_layernorm.variance_epsilon = ref.kv_a_layernorm.variance_epsilon = c.rms_norm_eps
    assert ref.scaling == pytest.approx(m.midlayer.scale) and m.midlayer.scale != pytest.approx(12 ** -0.5)
    T = 10
    x = torch.randn(1, T, 64, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(T)[None]
    cos, sin = m.rope(x, pos)
    seen = {}
    ref.o_proj.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref(hidden_states=x, position_embeddings=(cos, sin), attention_mask=mask)
        q, k, v = a.qkv(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=m.midlayer.scale)[..., :6]
    torch.testing.assert_close(out.transpose(1, 2).reshape(1, T, 24), seen["x"], atol=1e-5, rtol=1e-5)


def test_mla_layer_from_the_kimi_layout(family_dirs):
    """From Kimi-K2.5's layout the MLA layer takes the target's MLA widths, heads and YaRN RoPE (the Llama layer takes
    128-wide heads and plain RoPE); a non-MLA target, or norm_before_fc (not in vLLM's MLA draft), is refused."""
    c = DraftConfig.from_target(family_dirs["kimi-k2.5"], 384, layer="mla")
    assert (c.layer, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == ("mla", 512, 64, 128, 128)
    assert c.head_dim == 192 and c.q_lora_rank == 32 and c.rope_scaling["rope_type"] == "yarn"
    assert set(Eagle3Draft(c).state_dict()) >= {"midlayer.self_attn.q_a_proj.weight",
                                                "midlayer.self_attn.kv_a_proj_with_mqa.weight",
                                                "midlayer.self_attn.kv_b_proj.weight"}
    llama = DraftConfig.from_target(family_dirs["kimi-k2.5"], 384)
    assert (llama.layer, llama.head_dim, llama.rope_scaling) == ("llama", 128, None)
    with pytest.raises(ValueError, match="needs an MLA target"):
        DraftConfig.from_target(family_dirs["qwen3"], 384, layer="mla")
    with pytest.raises(ValueError, match="norm_before_fc does not exist for an MLA draft layer"):
        DraftConfig.from_target(family_dirs["kimi-k2.5"], 384, layer="mla", norm_before_fc=True)
