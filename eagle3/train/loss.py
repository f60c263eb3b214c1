"""The EAGLE-3 loss, per TTT step: forward KL to the target's distribution over the draft vocab
(default), or an LK loss that aims at the acceptance rate itself.

LK ("LK losses", Samarin et al., arXiv 2602.23881, the hybrid of its sections 4.2/4.4): with
alpha = sum_v min(p_v, q_v) the overlap of target p and draft q (the acceptance rate of speculative
sampling, 1 - TV(p, q)), step j's loss is
    lambda_j * mean KL(p || q) + (1 - lambda_j) * mean (1 - alpha),   lambda_j = exp(-eta * mean alpha)
with lambda_j detached and computed once per step and batch (as speculators' `lk_hybrid` and
ModelOpt's `masked_lk_lambda_loss`, eta = 3): KL carries the cold start, where TV's gradient
(O(1/V) per logit) vanishes, and TV takes over as the overlap grows. alpha is the acceptance rate of
*sampled* verification; greedy verification (what `eagle3 eval` measures) accepts on top-1
agreement, so whether LK helps there is a measured question (benchmarks/experiments/levers.py).

Top-K (`loss="topk"`, the "harmonized objective distillation" of HASS, arXiv 2408.15766): KL plus
`topk_weight` times the cross-entropy of the draft on the target's K most likely tokens only,
    - sum_{v in topK(p)} p_v log q_v,
which adds weight where greedy verification decides (the head of p) and none on the long tail.

Targets: p = softmax(lm_head_d(norm(final))) where `final` is the target's last layer output
*before* its final norm, `norm` is the target's final RMSNorm and lm_head_d holds the target
lm_head rows of the draft vocab (so p is renormalized over the draft vocab). Forgetting the norm
dropped one model's acceptance from 40% to 25% (speculators #313).

Alignment (see `Eagle3Draft.ttt_forward`): step j at position t predicts token t + j + 2, whose
target distribution is the one at position t + j + 1. The position counts iff token t + j + 2
exists, lies in the same document as t, and is trainable (loss_mask == 1).

Out-of-draft-vocab rule. Where the target's argmax (over the *full* vocab) is not in the draft
vocab, the draft cannot propose the token the target would pick, so the step is rejected at
serving time whatever the draft does (greedy verification). Such positions are
  * left out of the KL (training toward a renormalized tail the verifier will reject is noise;
    SpecForge masks them the same way), and
  * counted as misses in the top-1 agreement, so simulated acceptance stays honest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from eagle3.runtime.floats import exp_

DEFAULT_STEP_DECAY = 0.8


def step_weights(steps: int, decay: float = DEFAULT_STEP_DECAY) -> list[float]:
    """EAGLE/SpecForge's weights decay**j for j = 0..steps-1 (speculators uses decay = 1)."""
    if steps < 1 or decay <= 0:
        raise ValueError(f"need steps >= 1 and decay > 0, got steps={steps}, decay={decay}")
    return [decay**j for j in range(steps)]


