"""Chain speculative decoding at batch size 1 (live `eagle3 eval`): a target, a proposer, vLLM's counters.

Chain speculative decoding at batch size 1, greedy verification, KV caches on both sides:

    prefill   target(prompt)                  -> first token g, aux states of the prompt
    loop      draft.propose(ids, new aux, k)  -> d_1..d_k                      (k draft forwards)
              target([last, d_1..d_k])        -> greedy g_0..g_k, aux [k+1, 3, H]  (one verify pass)
              n = leading matches d_{i+1} == g_i; emit d_1..d_n, g_n; crop the target cache

The draft behaves as vLLM's EAGLE-3 proposer (`vllm/v1/spec_decode/eagle.py`, read for this):
* the first draft forward of a round runs over the positions the target has just verified: it
  reads the target's combined aux state at position p and the token at p+1 (vLLM shifts the
  target's token ids left by one and puts the newly sampled token last), at RoPE position p;
* each further step feeds back the draft's own output state of the previous step, with the
  proposed token, one position further;
* the draft keeps its own KV cache. Entries written by the speculative steps of a round sit at
  positions the next round re-covers with verified states, so they are dropped (vLLM overwrites
  the same slots).

Statistics follow vLLM's counters (`vllm/v1/spec_decode/metrics.py`): one "draft" per verify
pass, `accepted` = n, `accepted_per_pos[i]` += 1 when position i+1 was accepted;
tau = 1 + accepted / drafts. Plain greedy decoding of the target runs in the same process over
the same prompts: its output is the lossless reference and its wall time the speedup baseline.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from eagle3.decoding.cpu_linear import packed_linears
from eagle3.decoding.generate import finish
from eagle3.eval.prompts import Conversation
from eagle3.model.capture import catch
from eagle3.model.draft import Eagle3Draft, KVCache
from eagle3.model.target import prompt_ids


class TargetLM:
    """An HF causal LM at batch size 1 with a KV cache; optionally catches the aux states at vLLM's
    layer ids (`eagle3.model.capture`; the plain-greedy baseline runs without hooks)."""

    def __init__(self, model: torch.nn.Module, aux_ids: Sequence[int] | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = None
        self.aux_ids = list(aux_ids or [])
        self.base = model.get_decoder()
        n = len(self.base.layers)
        bad = [k for k in self.aux_ids if not 0 <= k <= n]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside [0, {n}] for this {n}-layer target")

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def forward(self, ids: Sequence[int], last_only: bool = False) -> tuple[list[int], torch.Tensor | None]:
        """Run new tokens after the cache -> (greedy next ids [n] (or [1]), aux [n, 3, H] or None)."""
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        with catch(self.base, self.aux_ids) as caught:  # each [1, n, H]
            out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True,
                             logits_to_keep=1 if last_only else 0)
        nxt = out.logits[0].argmax(-1).tolist()  # [n] or [1]
        aux = torch.stack([c[0] for c in caught], 1) if caught else None  # [n, 3, H]
        return nxt, aux

    def crop(self, n: int) -> None:
        """Keep the first n cached positions (drop rejected draft tokens)."""
        drop = self.cache.get_seq_length() - n
        if drop > 0:
            self.cache.crop(-drop)  # transformers 5: a negative count removes that many from the end


# ================================================================ proposers
class Proposer(Protocol):
    """What the decoding loop asks of a draft. The real head and the test drafts both implement it."""

    def reset(self) -> None:
        """Start a new sequence."""

    def propose(self, ids: list[int], aux: torch.Tensor, k: int) -> list[int]:
        """k target-vocab token ids to follow `ids`.

        ids: the verified sequence t_0..t_{L-1} (its last token was sampled by the target and has
        no target state yet); aux [m, 3, H]: the target's aux states of positions L-1-m .. L-2,
        i.e. those verified since the previous call.
        """


class DraftProposer:
    """An Eagle3Draft run as vLLM's proposer runs it, with its own KV cache."""

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft
        self.device = next(draft.parameters()).device
        self.dtype = draft.fc.weight.dtype
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache()
        self.n_ctx = 0  # positions whose target state the draft has consumed (its verified cache)

    @torch.inference_mode()
    def propose(self, ids: list[int], aux: torch.Tensor, k: int) -> list[int]:
        dr = self.draft
        m, p0 = aux.shape[0], self.n_ctx
        if p0 + m != len(ids) - 1:
            raise RuntimeError(f"draft has states for {p0} positions, got {m} more, but the sequence holds {len(ids)}")
        # Entries past p0 came from last round's speculative steps: those positions are now verified.
        self.cache.crop(p0)
        tok = torch.tensor([ids[p0 + 1 : p0 + 1 + m]], device=self.device)  # [1, m]: token p+1 for state p
        pos = torch.arange(p0, p0 + m, device=self.device)[None]  # [1, m]
        h = dr.combine(aux[None].to(self.device, self.dtype))  # [1, m, H]
        normed, h = dr.step(tok, h, pos, self.cache)  # [1, m, H] each
        self.n_ctx = p0 + m
        normed, h = normed[:, -1:], h[:, -1:]  # the last verified position predicts t_L
        last = p0 + m - 1
        out: list[int] = []
        for j in range(k):
            nxt = dr.to_target_ids(dr.logits(normed).argmax(-1))  # [1, 1]
            out.append(int(nxt))
            if j + 1 == k:
                break
            # step j+1: the proposed token at position last + j + 1, fed the previous output state
            normed, h = dr.step(nxt, h, torch.tensor([[last + j + 1]], device=self.device), self.cache)
        return out


