"""Replay evaluation: the exact acceptance length of greedy chain speculative decoding, without decoding.

With greedy verification the output of speculative decoding is the target's greedy output, so every
round of a live run (`eagle3.eval.decode.speculative_generate`) can be reconstructed offline:

1. The target's greedy continuation S of every prompt, every turn, is generated once (batched,
   KV cache) and cached by content: the target (weights, tokenizer, template, stop ids), the
   prompts, max_new_tokens, device and dtype. A later turn's prompt holds the earlier answer as the
   live evaluator renders it. Decoding goes on `tail` >= k tokens past each answer's end: a round
   near the end checks proposals against the target's greedy tokens beyond it, as live verification does.
2. One target forward over each whole sequence gives the aux states (cached per aux layer ids; bf16,
   as the extract stage stores them for training).
3. One k-step training-time forward of the draft (`Eagle3Draft.ttt_states`, the TTT kernel) over each
   sequence. Step j at position t reads S[t+j+1] and the step j-1 state, and proposes S[t+j+2]; it
   attends to step-0 keys at positions <= t plus the chain's own steps at t. That is exactly what the
   live proposer computes at a round starting after S[t+1] whenever proposals 0..j-1 were right
   (its cache holds the verified positions' step-0 entries, recomputed from the target's states) --
   and a proposal after a wrong one is never looked at.
4. Rounds are walked as live decoding visits them: the prefill yields the first answer token, so the
   first round starts at t = len(prompt) - 1; a round accepts the longest prefix of matching
   proposals (a), emits a + 1 tokens (the bonus token is the target's) and the next round starts at
   t + a + 1; rounds go on while fewer than max_new tokens are out and none of them is a stop token.

Replay agrees with live decoding round for round up to float near-ties (the draft in one pass vs
step by step with a cache; a batched vs a batch-1 target). tau gets a 95% bootstrap CI over prompts.
It measures no speed and checks no losslessness: `eagle3 eval --mode live` does both.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.atomic import atomic_dir, atomic_path, sha256_json

FORMAT = 1
TURNS = "turns.jsonl"
Progress = Callable[[str], None]


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE_DIR", Path.home() / ".cache" / "eagle3")) / "replay"


@dataclass
class Turn:
    """One answered turn: the prompt's ids, then the target's greedy answer and `tail` tokens past it."""

    conv: str
    turn: int
    prompt_len: int
    ids: list[int]
    answer_len: int  # tokens of the answer as the live evaluator returns it (cut at max_new / after a stop)


# ---------------------------------------------------------------- step 1: greedy continuations
def continuations(target, model: torch.nn.Module, convs: Sequence, max_new: int, tail: int, *, batch_size: int = 32,
                  cache: Path | None = None, progress: Progress | None = None) -> tuple[list[Turn], Path, float]:
    """The target's greedy answer to every turn of every conversation (cached). Returns the turns, the
    cache dir and the seconds spent generating (0 when cached)."""
    from eagle3.config import RegenConfig
    from eagle3.eval.decode import finish_answer
    from eagle3.generate import HFGenerator
    from eagle3.target import prompt_ids

    p = next(model.parameters())
    key = sha256_json({
        "format": FORMAT, "target": target.generation_fingerprint(), "max_new": max_new, "tail": tail,
        "device": p.device.type, "dtype": str(p.dtype),
        "prompts": [[c.id, c.messages, c.followups, c.ids] for c in convs],
    })
    d = (cache or cache_root()) / key[:32]
    if (d / TURNS).is_file():
        with open(d / TURNS, encoding="utf-8") as f:
            return [Turn(**json.loads(line)) for line in f], d, 0.0

    tok, eos = target.tokenizer(), target.stop_ids()
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    gen = HFGenerator(model, eos, RegenConfig(max_new_tokens=max_new, batch_size=batch_size, batch_tokens=1 << 20),
                      pad, tail=tail)
    t0 = time.perf_counter()
    msgs = [list(c.messages) for c in convs]
    turns: list[Turn] = []
    prev: list[Turn | None] = [None] * len(convs)
    for i in range(max(c.turns for c in convs)):  # one wave per turn: turn i needs each answer to turn i-1
        todo = [n for n, c in enumerate(convs) if c.turns > i]
        prompts = []
        for n in todo:
            c = convs[n]
            if i == 0:
                prompts.append(c.ids if c.ids is not None else prompt_ids(tok, msgs[n]))
                continue
            answer = prev[n].ids[prev[n].prompt_len : prev[n].prompt_len + prev[n].answer_len]
            text = tok.decode(answer, skip_special_tokens=True)  # as run_conversation renders the next turn
            msgs[n] += [{"role": "assistant", "content": text}, {"role": "user", "content": c.followups[i - 1]}]
            prompts.append(prompt_ids(tok, msgs[n]))
        for n, prompt, g in zip(todo, prompts, gen.generate(prompts, [0] * len(prompts))):
            t = Turn(convs[n].id, i, len(prompt), list(prompt) + g.raw, len(finish_answer(g.raw, max_new, eos)))
            turns.append(t)
            prev[n] = t
        if progress is not None:
            progress(f"replay cache: turn {i + 1}: {len(todo)} answers, {gen.tokens} tokens, "
                     f"{gen.tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s")
    seconds = time.perf_counter() - t0
    with atomic_dir(d) as tmp:
        (tmp / TURNS).write_text("".join(json.dumps(t.__dict__) + "\n" for t in turns), encoding="utf-8")
        (tmp / "manifest.json").write_text(json.dumps({"format": FORMAT, "turns": len(turns), "max_new": max_new,
                                                        "tail": tail, "generate_seconds": round(seconds, 2)}))
    return turns, d, seconds


# ---------------------------------------------------------------- step 2: aux states
def aux_states(base: torch.nn.Module, turns: Sequence[Turn], aux_ids: Sequence[int], d: Path,
               batch_tokens: int = 8192) -> tuple[list[torch.Tensor], float]:
    """aux [T, 3, H] (bf16) of every turn's sequence, from one target forward each (cached in `d` per aux ids)."""
    from safetensors.torch import load_file, save_file

    from eagle3.capture import hidden_states

    path = d / f"aux-{'-'.join(map(str, aux_ids))}.safetensors"
    if path.is_file():
        t = load_file(str(path))
        return [t[str(i)] for i in range(len(turns))], 0.0
    t0 = time.perf_counter()
    out: dict[str, torch.Tensor] = {}
    for i, h in hidden_states(base, [torch.tensor(t.ids) for t in turns], aux_ids, batch_tokens):
        out[str(i)] = h.to(torch.bfloat16).contiguous()  # [T, 3, H]
    with atomic_path(path) as tmp:
        save_file(out, str(tmp))
    return [out[str(i)] for i in range(len(turns))], time.perf_counter() - t0