class TargetHead(torch.nn.Module):
    """The verifier's final norm + lm_head, turning stored final states into loss targets."""

    def __init__(
        self,
        norm_weight: torch.Tensor,
        eps: float,
        lm_head: torch.Tensor,
        d2t: torch.Tensor,
        chunk: int = 256,
    ):
        super().__init__()
        V, H = lm_head.shape
        Vd = d2t.shape[0]
        draft_to_target = torch.arange(Vd) + d2t.long()  # [Vd] target id of each draft id
        if draft_to_target.min() < 0 or draft_to_target.max() >= V or draft_to_target.unique().numel() != Vd:
            raise ValueError("d2t does not map the draft vocab onto distinct target ids in [0, V)")
        self.eps, self.chunk = eps, chunk
        self.register_buffer("norm_weight", norm_weight.float())
        self.register_buffer("lm_head", lm_head.float())  # [V, H], for the full-vocab argmax
        self.register_buffer("lm_head_draft", self.lm_head[draft_to_target].clone())  # [Vd, H]
        t2d_index = torch.full((V,), -1, dtype=torch.long)
        t2d_index[draft_to_target] = torch.arange(Vd)
        self.register_buffer("t2d_index", t2d_index)  # [V] draft id, or -1 outside the draft vocab

    @classmethod
    def from_verifier(cls, verifier_dir: str | Path, eps: float | None = None, chunk: int = 256,
                      lm_head: torch.Tensor | None = None) -> "TargetHead":
        """Load from `eagle3 verifier`'s output (eps from its manifest unless given). `lm_head`:
        use this [V, H] tensor instead of reading the file's (a tied target's head is the draft's
        embedding: one copy in memory, not two)."""
        from safetensors import safe_open

        from eagle3.storage.manifests import VerifierWeights

        man = VerifierWeights.read(verifier_dir)
        with safe_open(str(Path(verifier_dir) / man.file), "pt") as f:
            head = f.get_tensor("lm_head") if lm_head is None else lm_head
            return cls(f.get_tensor("norm"), man.rms_norm_eps if eps is None else eps, head, f.get_tensor("d2t"), chunk)

    @torch.no_grad()
    def forward(self, final: torch.Tensor, top: bool = True,
                need: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """final: [..., H] pre-norm last-layer states -> (logits over the draft vocab [..., Vd] fp32,
        draft id of the target's full-vocab argmax [...], -1 where it is outside the draft vocab).

        The argmax costs L x V x H (V/Vd times the draft logits: 39% of a first-epoch step at SmolLM2's
        shapes, `benchmarks/speed/train.py`); `top=False` skips it (None) for callers that already know it
        (the trainer caches it per sample), and `need` (bool [...]) computes it only where True, -1 elsewhere
        (the trainer: the positions whose next token is trainable, the only ones a loss reads).
        """
        x = final.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight  # RMSNorm
        logits = x @ self.lm_head_draft.T
        if not top:
            return logits, None
        flat = x.reshape(-1, x.shape[-1])
        rows = None if need is None else need.reshape(-1).nonzero().squeeze(1)
        sub = flat if rows is None else flat[rows]
        # full-vocab argmax in chunks of rows: never more than chunk x V logits alive
        arg = (torch.cat([(c @ self.lm_head.T).argmax(-1) for c in sub.split(self.chunk)]) if sub.numel()
               else flat.new_zeros(0, dtype=torch.long))
        out = self.t2d_index[arg]
        if rows is not None:
            out = out.new_full((flat.shape[0],), -1).index_copy_(0, rows, out)
        return logits, out.view(x.shape[:-1])


@dataclass
class TTTLossOutput:
    """The weighted loss plus per-step sums, so a trainer can aggregate across batches and ranks."""

    loss: torch.Tensor
    kl_sum: list[float] = field(default_factory=list)  # per step: summed KL over counted positions
    kl_count: list[int] = field(default_factory=list)  # per step: positions in the KL (in draft vocab)
    correct: list[int] = field(default_factory=list)  # per step: draft argmax == target argmax
    count: list[int] = field(default_factory=list)  # per step: loss-masked positions (top-1 denominator)
    hits: list[torch.Tensor] = field(default_factory=list)  # per step: [B, L] bool, the `correct` positions
    alpha_sum: list[float] = field(default_factory=list)  # per step: summed overlap sum_v min(p, q) (KL rows)

    @property
    def accuracy(self) -> list[float]:
        """Per-step top-1 agreement with the target: the inputs of simulated acceptance."""
        return [c / n if n else float("nan") for c, n in zip(self.correct, self.count, strict=True)]


def _shift(x: torch.Tensor, s: int, fill) -> torch.Tensor:
    """x[:, t + s] at t, `fill` past the end. x: [B, L, ...]."""
    pad = x.new_full((x.shape[0], s, *x.shape[2:]), fill)
    return torch.cat([x[:, s:], pad], 1)


def _check(k: int, weights, target_shape, target_top, loss_mask, doc) -> tuple[list[float], torch.Tensor]:
    weights = step_weights(k) if weights is None else list(weights)
    if len(weights) != k:
        raise ValueError(f"{len(weights)} step weights for {k} steps")
    B, L = target_shape[:2]
    if loss_mask.shape != (B, L) or target_top.shape != (B, L):
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} / target_top {tuple(target_top.shape)} "
                         f"must be [B, L] = [{B}, {L}]")
    doc = torch.zeros(B, L, dtype=torch.long, device=loss_mask.device) if doc is None else doc
    return weights, doc