# ================================================================ decoding
@dataclass
class Stats:
    """vLLM's spec-decode counters for one run, and the accepted count of every round in order."""

    k: int
    drafts: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.per_pos = self.per_pos or [0] * self.k

    def add(self, n: int) -> None:
        self.rounds.append(n)
        self.drafts += 1
        self.accepted += n
        for i in range(n):
            self.per_pos[i] += 1

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def per_position(self) -> list[float]:
        return [c / self.drafts if self.drafts else 0.0 for c in self.per_pos]


@torch.inference_mode()
def greedy_generate(target: TargetLM, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Plain greedy decoding with a KV cache: the reference output and the speed baseline."""
    target.reset()
    (g,), _ = target.forward(prompt, last_only=True)
    out = [g]
    while len(out) < max_new and g not in eos:
        (g,), _ = target.forward([g])
        out.append(g)
    return out


@torch.inference_mode()
def speculative_generate(
    target: TargetLM, proposer: Proposer, prompt: list[int], k: int, max_new: int, eos: set[int], stats: Stats
) -> list[int]:
    """Chain speculative decoding with greedy verification; updates `stats` once per verify pass."""
    target.reset()
    proposer.reset()
    (g,), aux = target.forward(prompt, last_only=True)  # aux [T, 3, H]
    ids = list(prompt) + [g]
    out = [g]
    while len(out) < max_new and not eos.intersection(out):
        L = len(ids)
        draft = proposer.propose(ids, aux, k)  # [k]
        if len(draft) != k:
            raise RuntimeError(f"proposer returned {len(draft)} tokens, expected {k}")
        pred, aux = target.forward([ids[-1], *draft])  # pred [k+1]: greedy after t_{L-1}, d_1..d_k
        n = 0
        while n < k and draft[n] == pred[n]:
            n += 1
        stats.add(n)
        target.crop(L + n)  # t_0..t_{L-1}, d_1..d_n; the bonus token pred[n] is not run yet
        aux = aux[: n + 1]  # states of t_{L-1}, d_1..d_n: the next round's new draft inputs
        new = draft[:n] + [pred[n]]
        ids += new
        out += new
    return finish(out, eos, max_new, keep_stop=True).ids


def run_conversation(conv: Conversation, tokenizer, generate: Callable[[list[int]], list[int]]) -> list[list[int]]:
    """Answer every user turn; each later turn is conditioned on the model's own earlier answers."""
    msgs = list(conv.messages)
    answers: list[list[int]] = []
    for i in range(conv.turns):
        if i == 0:
            prompt = conv.ids if conv.ids is not None else prompt_ids(tokenizer, msgs)
        else:
            text = tokenizer.decode(answers[-1], skip_special_tokens=True)
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": conv.followups[i - 1]}]
            prompt = prompt_ids(tokenizer, msgs)
        answers.append(generate(prompt))
    return answers


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(
    target_model: torch.nn.Module,
    tokenizer,
    proposer: Proposer,
    aux_ids: Sequence[int],
    convs: Sequence[Conversation],
    k: int,
    max_new_tokens: int,
    eos: set[int],
    progress: Callable[[int, int], None] | None = None,
    cpu_linear: bool = True,
) -> dict[str, Any]:
    """Greedy and speculative decoding of every conversation, interleaved; returns the report dict.

    Per conversation the plain greedy run goes first, then the speculative run, so that load
    from other processes hits both alike. Only the generate calls are timed (not rendering).
    `cpu_linear`: on CPU, both runs use oneDNN-prepacked linear layers (`eagle3.decoding.cpu_linear`: a verify
    pass of k+1 tokens then costs about one plain step, as on a GPU; each row count 1..k+1 takes the
    fastest of that, a GEMV and stock F.linear, timed at entry). The report's `cpu_linear` names the
    kernel per row count.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    mods = [target_model] + ([proposer.draft] if isinstance(proposer, DraftProposer) else [])
    with packed_linears(*mods, rows=range(1, k + 2)) if cpu_linear else contextlib.nullcontext({}) as kernels:
        report = _measure(target_model, tokenizer, proposer, aux_ids, convs, k, max_new_tokens, eos, progress)
    return report | {"cpu_linear": kernels}


def _measure(target_model, tokenizer, proposer, aux_ids, convs, k, max_new_tokens, eos, progress) -> dict[str, Any]:
    plain, spec = TargetLM(target_model), TargetLM(target_model, aux_ids)
    stats = Stats(k)
    t_plain = t_spec = 0.0
    n_plain = n_spec = 0
    items = []

    # One short warm-up of each path: the first forward pays allocator and kernel setup.
    warm = prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    greedy_generate(plain, warm, 2, eos)
    speculative_generate(spec, proposer, warm, k, 2, eos, Stats(k))
    for i, conv in enumerate(convs):
        g = _Timed(lambda p: greedy_generate(plain, p, max_new_tokens, eos), plain.device)
        ref = run_conversation(conv, tokenizer, g)
        s = _Timed(lambda p: speculative_generate(spec, proposer, p, k, max_new_tokens, eos, stats), spec.device)
        got = run_conversation(conv, tokenizer, s)
        t_plain += g.seconds
        t_spec += s.seconds
        n_plain += sum(map(len, ref))
        n_spec += sum(map(len, got))
        items.append(compare(conv, ref, got, tokenizer))
        if progress is not None:
            progress(i + 1, len(convs))
    return summarize(k, convs, stats, items, (n_spec, t_spec), (n_plain, t_plain), max_new_tokens)


def compare(conv: Conversation, ref: list[list[int]], got: list[list[int]], tokenizer) -> dict[str, Any]:
    """Per-turn lossless check of one conversation (speculative `got` against greedy `ref`)."""
    return {
        "id": conv.id,
        "turns": [
            {"tokens": len(b), "lossless": a == b, "first_mismatch": _first_mismatch(a, b),
             "text": tokenizer.decode(b, skip_special_tokens=True)}
            for a, b in zip(ref, got, strict=True)
        ],
    }


def summarize(
    k: int, convs: Sequence[Conversation], stats: Stats, items: list[dict[str, Any]],
    spec: tuple[int, float], plain: tuple[int, float], max_new_tokens: int,
) -> dict[str, Any]:
    """The report dict (report.json's documented fields first). spec/plain: (generated tokens, seconds)."""
    tps = spec[0] / spec[1] if spec[1] else 0.0
    tps_plain = plain[0] / plain[1] if plain[1] else 0.0
    return {
        "acceptance_length": stats.tau,
        "per_position_acceptance": stats.per_position,
        "k": k,
        "num_prompts": len(convs),
        "num_turns": sum(c.turns for c in convs),
        "lossless": all(t.get("lossless", True) for it in items for t in it["turns"]),
        "tokens_per_second": tps,
        "target_tokens_per_second": tps_plain,
        "speedup_vs_target": tps / tps_plain if tps_plain else 0.0,
        "num_drafts": stats.drafts,
        "num_draft_tokens": stats.drafts * k,
        "num_accepted_tokens": stats.accepted,
        "num_accepted_tokens_per_pos": stats.per_pos,
        "generated_tokens": spec[0],
        "target_generated_tokens": plain[0],
        "spec_seconds": spec[1],
        "target_seconds": plain[1],
        "max_new_tokens": max_new_tokens,
        "items": items,
    }


class _Timed:
    """Wraps a generate function; accumulates its wall time (after a CUDA sync)."""

    def __init__(self, fn: Callable[[list[int]], list[int]], device: torch.device | None = None):
        self.fn, self.seconds = fn, 0.0
        self.cuda = device if device is not None and device.type == "cuda" else None

    def __call__(self, prompt: list[int]) -> list[int]:
        t = time.perf_counter()
        try:
            return self.fn(prompt)
        finally:
            if self.cuda is not None:
                torch.cuda.synchronize(self.cuda)
            self.seconds += time.perf_counter() - t
