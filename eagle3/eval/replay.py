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

Steps 3 and 4 live in eagle3/decoding/chains.py, which the trainer's replay validation shares (`build_replay_set`
below makes its replay set: held-out prompts answered the same way).

Replay agrees with live decoding round for round up to float near-ties (the draft in one pass vs
step by step with a cache; a batched vs a batch-1 target). tau gets a 95% bootstrap CI over prompts.
It measures no speed and checks no losslessness: `eagle3 eval --mode live` does both.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.decoding.batch_decode import answer_rows, kv_bytes_per_token
from eagle3.decoding.chains import FORMAT, MANIFEST, TURNS, Turn, aux_path, proposals, walk
from eagle3.storage.atomic import atomic_dir, atomic_path, clean_temp_files
from eagle3.storage.hashing import sha256_json

Progress = Callable[[str], None]


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE_DIR", Path.home() / ".cache" / "eagle3")) / "replay"


# ---------------------------------------------------------------- step 1: greedy continuations
def cache_dir(target, convs: Sequence, max_new: int, tail: int, device_type: str, dtype: torch.dtype,
              cache: Path | None = None) -> Path:
    """Where the continuations of `convs` live: keyed by everything that changes them."""
    key = sha256_json({
        "format": FORMAT, "target": target.generation_fingerprint(), "max_new": max_new, "tail": tail,
        "device": device_type, "dtype": str(dtype),
        "prompts": [[c.id, c.messages, c.followups, c.ids] for c in convs],
    })
    return (cache or cache_root()) / key[:32]


def continuations(target, model: torch.nn.Module, convs: Sequence, max_new: int, tail: int, *, batch_size: int = 128,
                  cache: Path | None = None, progress: Progress | None = None,
                  free_bytes: int | None = None) -> tuple[list[Turn], Path, float]:
    """The target's greedy answer to every turn of every conversation (cached). Returns the turns, the
    cache dir and the seconds spent generating (0 when cached). `progress` gets a line at least every 20 s:
    decode steps done, tok/s, rows left and an ETA (an upper bound: rows stop early).

    batch_size: rows decoded together at most. Rows leave the batch as they finish, so a wave split into a full
    batch and a small remainder runs the remainder at a poor rate; the default takes MT-Bench's 80
    turns of a wave in one batch. Fewer rows go together when their KV cache would not fit in `free_bytes`
    (default: MemAvailable as each wave starts; eagle3/decoding/batch_decode.py, `answer_rows`)."""
    p = next(model.parameters())
    d = cache_dir(target, convs, max_new, tail, p.device.type, p.dtype, cache)
    with build_lock(d):  # a second builder of the same cache waits, then reads it
        return _continuations(target, model, convs, max_new, tail, batch_size, d, progress, free_bytes)


@contextlib.contextmanager
def build_lock(d: Path):
    """Held while `d` (a cache dir) is built or extended: one builder per cache at a time, on this host. Taken,
    it removes what a killed builder of `d` left: its temp dir beside `d` and the temp files inside it."""
    from eagle3.storage.lock import RunLock

    with RunLock(d.parent / f".{d.name}.lock", wait_s=7 * 24 * 3600):
        for t in d.parent.glob(f".{d.name}.*.tmp"):
            shutil.rmtree(t, ignore_errors=True) if t.is_dir() else t.unlink(missing_ok=True)
        clean_temp_files(d)
        yield