def scored(loss_mask: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: the positions whose target a loss reads. Step j scores the target at s = t + j + 1 only where
    token s + 1 is trainable and in t's document (`_step_rows`), so s is where the next token is trainable
    and in the same document: 76% of the demo's ShareGPT tokens; never a document's last, so what is cached per
    sample does not depend on the pack it came in."""
    return torch.cat([loss_mask[:, 1:].bool() & (doc[:, 1:] == doc[:, :-1]),
                      loss_mask.new_zeros(loss_mask.shape[0], 1, dtype=torch.bool)], 1)


def _step_rows(j: int, target_top: torch.Tensor, loss_mask: torch.Tensor, doc: torch.Tensor):
    """Which positions step j scores. Returns (valid [B, L], top [B, L], KL rows (b, t)).

    Step j at t: target distribution at t + j + 1, predicted token t + j + 2. `valid`: that token
    exists, is in t's document and is trainable; `top`: draft id of the target argmax there
    (-1 = outside the draft vocab); the KL rows are the valid positions with top >= 0."""
    valid = _shift(loss_mask.bool(), j + 2, False) & (_shift(doc, j + 2, -1) == doc)
    top = _shift(target_top, j + 1, -1)
    b_idx, t_idx = (valid & (top >= 0)).nonzero(as_tuple=True)  # gather rows: no shifted [B, L, Vd] copy
    return valid, top, b_idx, t_idx


def ttt_loss(
    draft_logits: Sequence[torch.Tensor],
    target_logits: torch.Tensor,
    target_top: torch.Tensor,
    loss_mask: torch.Tensor,
    doc: torch.Tensor | None = None,
    weights: Sequence[float] | None = None,
    loss: str = "kl",
    eta: float = 3.0,
    topk: int = 10,
    topk_weight: float = 1.0,
) -> TTTLossOutput:
    """Weighted sum over steps j of the mean forward KL(p_target || q_draft_j), from draft logits
    (`loss="lk"`: the LK hybrid of the module docstring, with `eta`; `loss="topk"`: KL plus
    `topk_weight` x the top-`topk` cross-entropy).

    The plain autograd form, and the reference `ttt_loss_fused` is tested against.
    draft_logits: k tensors [B, L, Vd] (`Eagle3Draft.ttt_forward`); target_logits: [B, L, Vd]
    and target_top: [B, L] from `TargetHead` on the stored final states; loss_mask: [B, L]
    (1 = trainable token); doc: [B, L] document ids of packed rows (None = one per row);
    weights: per step, default 0.8**j.
    """
    weights, doc = _check(len(draft_logits), weights, target_logits.shape, target_top, loss_mask, doc)
    logp_all = target_logits.float().log_softmax(-1)  # [B, L, Vd]
    out = TTTLossOutput(loss=target_logits.new_zeros((), dtype=torch.float32))
    for j, (q_logits, w) in enumerate(zip(draft_logits, weights, strict=True)):
        valid, top, b_idx, t_idx = _step_rows(j, target_top, loss_mask, doc)
        logp = logp_all[b_idx, t_idx + j + 1]  # [N, Vd]
        p = logp.exp()
        z = q_logits[b_idx, t_idx].float()
        ce = F.cross_entropy(z, p, reduction="none")  # [N]
        kl = ce + (p * logp).sum(-1)  # [N] forward KL(p || q) = CE(p, q) - H(p)
        alpha = torch.minimum(p, z.softmax(-1)).sum(-1)  # [N] overlap = 1 - TV(p, q)
        with torch.no_grad():
            hit = (q_logits.argmax(-1) == top) & valid & (top >= 0)
        n = max(int(b_idx.numel()), 1)
        if loss == "lk":
            lam = lk_lambda(alpha.detach(), eta)
            out.loss = out.loss + w * (lam * kl.sum() + (1 - lam) * (1 - alpha).sum()) / n
        elif loss == "topk":
            pk = _top_only(p, topk)  # [N, Vd] p on its top-K, 0 elsewhere
            out.loss = out.loss + w * (kl.sum() - topk_weight * (pk * z.log_softmax(-1)).sum()) / n
        else:
            out.loss = out.loss + w * kl.sum() / n
        _record(out, kl.sum(), int(b_idx.numel()), hit, valid, alpha.sum())
    return out


def _top_only(p: torch.Tensor, k: int) -> torch.Tensor:
    """p [N, V] with all but each row's k largest entries zeroed."""
    idx = p.topk(min(k, p.shape[-1]), -1).indices
    return torch.zeros_like(p).scatter_(-1, idx, p.gather(-1, idx))


def lk_lambda(alpha: torch.Tensor, eta: float) -> float:
    """The LK hybrid's KL weight for one step: exp(-eta * mean overlap) over its scored rows (1 when none)."""
    return math.exp(-eta * float(alpha.mean())) if alpha.numel() else 1.0


def ttt_loss_fused(
    states: Sequence[torch.Tensor],
    lm_head: torch.Tensor,
    target_logits: torch.Tensor,
    target_top: torch.Tensor,
    loss_mask: torch.Tensor,
    doc: torch.Tensor | None = None,
    weights: Sequence[float] | None = None,
    chunk: int = 512,
    loss: str = "kl",
    eta: float = 3.0,
    topk: int = 10,
    topk_weight: float = 1.0,
) -> TTTLossOutput:
    """`ttt_loss(lm_head(states), ..., loss=loss, eta=eta, topk=topk, topk_weight=topk_weight)` without ever
    holding a [B, L, Vd] draft tensor.

    states: k tensors [B, L, H], the draft's normed states (`Eagle3Draft.ttt_states`);
    lm_head: the draft's lm_head weight [Vd, H]. The scored rows of all steps go through lm_head
    together, `chunk` rows at a time, each chunk's gradient formed on the spot (`_HeadKL`).
    Plain autograd keeps two [N, Vd] fp32 tensors per step for backward (log q and p): at
    L = 2048, Vd = 8192 and k = 3 that is 400 MB, the largest block of the trainer's peak
    memory. Same FLOPs. With `loss="lk"` each step's lambda needs that step's mean overlap before
    any gradient is formed: one more lm_head pass over the rows, without gradient, computes it.
    """
    weights, doc = _check(len(states), weights, target_logits.shape, target_top, loss_mask, doc)
    L = target_logits.shape[1]
    steps, hs, rows, scale = [], [], [], []
    for j, (h, w) in enumerate(zip(states, weights, strict=True)):
        valid, top, b_idx, t_idx = _step_rows(j, target_top, loss_mask, doc)
        steps.append((valid, top, b_idx, t_idx))
        hs.append(h[b_idx, t_idx])  # [N_j, H]
        rows.append(b_idx * L + t_idx + j + 1)  # row of the target distribution in [B * L, Vd]
        scale.append(torch.full((b_idx.numel(),), w / max(b_idx.numel(), 1), device=h.device))
    need_grad = torch.is_grad_enabled() and (lm_head.requires_grad or any(h.requires_grad for h in states))
    h_all, rows_all, tl = torch.cat(hs), torch.cat(rows), target_logits.reshape(-1, target_logits.shape[-1])
    sizes = [len(r) for r in rows]
    mix = None  # per row: the KL weight lambda of its step (the TV part gets 1 - lambda); None = pure KL
    if loss == "lk":
        with torch.no_grad():
            alpha = _overlap(h_all, lm_head, tl, rows_all, chunk)
        mix = torch.cat([torch.full((n,), lk_lambda(a, eta), device=h_all.device)
                         for n, a in zip(sizes, alpha.split(sizes), strict=True)])
    top = (topk, topk_weight) if loss == "topk" else None
    out_loss, kl, arg, alpha = _HeadKL.apply(h_all, lm_head, tl, rows_all, torch.cat(scale), chunk, need_grad, mix, top)
    out = TTTLossOutput(loss=out_loss)
    for (valid, top, b_idx, t_idx), kl_j, arg_j, a_j in zip(steps, kl.split(sizes), arg.split(sizes),
                                                             alpha.split(sizes), strict=True):
        hit = torch.zeros_like(valid)
        hit[b_idx, t_idx] = arg_j == top[b_idx, t_idx]
        _record(out, kl_j.sum(), int(b_idx.numel()), hit, valid, a_j.sum())
    return out


def _overlap(h: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor, rows: torch.Tensor,
             chunk: int) -> torch.Tensor:
    """alpha_i = sum_v min(p_iv, softmax(h_i W^T)_v) per row, chunk by chunk. h [N, H] -> [N]."""
    W = weight.float()
    out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk):
            q = (h[s : s + chunk].float() @ W.T).softmax(-1)
            p = target_logits[rows[s : s + chunk]].float().softmax(-1)
            out[s : s + chunk] = torch.minimum(p, q).sum(-1)
    return out


