"""The EAGLE-3 draft: config, modules and every forward pass, in one file.

One file on purpose (over the house's 450 lines): what the draft computes must be read top to bottom in one
place, since serving (vLLM) recomputes it and any drift between the two costs acceptance silently.

    h0   = fc(input_norm(cat(aux_low, aux_mid, aux_high)))            # [T, H], step 0 only
           (with fc_norm: cat(fc_norm_0(aux_low), fc_norm_1(aux_mid), fc_norm_2(aux_high)) instead)
    x    = cat(input_layernorm(embed(token)), hidden_norm(h))          # [T, 2H]
    a    = o_proj(attention(rope(q_proj x), rope(k_proj x), v_proj x)) # one GQA Llama attention
    r    = a + residual, where residual = h (or hidden_norm(h) with norm_before_residual)
    out  = r + mlp(post_attention_layernorm(r))                        # pre-norm layer output
    logits over the draft vocab = lm_head(norm(out));  next step's h = norm(out) if norm_output else out

Parameter names are vLLM's native EAGLE-3 names (`fc`, `input_norm`, `midlayer.*`, `norm`,
`lm_head`, `d2t`; `t2d` is ignored by vLLM), so export is a plain state-dict dump. The
semantics follow vLLM's `llama_eagle3.py` (LlamaModel.forward / combine_hidden_states):
`input_norm` is the RMSNorm of `norm_before_fc`; `fc_norm` one RMSNorm per aux layer (applied after
`input_norm` when both are on, as vLLM does); `norm_output` makes the *normed* state the
one passed to the next step; `norm_before_residual` makes the residual `hidden_norm(h)`.

Two layer kinds (`DraftConfig.layer`), one forward pass each, both in this file:
* "llama": the layer above, vLLM's `LlamaForCausalLMEagle3` (any target).
* "mla": DeepSeek-V3's multi-head latent attention plus a dense MLP, vLLM's `Eagle3DeepseekV3ForCausalLM`
  (`deepseek_eagle3.py`), the draft the field serves for DeepSeek-V3 / Kimi-K2.5 targets:
      q = q_b_proj(q_a_layernorm(q_a_proj x))                 # [T, heads, nope + rope]; x the 2H input
      c, k_pe = kv_a_proj_with_mqa x                           # latent [T, kv_lora], shared RoPE key [T, rope]
      k_nope, v = kv_b_proj(kv_a_layernorm c)                  # [T, heads, nope], [T, heads, v_dim]
      a = o_proj(attention(q, cat(k_nope, rope(k_pe)), v))     # rope on q's and k's last `rope` dims
  with the target's own RoPE (DeepSeek's YaRN, interleaved pairs) and its softmax scale (nope + rope)^-0.5
  times YaRN's mscale(factor, mscale_all_dim)^2, as vLLM's DeepseekV2MLAAttention computes. The rest of the
  layer (norms, residual, MLP, norm_output) is the Llama layer's. Its values are padded with zeros to the q/k
  width inside the layer, so the attention kernels take one head dim; `finish` drops the padding.

Two ways to run it:
* `ttt_states` / `ttt_forward`: training, k unrolled steps over packed rows with blockwise TTT
  attention (the trainer takes the normed states and applies lm_head inside its fused loss).
* `step` + `KVCache`: one draft forward over new tokens against a KV cache, as vLLM's
  proposer runs it (the eval stage's chain decoding mimics serving with it).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn

from eagle3.model.target import MLA_DRAFT_HEAD_DIM, Target, check_aux_ids, default_aux_ids, is_mla, rope_of, text_config

VERIFIER_FILE = "verifier.safetensors"


# ---------------------------------------------------------------- config
def _attention_shape(cfg: dict[str, Any], layer: str, head_dim: int,
                     scaling: dict | None) -> tuple[int, dict | None, dict[str, Any]]:
    """(head_dim, rope_scaling, MLA widths) of the draft's attention for a target's text config: a Llama layer
    copies the target's (an MLA target's: MLA_DRAFT_HEAD_DIM and plain RoPE); an MLA layer (an MLA target only)
    takes the target's MLA widths, its head_dim the query's nope + rope parts."""
    if layer == "mla":
        if not is_mla(cfg):
            raise ValueError("an MLA draft layer needs an MLA target (DeepSeek-V3, Kimi-K2.5: kv_lora_rank in "
                             "its config); use the llama draft layer")
        mla = {k: cfg.get(k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                       "v_head_dim")}
        return int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"]), scaling, mla
    if layer != "llama":
        raise ValueError(f"draft layer {layer!r}: llama or mla")
    if is_mla(cfg):
        return MLA_DRAFT_HEAD_DIM, None, {}
    return head_dim, scaling, {}


class DraftConfig(BaseModel):
    """Shape and switches of one EAGLE-3 draft head. Build it with `DraftConfig.from_target`.

    The norm switches' defaults were chosen by validation simulated tau on the same data, seed and steps
    (`benchmarks/experiments/norm_switches.py`; the figures: benchmarks/RESULTS.md, norm_switches): norm_output on,
    and no joint RMSNorm over the three aux layers' states, whose scales differ by layer.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(ge=1, description="draft hidden size H (the target's)")
    target_hidden_size: int = Field(ge=1, description="hidden size of the target's aux states (fc input is 3x this)")
    num_attention_heads: int = Field(ge=1, description="query heads of the draft layer (the target's)")
    num_key_value_heads: int = Field(ge=1, description="kv heads (GQA) of the draft layer (the target's)")
    head_dim: int = Field(ge=1, description="attention head dim (the target's)")
    intermediate_size: int = Field(ge=1, description="MLP width (the target's)")
    rms_norm_eps: float = Field(gt=0, description="RMSNorm epsilon (the target's)")
    rope_theta: float = Field(gt=0, description="RoPE base, exactly the target's")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="the target's RoPE scaling (`rope_type` plus its parameters); None = plain RoPE"
    )
    max_position_embeddings: int = Field(ge=1, description="the target's max positions (some RoPE scalings use it)")
    vocab_size: int = Field(ge=1, description="target vocab size V (embedding rows; vLLM's `vocab_size`)")
    draft_vocab_size: int = Field(ge=1, description="draft vocab size Vd (lm_head rows)")
    aux_layer_ids: tuple[int, int, int] = Field(
        description="vLLM-convention ids of the 3 aux states (id k = residual stream entering layer k)"
    )
    norm_before_fc: bool = Field(
        False, description="RMSNorm (`input_norm`) over the 3H input of fc (speculators' default, off here by "
        "measurement)"
    )
    fc_norm: bool = Field(
        False, description="one RMSNorm per aux layer (`fc_norm.0..2`) over fc's input: the three layers' states "
        "differ in scale by orders of magnitude, and a norm per layer gives fc inputs of one scale (EAGLE-3.1); "
        "vLLM reads it as the config's `fc_norm`"
    )
    norm_output: bool = Field(
        True, description="pass the normed output (not the pre-norm one) to the next step"
    )
    norm_before_residual: bool = Field(
        False, description="residual of the draft layer is hidden_norm(h) instead of h (off here by measurement)"
    )
    layer: Literal["llama", "mla"] = Field(
        "llama", description="the draft layer: a Llama layer (any target), or DeepSeek-V3's MLA attention + a dense "
        "MLP (an MLA target's own attention widths and RoPE; what vLLM serves as Eagle3DeepseekV3ForCausalLM)"
    )
    q_lora_rank: int | None = Field(None, ge=1, description="MLA: query low-rank width (None: a full q_proj)")
    kv_lora_rank: int | None = Field(None, ge=1, description="MLA: key/value latent width")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="MLA: per-head query/key part without RoPE")
    qk_rope_head_dim: int | None = Field(None, ge=1, description="MLA: per-head query/key part with RoPE")
    v_head_dim: int | None = Field(None, ge=1, description="MLA: per-head value width")

    @field_validator("aux_layer_ids")
    @classmethod
    def _aux(cls, v: tuple[int, int, int]) -> tuple[int, int, int]:
        return tuple(check_aux_ids(v))  # type: ignore[return-value]

    @field_validator("rope_scaling")
    @classmethod
    def _rope(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and "rope_type" not in v:
            raise ValueError(f"rope_scaling needs a 'rope_type' (got keys {sorted(v)})")
        return v

    @model_validator(mode="after")
    def _check(self) -> "DraftConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) exceeds the target vocab ({self.vocab_size})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer == "mla":
            widths = {k: getattr(self, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                     "v_head_dim")}
            if None in widths.values():
                raise ValueError(f"an MLA draft layer needs the target's MLA widths, got {widths}")
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim or self.v_head_dim > self.head_dim:
                raise ValueError(f"an MLA draft layer's head_dim ({self.head_dim}) is qk_nope_head_dim + "
                                 f"qk_rope_head_dim, and v_head_dim ({self.v_head_dim}) at most that")
            if self.norm_before_fc:
                raise ValueError("norm_before_fc does not exist for an MLA draft layer: vLLM's "
                                 "Eagle3DeepseekV3ForCausalLM has no norm over fc's input, so it would serve a "
                                 "different function than the one trained")
        return self

    @property
    def attn_scale(self) -> float | None:
        """The softmax scale when it is not head_dim^-0.5 (None): an MLA layer's (nope + rope)^-0.5 times YaRN's
        mscale(factor, mscale_all_dim)^2, as DeepSeek-V3 and vLLM's MLA attention scale it."""
        if self.layer != "mla":
            return None
        scale = self.head_dim ** -0.5
        r = self.rope_scaling or {}
        if r.get("rope_type") == "yarn" and r.get("mscale_all_dim"):
            m = 0.1 * float(r["mscale_all_dim"]) * math.log(float(r["factor"])) + 1.0 if float(r["factor"]) > 1 else 1.0
            scale *= m * m
        return scale

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """transformers-5 form: {'rope_type', 'rope_theta', ...scaling parameters}."""
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    @classmethod
    def from_target(
        cls,
        target: "str | Path | dict[str, Any] | Target",
        draft_vocab_size: int,
        aux_layer_ids: tuple[int, int, int] | list[int] | None = None,
        layer: str = "llama",
        **switches: bool,
    ) -> "DraftConfig":
        """Draft config for a target: its HF dir, a `Target`, or a (text) config.json dict.

        The draft layer copies the target's layer shape and RoPE (theta + scaling) exactly, except
        for an MLA target (DeepSeek-V3, Kimi-K2.5): its attention has no Llama head layout (its
        config's `head_dim` is the 64-wide RoPE part of a 192-wide query), so the draft takes
        `MLA_DRAFT_HEAD_DIM` (128) with the target's head counts, and plain RoPE at the target's
        theta. DeepSeek's YaRN variant (`mscale`, `mscale_all_dim`) is not read the same way by a
        Llama layer in vLLM as in transformers, and a draft must compute exactly what serving
        computes; training samples sit within the YaRN's original context anyway.
        `layer="mla"` (an MLA target only) keeps the target's own attention: its MLA widths, head count and
        RoPE, YaRN included, which vLLM's MLA draft layer computes as the target does.
        `aux_layer_ids` defaults to vLLM's (2, N//2, N-3). `switches` sets norm_before_fc, fc_norm,
        norm_output and norm_before_residual.
        """
        if isinstance(target, (str, Path)):
            target = Target.open(target)
        cfg = target.text if isinstance(target, Target) else text_config(dict(target))
        n = cfg["num_hidden_layers"]
        aux = tuple(aux_layer_ids) if aux_layer_ids is not None else tuple(default_aux_ids(n))
        if len(aux) != 3 or not all(0 <= i <= n for i in aux):
            raise ValueError(f"aux_layer_ids must be 3 ids in [0, {n}], got {aux}")
        H = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        theta, scaling = rope_of(cfg)
        head_dim, scaling, mla = _attention_shape(cfg, layer, cfg.get("head_dim") or H // heads, scaling)
        return cls(
            hidden_size=H,
            target_hidden_size=H,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=aux,
            layer=layer,
            **mla,
            **switches,
        )


# ---------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 like HF's and vLLM's: weight * (x / rms(x)).to(x.dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm that keeps only x and 1/rms [.., 1] for backward (plain autograd also keeps the
    normalized x in fp32, a second [T, H] per norm: 5 norms per TTT step) and recomputes the rest."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [.., 1]
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        gw = (gy * xhat.to(x.dtype)).reshape(-1, weight.shape[0]).sum(0)
        g = gy.float() * weight.float()  # d loss / d xhat
        gx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw.to(weight.dtype), None


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up keeping gate and up only (autograd also keeps silu(gate), a [T, I] tensor)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        return g * up * s * (1 + gate * (1 - s)), g * gate * s


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos, sin: [B, T, D] (HF's neox-style half rotation), in x's dtype.

    Under bf16 autocast q and k come from their projections in bf16 while the tables are fp32 (the
    frozen embedding is not autocast): without the cast q and k would leave in fp32 and v in bf16.
    """
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Projections of the draft layer's attention; q/k/v read the 2H-wide concatenated input."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.n_q, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, self.n_q * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_q * self.head_dim, c.hidden_size, bias=False)


class MLAAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention, its projections reading the 2H-wide concatenated input (the
    names are DeepSeek's, as vLLM's Eagle3DeepseekV3ForCausalLM loads them)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.n_q = self.n_kv = c.num_attention_heads
        self.head_dim, self.nope, self.rope = c.head_dim, c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_dim = c.v_head_dim
        self.kv_lora = c.kv_lora_rank
        n, x = c.num_attention_heads, 2 * c.hidden_size
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(x, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, n * c.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(x, n * c.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(x, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * c.v_head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, 2H] -> q, k [B, heads, T, nope + rope] (RoPE on the last `rope` dims), v [B, heads, T, nope +
        rope] (the value's v_dim, then zeros)."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q = q.view(B, T, self.n_q, self.head_dim).transpose(1, 2)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, self.n_q, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        q_pe, k_pe = apply_rope_interleaved(q[..., self.nope:], k_pe[:, None], cos, sin)
        q = torch.cat([q[..., :self.nope], q_pe], -1)
        k = torch.cat([k_nope, k_pe.expand(B, self.n_q, T, self.rope)], -1)
        return q, k, F.pad(v, (0, self.head_dim - self.v_dim))


def apply_rope_interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """DeepSeek's RoPE on interleaved pairs (x0, x1), (x2, x3), ... (vLLM's is_neox_style=False): the pairs are
    gathered into halves first, then rotated as `apply_rope` does, so q and k leave in the same (permuted) layout
    and q . k is the rotated pairs' product. q [B, h, T, D], k [B, 1, T, D]; cos, sin [B, T, D]."""

    def halves(x):
        *lead, d = x.shape
        return x.view(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)

    return apply_rope(halves(q), cos, sin), apply_rope(halves(k), cos, sin)


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """The one draft layer (`midlayer`), split around attention so TTT can supply its own."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.scale = c.attn_scale  # the softmax scale (None: head_dim^-0.5)
        self.v_dim = c.v_head_dim if c.layer == "mla" else c.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLAAttention(c) if c.layer == "mla" else Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def project(self, embeds, hidden, cos, sin):
        """embeds, hidden: [B, T, H] -> q [B, Hq, T, D], k, v [B, Hkv, T, D] (RoPE applied), residual [B, T, H]."""
        hn = self.hidden_norm(hidden)
        residual = hn if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), hn], -1)  # [B, T, 2H]
        a = self.self_attn
        if isinstance(a, MLAAttention):
            return (*a.qkv(x, cos, sin), residual)
        B, T, _ = x.shape
        q = a.q_proj(x).view(B, T, a.n_q, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, a.n_kv, a.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn: [B, Hq, T, D] attention output -> the layer's pre-norm output [B, T, H]."""
        attn = attn[..., :self.v_dim]  # an MLA layer's values were padded to the q/k width
        B, Hq, T, D = attn.shape
        r = self.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, Hq * D)) + residual
        return r + self.mlp(self.post_attention_layernorm(r))


