"""The draft's optimizer: AdamW, or Muon for the hidden matrices with AdamW for the rest.

`build(model, params, cfg)` returns one `torch.optim.Optimizer` whose `param_groups` hold every trained
parameter, so the LR schedule (LambdaLR, which scales each group's own lr) and the checkpoint's
`state_dict` see one object either way.

Groups: lm_head gets `lr * head_lr_scale` when that is neither 1 (one group, as ever) nor 0 (the head is then
frozen and not among `params`).

Muon (`optimizer: muon`): the 2-D weights of the draft layer and fc take torch's Muon, which orthogonalises
each update by Newton-Schulz iterations; with `adjust_lr_fn="match_rms_adamw"` (Moonshot's scaling) an update
has about AdamW's RMS, so the same `lr` and schedule serve both. Norm weights (1-D) and lm_head, whose rows
are the target's token directions rather than a hidden map, stay on AdamW, as Muon's authors and the field
run it. torch's Muon runs its Newton-Schulz iterations in bf16; a CPU without bf16 units emulates those matmuls, and
there the draft's Muon step took 35 s against AdamW's 34 ms (2-core AVX2 host), so on such a CPU the same iteration
runs in fp32 (`newton_schulz_fp32`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from eagle3.config import TrainConfig
from eagle3.runtime import heap


def param_groups(model: nn.Module, params: list[nn.Parameter], cfg: TrainConfig) -> list[dict[str, Any]]:
    """AdamW's groups: one, or the body and lm_head at `lr * head_lr_scale`."""
    if cfg.head_lr_scale in (0.0, 1.0):
        return [{"params": params}]
    head = _head_ids(model)
    return [{"params": [p for p in params if id(p) not in head]},
            {"params": [p for p in params if id(p) in head], "lr": cfg.lr * cfg.head_lr_scale}]


def build(model: nn.Module, params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer `cfg.optimizer` names over `params` (the trained parameters of `model`)."""
    adamw = dict(lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(param_groups(model, params, cfg), **adamw)
    head = _head_ids(model)
    matrices = [p for p in params if p.ndim == 2 and id(p) not in head]
    ids = {id(p) for p in matrices}
    rest = [p for p in params if id(p) not in ids]
    muon = torch.optim.Muon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    from eagle3.runtime.floats import cpu_bf16

    emulated = bool(matrices) and matrices[0].device.type == "cpu" and not cpu_bf16()
    return MuonAdamW(muon, torch.optim.AdamW(param_groups(model, rest, cfg), **adamw), ns_fp32=emulated)


def newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                       eps: float) -> torch.Tensor:
    """torch's Muon orthogonalisation (the quintic Newton-Schulz iteration, its coefficients and steps, the
    update scaled to spectral norm <= 1, a tall matrix transposed) computed in fp32 instead of bf16. [m, n] ->
    [m, n]."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _head_ids(model: nn.Module) -> set[int]:
    return {id(p) for n, p in model.named_parameters() if n.endswith("lm_head.weight")}


class MuonAdamW(torch.optim.Optimizer):
    """Two optimizers stepped as one: `param_groups` is Muon's groups then AdamW's (the same dicts, so a
    scheduler's lr reaches both); `state_dict` nests each one's own."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer, ns_fp32: bool = False):
        self.parts = (muon, adamw)
        self.ns_fp32 = ns_fp32  # Muon's iteration in fp32 (a CPU without bf16 units: see the module docstring)
        super().__init__([p for o in self.parts for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in self.parts for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        if not self.ns_fp32:
            self.parts[0].step()
        else:  # torch's Muon looks its iteration up in its module at each step: swapped in for this step only
            from torch.optim import _muon

            bf16 = _muon._zeropower_via_newtonschulz
            _muon._zeropower_via_newtonschulz = newton_schulz_fp32
            try:
                self.parts[0].step()
            finally:
                _muon._zeropower_via_newtonschulz = bf16
        self.parts[1].step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.parts[0].state_dict(), "adamw": self.parts[1].state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.parts[0].load_state_dict(state["muon"])
        self.parts[1].load_state_dict(state["adamw"])
        self.param_groups = [g for o in self.parts for g in o.param_groups]  # loading made new group dicts


def lr_lambda(cfg: TrainConfig, total: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return f



def step(params: list[nn.Parameter], opt: torch.optim.Optimizer, clip: float, sched=None) -> torch.Tensor:
    """Clip, step and zero the grads; returns the pre-clip gradient norm.

    The step's freed activations stay in the process heap for the next step (`eagle3.runtime.heap`, set up
    by `train`): handing them back to the OS each step and faulting them in again cost ~190k page
    faults per 2048-token step on CPU. Under EAGLE3_HEAP=release they are handed back here."""
    gnorm = torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    if params and params[0].device.type == "cpu":
        heap.release()
    return gnorm