def _record(out: TTTLossOutput, kl_sum: torch.Tensor, n_kl: int, hit: torch.Tensor, valid: torch.Tensor,
            alpha_sum: torch.Tensor) -> None:
    out.kl_sum.append(float(kl_sum.detach()))
    out.alpha_sum.append(float(alpha_sum.detach()))
    out.kl_count.append(n_kl)
    out.correct.append(int(hit.sum()))
    out.count.append(int(valid.sum()))
    out.hits.append(hit)


class _HeadKL(torch.autograd.Function):
    """sum_i scale_i * KL(p_i || softmax(h_i W^T)) over rows i, p_i = softmax(target_logits[rows_i]);
    with `mix` [N]: sum_i scale_i * (mix_i * KL_i + (1 - mix_i) * (1 - alpha_i)), alpha_i = sum_v min(p_i, q_i);
    with `top` = (K, w): sum_i scale_i * (KL_i - w * sum_{v in topK(p_i)} p_iv log q_iv).

    The gradient is formed in the forward pass, chunk by chunk (d KL / d z = q - p; d (1 - alpha) / d z
    = q * (s - m) with m = [q < p], s = sum_v m_v q_v; d top-K CE / d z = q * sum(p_K) - p_K), so nothing
    of size [N, Vd] outlives a chunk; backward only scales the stored grads by the incoming scalar. Also
    returns each row's KL, the draft argmax (for top-1 agreement) and the overlap alpha.
    """

    @staticmethod
    def forward(ctx, h, weight, target_logits, rows, scale, chunk, need_grad, mix=None,
                top=None):  # h [N, H], weight [Vd, H], rows/scale/mix [N]
        W = weight.float()
        grad_h = torch.empty(h.shape, dtype=torch.float32, device=h.device) if need_grad else None
        grad_w = torch.zeros_like(W) if need_grad else None
        kl = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        alpha = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        tv_part = torch.zeros((), dtype=torch.float32, device=h.device)  # sum_i scale_i (1 - mix_i)(1 - alpha_i)
        top_part = torch.zeros((), dtype=torch.float32, device=h.device)  # sum_i scale_i w top-K CE_i
        arg = torch.empty(h.shape[0], dtype=torch.long, device=h.device)
        with torch.autocast(h.device.type, enabled=False):  # fp32 softmax and KL under bf16 autocast too
            for s in range(0, h.shape[0], chunk):
                hc = h[s : s + chunk].float()
                z = hc @ W.T  # [c, Vd] draft logits
                arg[s : s + chunk] = z.argmax(-1)
                logq = z.log_softmax(-1)
                logp = target_logits[rows[s : s + chunk]].float().log_softmax(-1)
                p = exp_(logp.clone())  # no denormal probabilities: CPUs crawl over them (runtime/floats.py)
                kl[s : s + chunk] = (p * (logp - logq)).sum(-1)
                sc = scale[s : s + chunk, None]
                if top is not None:
                    pk = _top_only(p, top[0])  # [c, Vd]
                    top_part -= (sc[:, 0] * top[1] * (pk * logq).sum(-1)).sum()
                q = exp_(logq)  # in place: log q is not needed again
                alpha[s : s + chunk] = torch.minimum(p, q).sum(-1)
                if mix is not None:
                    mx = mix[s : s + chunk, None]
                    tv_part += (sc * (1 - mx) * (1 - alpha[s : s + chunk, None])).sum()
                if not need_grad:  # validation: no gradient to form
                    continue
                if top is not None:  # scale * ((q - p) + w (q sum(p_K) - p_K))
                    dtop = q * pk.sum(-1, keepdim=True) - pk
                    dz = q.sub_(p).add_(dtop.mul_(top[1])).mul_(sc)
                elif mix is None:
                    dz = q.sub_(p).mul_(sc)  # scale * (softmax(z) - p), in place
                else:
                    m = (q < p).float()
                    tv = q * ((m * q).sum(-1, keepdim=True) - m)  # d (1 - alpha) / d z
                    dz = q.sub_(p).mul_(mx).add_(tv.mul_(1 - mx)).mul_(sc)
                grad_h[s : s + chunk] = dz @ W
                grad_w.addmm_(dz.T, hc)
        if need_grad:
            ctx.save_for_backward(grad_h.to(h.dtype), grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(kl, arg, alpha)
        total = (kl * scale).sum() + top_part if mix is None else (kl * scale * mix).sum() + tv_part
        return total, kl, arg, alpha

    @staticmethod
    def backward(ctx, g, _gkl, _garg, _galpha):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * g, grad_w * g, None, None, None, None, None, None, None