def _continuations(target, model, convs, max_new, tail, batch_size, d, progress,
                   free_bytes) -> tuple[list[Turn], Path, float]:
    from eagle3.config import RegenConfig
    from eagle3.decoding.generate import HFGenerator, finish

    if (d / TURNS).is_file():
        with open(d / TURNS, encoding="utf-8") as f:
            return [Turn(**json.loads(line)) for line in f], d, 0.0

    from eagle3.runtime.heap import proc_bytes
    from eagle3.runtime.progress import Meter

    tok, eos = target.tokenizer(), target.stop_ids()
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    gen = HFGenerator(model, eos, RegenConfig(max_new_tokens=max_new, batch_size=batch_size, batch_tokens=1 << 20),
                      pad, tail=tail)
    p = next(model.parameters())
    per_token = kv_bytes_per_token(model.config, p.dtype) if p.device.type == "cpu" else None
    t0 = time.perf_counter()
    msgs = [list(c.messages) for c in convs]
    turns: list[Turn] = []
    prev: list[Turn | None] = [None] * len(convs)
    waves = max(c.turns for c in convs)

    def tokens() -> str:
        return f"{gen.tokens:,} tokens at {gen.tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s"

    # In decode steps, every wave counted at its whole length: an upper bound (most rows stop early).
    meter = Meter("replay answers", waves * (max_new + tail), "steps", say=progress)
    for i in range(waves):  # one wave per turn: turn i needs each answer to turn i-1
        todo = [n for n, c in enumerate(convs) if c.turns > i]
        prompts = [_next_prompt(tok, convs[n], msgs[n], prev[n], i) for n in todo]
        if per_token is not None:  # on CPU, as many rows as fit beside what is resident now
            free = free_bytes if free_bytes is not None else proc_bytes("/proc/meminfo", "MemAvailable")
            rows = answer_rows(per_token, max(map(len, prompts)) + max_new + tail, free, batch_size)
            gen.cfg = gen.cfg.model_copy(update={"batch_size": rows})
        span, batches, seen = max_new + tail, -(-len(todo) // gen.cfg.batch_size), [0]  # seen: batches finished

        def step(done: int, left: int, *, i=i, batches=batches, span=span, seen=seen) -> None:
            # a wave's batches share its `span` steps: step s of batch b stands at (b + s / span) / batches of it
            meter.update(i * span + min(int((seen[0] + done / span) / batches * span), span - 1),  # the wave's end says
                         f"turn {i + 1}/{waves}, {left} rows decoding, {tokens()}")
            seen[0] += left == 0
        gen.on_step = step
        for n, prompt, g in zip(todo, prompts, gen.generate(prompts, [0] * len(prompts)), strict=True):
            answer = finish(g.raw, eos, max_new, keep_stop=True).ids
            t = Turn(convs[n].id, i, len(prompt), list(prompt) + g.raw, len(answer))
            turns.append(t)
            prev[n] = t
        meter.update((i + 1) * span, f"turn {i + 1}/{waves}: {len(todo)} answers, {tokens()}")
    seconds = time.perf_counter() - t0
    with atomic_dir(d) as tmp:
        (tmp / TURNS).write_text("".join(json.dumps(t.__dict__) + "\n" for t in turns), encoding="utf-8")
        (tmp / MANIFEST).write_text(json.dumps({
            "format": FORMAT, "turns": len(turns), "max_new": max_new, "tail": tail, "stop_ids": sorted(eos),
            "model_fingerprint": target.fingerprint(), "generate_seconds": round(seconds, 2)}))
    return turns, d, seconds


def _next_prompt(tok, conv, msgs: list[dict], prev: "Turn | None", i: int) -> list[int]:
    """The prompt of turn i of `conv`: its own ids (or rendered messages) at turn 0; later, the messages so far
    plus the target's answer to turn i-1 (`prev`, decoded as run_conversation renders the next turn) and the next
    user turn, appended to `msgs` in place."""
    from eagle3.model.target import prompt_ids

    if i == 0:
        return conv.ids if conv.ids is not None else prompt_ids(tok, msgs)
    answer = prev.ids[prev.prompt_len : prev.prompt_len + prev.answer_len]
    text = tok.decode(answer, skip_special_tokens=True)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": conv.followups[i - 1]}]
    return prompt_ids(tok, msgs)


# ---------------------------------------------------------------- step 2: aux states
def aux_states(base: torch.nn.Module, turns: Sequence[Turn], aux_ids: Sequence[int], d: Path,
               batch_tokens: int = 8192, packed: bool = True,
               progress: Progress | None = None) -> tuple[list[torch.Tensor], float]:
    """aux [T, 3, H] (bf16) of every turn's sequence, from one target forward each (cached in `d` per aux ids).

    packed: on CPU, the forward's linear layers run on oneDNN-prepacked weights, always that kernel (as
    extraction does; `benchmarks/speed/replay.py --compare-build` measures the gain). False: torch's stock ones.
    `progress` gets a line at least every 20 s: tokens done, tok/s, ETA."""
    from safetensors.torch import load_file

    path = aux_path(d, aux_ids)
    with build_lock(d):
        if path.is_file():
            t = load_file(str(path))
            return [t[str(i)] for i in range(len(turns))], 0.0
        return _aux_states(base, turns, aux_ids, path, batch_tokens, packed, progress)


def _aux_states(base, turns, aux_ids, path, batch_tokens, packed, progress) -> tuple[list[torch.Tensor], float]:
    from safetensors.torch import save_file

    from eagle3.decoding.cpu_linear import packed_linears
    from eagle3.model.capture import hidden_states
    from eagle3.runtime.progress import Meter

    t0 = time.perf_counter()
    out: dict[str, torch.Tensor] = {}
    meter = Meter("replay aux states", sum(len(t.ids) for t in turns), "tokens", say=progress)
    # timed=False: one kernel for every row count, so a rebuilt cache is bitwise the same
    with packed_linears(base, timed=False) if packed else contextlib.nullcontext():
        for i, h in hidden_states(base, [torch.tensor(t.ids) for t in turns], aux_ids, batch_tokens):
            out[str(i)] = h.to(torch.bfloat16).contiguous()  # [T, 3, H]
            meter.add(len(turns[i].ids))
    with atomic_path(path) as tmp:
        save_file(out, str(tmp))
    return [out[str(i)] for i in range(len(turns))], time.perf_counter() - t0


def _plan(model_dir, prompts, limit, max_new, aux_ids, tail, trust_remote_code, cache, device):
    """(target, conversations, aux ids, device, the set's content-cached dir): all but the model's weights."""
    from eagle3.eval.prompts import load_prompts
    from eagle3.model.target import Target, check_aux_ids, default_aux_ids

    target = Target.open(model_dir, trust_remote_code)
    convs, _ = load_prompts(prompts, limit)
    aux = check_aux_ids(aux_ids, target.num_layers) if aux_ids else default_aux_ids(target.num_layers)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    d = cache_dir(target, convs, max_new, tail, dev.type, torch.bfloat16 if dev.type == "cuda" else torch.float32,
                  Path(cache) if cache else None)  # the dtype `load_model` picks
    return target, convs, list(aux), dev, d


def replay_set_dir(model_dir: str | Path, prompts: str | Path, limit: int, max_new: int,
                   aux_ids: Sequence[int] | None, tail: int = 8, trust_remote_code: bool = False,
                   cache: str | Path | None = None, device: str | None = None) -> tuple[Path, list[int], bool]:
    """Where the replay set of these inputs lives (content-cached), its aux layer ids, and whether it is
    built there already; reads the tokenizer and the prompts, never the model's weights."""
    _, _, aux, _, d = _plan(model_dir, prompts, limit, max_new, aux_ids, tail, trust_remote_code, cache, device)
    return d, aux, (d / TURNS).is_file() and aux_path(d, aux).is_file()


def build_replay_set(model_dir: str | Path, prompts: str | Path, limit: int, max_new: int,
                     aux_ids: Sequence[int] | None, tail: int = 8, trust_remote_code: bool = False,
                     cache: str | Path | None = None, device: str | None = None,
                     progress: Progress | None = None) -> Path:
    """The target's greedy answers to the first `limit` prompts of `prompts` (e.g. a prepared dir's val
    split) and their aux states; returns the (content-cached) dir that `ReplaySet.load` reads."""
    target, convs, aux_ids, dev, d = _plan(model_dir, prompts, limit, max_new, aux_ids, tail, trust_remote_code,
                                           cache, device)
    if (d / TURNS).is_file() and aux_path(d, aux_ids).is_file():
        return d  # built before: no model to load
    model = target.load_model(head=True, device=dev)
    turns, d, gen_s = continuations(target, model, convs, max_new, tail, cache=Path(cache) if cache else None,
                                    progress=progress)
    _, aux_s = aux_states(model.get_decoder(), turns, aux_ids, d, progress=progress)
    if progress is not None:
        progress(f"replay set {d}: {len(turns)} turns, {sum(t.answer_len for t in turns)} answer tokens "
                 f"(continuations {gen_s:.1f} s, aux states {aux_s:.1f} s; 0 = cached)")
    return d


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
    for t, p in zip(turns, props, strict=True):
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