class KVCache:
    """The draft's keys/values for positions already run, [B, Hkv, T, D] each, in position order."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Keep the first n positions: drop the entries of rejected draft tokens."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class Eagle3Draft(nn.Module):
    """The EAGLE-3 draft head. State-dict keys are vLLM's native EAGLE-3 names."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        c = self.config = config
        # Frozen: the target's own embedding (from the verifier), shared with the target in vLLM.
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.input_norm = RMSNorm(3 * c.target_hidden_size, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in range(3))
                        if c.fc_norm else None)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = DecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # target_id = draft_id + d2t[draft_id]; t2d marks the target ids in the draft vocab
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.rotary_emb = _rotary(c)  # buffers only, non-persistent: not in the state dict
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """HF Llama's init for the trained Linear layers (normal, std 0.02); norms at 1."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.startswith(("input_norm", "fc_norm")):
                nn.init.ones_(p)
            elif name != "embed_tokens.weight":
                nn.init.normal_(p, std=std)

    @classmethod
    def from_verifier(cls, config: DraftConfig, verifier_dir: str | Path) -> "Eagle3Draft":
        """A fresh draft whose embedding, lm_head rows and vocab map come from `eagle3 verifier`'s output."""
        from safetensors import safe_open

        path = Path(verifier_dir) / VERIFIER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no verifier weights (run `eagle3 verifier` first)")
        model = cls(config)
        expect = {
            "embed_tokens": (model.embed_tokens.weight, (config.vocab_size, config.hidden_size)),
            "lm_head_draft": (model.lm_head.weight, (config.draft_vocab_size, config.hidden_size)),
            "d2t": (model.d2t, (config.draft_vocab_size,)),
            "t2d": (model.t2d, (config.vocab_size,)),
        }
        # tensor by tensor: never the whole file (its full lm_head too) in memory at once
        with safe_open(str(path), "pt") as f, torch.no_grad():
            for name, (dst, shape) in expect.items():
                if name not in f.keys():
                    raise ValueError(f"{path}: missing tensor {name!r}")
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise ValueError(f"{path}: {name} has shape {tuple(t.shape)}, the draft config needs {shape}")
                dst.copy_(t)
                del t
        return model

    # ------------------------------------------------------------ pieces
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [..., 3, Ht] (or [..., 3*Ht]) -> step-0 hidden [..., H] (vLLM's combine_hidden_states)."""
        if aux.shape[-1] != 3 * self.config.target_hidden_size:
            aux = aux.flatten(-2)  # [..., 3, Ht] -> [..., 3Ht], low | mid | high
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:  # [..., 3Ht] -> three [..., Ht] chunks, each normed on its own
            aux = torch.cat([n(x) for n, x in zip(self.fc_norm, aux.chunk(3, -1), strict=True)], -1)
        return self.fc(aux)

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [B, T, D] for position_ids [B, T], with the target's theta and scaling."""
        return self.rotary_emb(x, position_ids)

    def head(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm layer output [.., H] -> (normed state for the logits, state for the next step)."""
        normed = self.norm(out)
        return normed, (normed if self.config.norm_output else out)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Normed state [.., H] -> draft-vocab logits [.., Vd]."""
        return self.lm_head(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (target = draft + d2t[draft])."""
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------ serving-style step
    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over n new tokens, as vLLM's proposer runs it.

        input_ids: [B, n]; hidden: [B, n, H] -- `combine(aux)` for tokens the target has
        verified, else the previous step's next-state; position_ids: [B, n]. Queries attend
        causally to the cache plus themselves; their k/v are appended to `cache`.
        Returns (normed [B, n, H] -> `logits`, next-state [B, n, H]).
        """
        e = self.embed_tokens(input_ids)
        cos, sin = self.rope(e, position_ids)
        q, k, v, residual = self.midlayer.project(e, hidden, cos, sin)
        past = len(cache)
        k, v = cache.append(k, v)
        n = q.shape[2]
        # query i sits at cache index past + i and sees indices <= past + i
        mask = torch.arange(past + n, device=q.device)[None, :] <= (past + torch.arange(n, device=q.device))[:, None]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=self.midlayer.scale)
        return self.head(self.midlayer.finish(attn, residual))

    # ------------------------------------------------------------ training
    def ttt_forward(self, *args, **kwargs) -> list[torch.Tensor]:
        """`ttt_states` (same arguments) followed by lm_head: `steps` tensors of draft logits [B, L, Vd]."""
        return [self.logits(n) for n in self.ttt_states(*args, **kwargs)]

    def ttt_states(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        position_ids: torch.Tensor,
        steps: int,
        doc: torch.Tensor | None = None,
        block: int | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test: `steps` unrolled draft steps over packed rows. Returns per-step normed
        states (lm_head's input); the logits are `logits(state)`.

        input_ids: [B, L]; aux: [B, L, 3, Ht]; position_ids: [B, L], restarting at 0 per
        document (`doc` [B, L] defaults to the documents they imply).
        Step j at position t reads token input_ids[t + j + 1] and predicts token t + j + 2, i.e.
        the target's distribution at position t + j + 1 (`eagle3.train.loss` aligns it). Its
        RoPE position is position_ids[t] + j: where the token sits when served. Step 0's hidden is
        combine(aux); step j's is step j-1's next-state at the same position. Ids past the row
        end are 0; the loss masks those positions. Returns `steps` tensors [B, L, H].
        """
        from eagle3.model.attention import doc_ids_from_position_ids, ttt_attention

        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        B, L = input_ids.shape
        if aux.shape[:2] != (B, L) or position_ids.shape != (B, L):
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)}, aux {tuple(aux.shape)} and position_ids "
                f"{tuple(position_ids.shape)} must agree on [B, L]"
            )
        doc = doc_ids_from_position_ids(position_ids) if doc is None else doc
        h = self.combine(aux)  # [B, L, H]
        k0 = v0 = None
        kd: list[torch.Tensor] = []
        vd: list[torch.Tensor] = []
        states = []
        for j in range(steps):
            ids = F.pad(input_ids[:, j + 1 :], (0, j + 1), value=0)  # [B, L]: token t + j + 1
            e = self.embed_tokens(ids)
            cos, sin = self.rope(e, position_ids + j)
            q, k, v, residual = self.midlayer.project(e, h, cos, sin)
            if j == 0:
                k0, v0 = k, v
            else:
                kd.append(k)
                vd.append(v)
            attn = ttt_attention(q, k0, v0, kd, vd, doc, scale=self.midlayer.scale, block=block)
            normed, h = self.head(self.midlayer.finish(attn, residual))
            states.append(normed)
        return states


    @torch.no_grad()
    def ttt_states_at(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        steps: int,
        at: torch.Tensor,
        keep: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`ttt_states` of one sequence (B = 1, positions 0..L-1) read only where chains are needed, for
        inference: per step j, (positions t [n_j], normed states [n_j, H]) -- the rows t of ttt_states'
        step-j output.

        input_ids: [1, L]; aux: [1, L, 3, Ht]; at: [L] bool, the positions whose chains are wanted.
        keep(j, t, normed) -> bool [n_j]: which of step j's positions go on to step j + 1 (default all):
        a chain whose proposal j was rejected is never looked at again, and step j + 1 at t reads only
        step j's state at t, so the later steps shrink to the chains still alive.
        Step 0 runs every position through the projections (every chain attends to step-0 keys at
        s <= t) with one causal SDPA; its output and each later step run at the chosen positions only,
        a later step's queries attending to the step-0 keys s <= t plus the chain's own keys at t.
        """
        L = input_ids.shape[1]
        dev = input_ids.device
        e = self.embed_tokens(F.pad(input_ids[:, 1:], (0, 1), value=0))  # [1, L, H]: token t + 1
        pos = torch.arange(L, device=dev)[None]
        cos, sin = self.rope(e, pos)
        q, k0, v0, residual = self.midlayer.project(e, self.combine(aux), cos, sin)  # q [1, Hq, L, D]
        attn = F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=True, scale=self.midlayer.scale)
        t = at.nonzero()[:, 0]  # [n]
        normed, h = self.head(self.midlayer.finish(attn[:, :, t], residual[:, t]))  # [1, n, H]
        out = [(t, normed[0])]
        kd: list[torch.Tensor] = []  # keys / values of steps 1..j at the alive positions, [1, Hkv, n, D] each
        vd: list[torch.Tensor] = []
        ids = F.pad(input_ids[0], (0, steps + 1), value=0)  # [L + steps + 1]: zeros past the end, as ttt_states
        for j in range(1, steps):
            alive = keep(j - 1, t, normed[0]) if keep is not None else torch.ones_like(t, dtype=torch.bool)
            t, h = t[alive], h[:, alive]
            kd, vd = [x[:, :, alive] for x in kd], [x[:, :, alive] for x in vd]
            if not len(t):
                break
            e = self.embed_tokens(ids[t + j + 1])[None]  # [1, n, H]: the token step j reads
            cos, sin = self.rope(e, (t + j)[None])
            qj, kj, vj, residual = self.midlayer.project(e, h, cos, sin)
            kd.append(kj)
            vd.append(vj)
            n = len(t)
            # keys: step-0 keys of every position, then steps 1..j at the n chains; chain i sees s <= t_i and its own
            causal = torch.arange(L, device=dev)[None, :] <= t[:, None]  # [n, L]
            own = torch.eye(n, dtype=torch.bool, device=dev).repeat(1, j)  # [n, j * n]
            mask = torch.cat([causal, own], 1)
            attn = F.scaled_dot_product_attention(qj, torch.cat([k0, *kd], 2), torch.cat([v0, *vd], 2),
                                                  attn_mask=mask, enable_gqa=True,
                                                  scale=self.midlayer.scale)  # [1, Hq, n, D]
            normed, h = self.head(self.midlayer.finish(attn, residual))
            out.append((t, normed[0]))
        if keep is not None and len(t):
            keep(len(out) - 1, t, normed[0])  # the last step's proposals are read too
        return out


def _rotary(c: DraftConfig) -> nn.Module:
    """HF's own Llama rotary module, so every rope_type (llama3, yarn, dynamic, ...) is the target's exactly; for
    an MLA layer DeepSeek-V3's, over the qk_rope_head_dim part (its YaRN tables carry DeepSeek's mscale ratio)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if c.layer == "mla":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        return DeepseekV3RotaryEmbedding(DeepseekV3Config(
            hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, qk_rope_head_dim=c.qk_rope_head_dim,
            qk_nope_head_dim=c.qk_nope_head_dim, v_head_dim=c.v_head_dim, kv_lora_rank=c.kv_lora_rank,
            q_lora_rank=c.q_lora_rank, max_position_embeddings=c.max_position_embeddings,
            rope_parameters=c.rope_parameters))

    lc = LlamaConfig(
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=c.rope_parameters,
    )
    return LlamaRotaryEmbedding(lc)