# ---------------------------------------------------------------- step 3: the draft's chains
def rounds_window(turn: Turn, max_new: int) -> range:
    """Positions t where a round of `walk` can start: t = prompt_len - 1 + (tokens out so far - 1) with
    fewer than min(answer_len, max_new) tokens out."""
    start = turn.prompt_len - 1
    return range(start, start + max(min(turn.answer_len, max_new), 1))


@torch.inference_mode()
def proposals(draft, turns: Sequence[Turn], aux: Sequence[torch.Tensor], k: int, max_new: int | None = None,
              pack: int = 4096, chunk: int = 1024) -> list[np.ndarray]:
    """props[i] [k, T_i]: the target id step j of the draft proposes at position t of turn i's sequence,
    at every t where a round can start (`rounds_window`; -1 elsewhere).

    Sequences are packed into rows of about `pack` tokens (positions restart per sequence, so the TTT
    attention never crosses one). The chains run at the rounds' positions only (`Eagle3Draft.ttt_states_at`:
    a prompt position costs the step-0 keys and values, nothing more), and the logits are formed `chunk`
    positions at a time.
    """
    dev = next(draft.parameters()).device
    dtype = draft.fc.weight.dtype
    big = 1 << 30 if max_new is None else max_new
    order = sorted(range(len(turns)), key=lambda i: -len(turns[i].ids))
    rows: list[list[int]] = []
    for i in order:  # first fit, longest first
        n = len(turns[i].ids)
        for r in rows:
            if sum(len(turns[j].ids) for j in r) + n <= pack:
                r.append(i)
                break
        else:
            rows.append([i])
    out: list[np.ndarray | None] = [None] * len(turns)
    for r in rows:
        ids = torch.tensor([t for i in r for t in turns[i].ids], device=dev)[None]  # [1, L]
        pos = torch.cat([torch.arange(len(turns[i].ids)) for i in r]).to(dev)[None]  # [1, L]
        a = torch.cat([aux[i] for i in r]).to(dev, dtype)[None]  # [1, L, 3, H]
        at = torch.zeros_like(ids, dtype=torch.bool)  # [1, L]
        base = 0
        for i in r:
            w = rounds_window(turns[i], big)
            at[0, base + w.start : base + min(w.stop, len(turns[i].ids))] = True
            base += len(turns[i].ids)
        states = draft.ttt_states_at(ids, a, pos, k, at)  # k x [n, H]
        props = torch.full((k, ids.shape[1]), -1, dtype=torch.long)
        cols = at[0].nonzero()[:, 0].cpu()
        for j, s in enumerate(states):
            props[j, cols] = torch.cat([draft.to_target_ids(draft.logits(s[c : c + chunk]).argmax(-1))
                                        for c in range(0, s.shape[0], chunk)]).cpu()
        props = props.numpy()
        base = 0
        for i in r:
            n = len(turns[i].ids)
            out[i] = props[:, base : base + n]
            base += n
    return out  # type: ignore[return-value]


