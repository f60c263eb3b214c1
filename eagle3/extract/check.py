"""The final-layer check: the stored state of id N, through the target's final norm and lm_head, must pick the
token the target itself picks next.

Why. A store whose shapes are all right but whose last layer is the wrong one trains a head that collapses when it
is served, and nothing downstream notices. It has happened upstream: vLLM's DeepSeek-style backbone (DeepSeek-V3,
Kimi-K2.5, GLM-MoE) silently dropped the final layer's aux state until vLLM PR #46973 (2026-06), and an off-by-one
on the last layer id stores layer N - 1 with the right shapes. Shapes, dtypes and token ids cannot show it; the
target's own next-token choice can.

How. On a few samples of the first shard a run writes, the stored final states [T, H] go through the target's
final RMSNorm and lm_head (read from its shards, fp32); position t's argmax must equal the target's own choice of
token t + 1, taken through a path that never touches the capture of layer states:
- vLLM: the engine's `prompt_logprobs` (top 2) for the same prompts, from the engine that extracted;
- transformers: the model's own output (its final norm applied by transformers), through the same lm_head.

Near-ties flip with float noise (a bf16 engine against this fp32 product), so only positions whose reference
top-1 beats its runner-up by MARGIN nats count (FP8_MARGIN for a store whose final state is fp8, whose rounding
moves logits by tenths of a nat). A store agreeing on fewer than AGREE of them is refused, naming
the layer. Fewer than MIN_DECISIVE decisive positions is reported as not judged.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from eagle3.model.target import Target

MARGIN = 0.1  # nats between the reference's top-1 and top-2 for a position to count
FP8_MARGIN = 1.0  # the same for an fp8 final state
AGREE = 0.95  # share of counted positions the stored final state must reproduce
MIN_DECISIVE = 16  # fewer counted positions than this: reported, not judged
PROBE_SAMPLES = 4  # samples of the first shard written that the check reads
PROBE_TOKENS = 2048  # ... and at most this many tokens of them
VOCAB_CHUNK = 16384  # lm_head rows per matmul (a 163,840 x 7,168 head is never copied to fp32 whole)


@dataclass
class Tops:
    """The target's choice at each position t < T - 1 of a sample: token t + 1's argmax and its margin."""

    top1: torch.Tensor  # [T - 1] int64
    margin: torch.Tensor  # [T - 1] fp32, logit(top-1) - logit(top-2) (= the log-prob difference)


class Head:
    """The target's final RMSNorm and lm_head, read from its shards (the tied embedding when lm_head is tied)."""

    def __init__(self, target: Target):
        names = target.weight_names()
        self.norm_w = target.read(names["norm"]).float()
        self.lm_head = target.read(names["lm_head"] or names["embed_tokens"])  # [V, H], stored dtype
        self.eps = float(target.text.get("rms_norm_eps", 1e-6))

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] pre-norm -> the target's normed state, fp32."""
        x = x.float()
        return self.norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @torch.no_grad()
    def tops(self, normed: torch.Tensor) -> Tops:
        """normed [n, H] -> argmax of lm_head(normed) and the margin to the runner-up, over the vocab rows."""
        x = normed.float()
        best = torch.full((x.shape[0], 2), -float("inf"))
        idx = torch.zeros(x.shape[0], 2, dtype=torch.long)
        for lo in range(0, self.lm_head.shape[0], VOCAB_CHUNK):
            logits = x @ self.lm_head[lo:lo + VOCAB_CHUNK].float().T  # [n, chunk]
            v, i = logits.topk(min(2, logits.shape[1]), dim=-1)
            best, pick = torch.cat([best, v], 1).topk(2, dim=-1)
            idx = torch.cat([idx, i + lo], 1).gather(1, pick)
        return Tops(idx[:, 0], best[:, 0] - best[:, 1])


def stored_finals(path: str | os.PathLike, sample_ids: list[str]) -> dict[str, torch.Tensor]:
    """The final states [T, H] (fp32) of `sample_ids` as a written shard holds them, dequantized if fp8."""
    from eagle3.storage.store import as_sample, mmap_shard, shard_meta

    meta = shard_meta(path) or {}
    tensors = mmap_shard(path)
    out, off = {}, 0
    for sid, n in zip(meta.get("sample_ids", []), meta.get("lengths", []), strict=True):
        if sid in sample_ids and sid not in out:
            rec = {k: t[off:off + n] for k, t in tensors.items()}
            out[sid] = as_sample(sid, rec)["final_hidden_states"].float()
        off += n
    return out