# ---------------------------------------------------------------- step 4: the rounds
def walk(turn: Turn, props: np.ndarray, k: int, max_new: int, eos: set[int]) -> list[int]:
    """Accepted draft tokens per round, in the order live chain decoding runs its rounds."""
    s, L = turn.ids, turn.prompt_len
    if len(s) < L + min(turn.answer_len, max_new) + k:
        raise ValueError(f"turn {turn.conv}/{turn.turn}: the cached continuation ends before the last round's "
                         f"proposals can be checked (need tail >= k={k})")
    rounds, out, t = [], 1, L - 1  # the prefill emitted s[L]; the first round starts after it
    stopped = s[L] in eos
    while out < max_new and not stopped:
        if props[0, t] < 0:
            raise ValueError(f"turn {turn.conv}/{turn.turn}: no proposal at position {t} (outside the rounds' window)")
        a = 0
        while a < k and props[a, t] == s[t + 2 + a]:
            a += 1
        rounds.append(a)
        stopped = any(x in eos for x in s[t + 2 : t + 3 + a])  # the a accepted tokens and the bonus one
        out += a + 1
        t += a + 1
    return rounds


def bootstrap_ci(per_conv: list[tuple[int, int]], n: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile bootstrap CI of tau = 1 + accepted / drafts, resampling conversations."""
    acc = np.array([a for a, _ in per_conv], dtype=np.float64)
    drafts = np.array([d for _, d in per_conv], dtype=np.float64)
    if len(acc) < 2 or drafts.sum() == 0:
        tau = 1 + acc.sum() / max(drafts.sum(), 1)
        return [float(tau), float(tau)]
    idx = np.random.default_rng(seed).integers(0, len(acc), size=(n, len(acc)))
    taus = 1 + acc[idx].sum(1) / np.maximum(drafts[idx].sum(1), 1)
    return [float(np.percentile(taus, 2.5)), float(np.percentile(taus, 97.5))]


def replay(draft, turns: Sequence[Turn], aux: Sequence[torch.Tensor], convs: Sequence, k: int, max_new: int,
           eos: set[int]) -> dict[str, Any]:
    """The report dict of `eagle3.eval.decode.measure`, from replayed rounds (speed and lossless: None)."""
    from eagle3.eval.decode import Stats, summarize

    if any(k > len(t.ids) for t in turns):
        raise ValueError("a cached sequence is shorter than k")
    stats = Stats(k)
    props = proposals(draft, turns, aux, k, max_new)
    by_conv: dict[str, list[dict[str, Any]]] = {c.id: [] for c in convs}
    per_conv: dict[str, list[int]] = {c.id: [0, 0] for c in convs}
    for t, p in zip(turns, props):
        rounds = walk(t, p, k, max_new, eos)
        for a in rounds:
            stats.add(a)
        per_conv[t.conv][0] += sum(rounds)
        per_conv[t.conv][1] += len(rounds)
        by_conv[t.conv].append({"tokens": min(t.answer_len, max_new), "rounds": rounds})
    items = [{"id": c.id, "turns": by_conv[c.id]} for c in convs]
    n_tok = sum(t.answer_len for t in turns)
    r = summarize(k, convs, stats, items, (n_tok, 0.0), (n_tok, 0.0), max_new)
    r.update(mode="replay", lossless=None, tokens_per_second=None, target_tokens_per_second=None,
             speedup_vs_target=None, spec_seconds=None, target_seconds=None,
             acceptance_length_ci=bootstrap_ci(list(map(tuple, per_conv.values()))))
    return r