def probe(sample_ids: list[str], lengths: list[int]) -> list[int]:
    """Positions in a shard's sample list the check reads: the first PROBE_SAMPLES distinct samples of 2+ tokens,
    within PROBE_TOKENS (at least one sample)."""
    out, seen, total = [], set(), 0
    for i, (sid, n) in enumerate(zip(sample_ids, lengths, strict=True)):
        if n < 2 or sid in seen:
            continue
        if out and (len(out) >= PROBE_SAMPLES or total + n > PROBE_TOKENS):
            break
        out.append(i)
        seen.add(sid)
        total += n
    return out


def on_shard(backend, target: Target, path: str | os.PathLike, sample_ids: list[str], lengths: list[int],
             ids_of, layer: int, storage: str) -> dict[str, Any]:
    """The check on a few samples of the shard `backend` just wrote at `path` (`ids_of(i)`: the token ids [T] of
    the shard's i-th sample): the result, not judged when the backend gives no reference next tokens."""
    refs_of = getattr(backend, "references", None)
    if refs_of is None:
        return {"judged": False, "passed": None,
                "why": f"the {getattr(backend, 'name', '?')} backend gives no reference next tokens"}
    samples = [(sample_ids[i], ids_of(i)) for i in probe(sample_ids, lengths)]
    head = Head(target)
    refs, source = refs_of(samples, head)
    finals = stored_finals(path, [sid for sid, _ in samples])
    return judge(finals, refs, head, layer, source, FP8_MARGIN if storage == "fp8" else MARGIN)


def judge(finals: dict[str, torch.Tensor], refs: dict[str, Tops], head: Head, layer: int, source: str,
          margin: float = MARGIN) -> dict[str, Any]:
    """Agreement of the stored final states with the reference choices, as the manifest records it."""
    decisive = agree = positions = 0
    for sid, ref in refs.items():
        got = head.tops(head.norm(finals[sid][:-1])).top1  # position t predicts token t + 1
        keep = ref.margin >= margin
        positions += int(ref.top1.numel())
        decisive += int(keep.sum())
        agree += int((got[keep] == ref.top1[keep]).sum())
    share = agree / decisive if decisive else None
    return {"layer": layer, "source": source, "samples": len(refs), "positions": positions, "decisive": decisive,
            "agree": agree, "agreement": None if share is None else round(share, 4), "margin_nats": margin,
            "required": AGREE, "judged": decisive >= MIN_DECISIVE,
            "passed": None if decisive < MIN_DECISIVE else share >= AGREE}


def refuse(result: dict[str, Any], where: str) -> None:
    """ValueError naming the layer when the judged agreement is below AGREE."""
    if result.get("passed") is False:
        raise ValueError(
            f"{where}: the stored final state (layer id {result['layer']}, which must be the last layer's output "
            f"before the final norm) reproduces the target's own next token at {result['agree']} of "
            f"{result['decisive']} decisive positions ({result['agreement']:.1%}; {AGREE:.0%} required; reference: "
            f"{result['source']}). The backend stored another layer there: this store would train a head that "
            "fails when served, so it is refused (the shards this run wrote are removed)"
        )


def merge(results: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One result for a store extracted in ranges: the ranges' counts added up (each range was judged alone)."""
    done = [r for r in results if r and "decisive" in r]
    if not done:
        return next((r for r in results if r), None)
    decisive, agree = sum(r["decisive"] for r in done), sum(r["agree"] for r in done)
    share = agree / decisive if decisive else None
    return {**done[0], "samples": sum(r["samples"] for r in done), "positions": sum(r["positions"] for r in done),
            "decisive": decisive, "agree": agree, "agreement": None if share is None else round(share, 4),
            "judged": any(r["judged"] for r in done),
            "passed": None if not any(r["judged"] for r in done) else all(r["passed"] is not False for r in done),
            "ranges": len(done)}
