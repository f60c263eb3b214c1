"""Greedy chain decoding replayed on a target's cached greedy answers: the cached turns, the draft's
chains at every position a round can start, and the walk of the rounds as live decoding visits them.

Shared by replay evaluation (eagle3/eval/replay.py builds the caches and the report) and the trainer's
replay validation (a replay set: held-out prompts, their greedy answers and aux states, replayed at
each validation). Why the replay is exact is said in eagle3/eval/replay.py.

On disk a replay set (one cache dir) holds `turns.jsonl` (one `Turn` a line), `manifest.json` (format,
max_new, tail, the target's stop ids and fingerprint) and `aux-A-B-C.safetensors` per aux layer ids
(one [T, 3, H] bf16 tensor per turn, keyed by its index).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3.storage.hashing import sha256_file, sha256_json

FORMAT = 2  # 2: the manifest names the target and its stop ids (a replay set the trainer reads)
TURNS = "turns.jsonl"
MANIFEST = "manifest.json"


@dataclass
class Turn:
    """One answered turn: the prompt's ids, then the target's greedy answer and `tail` tokens past it."""

    conv: str
    turn: int
    prompt_len: int
    ids: list[int]
    answer_len: int  # tokens of the answer as the live evaluator returns it (cut at max_new / after a stop)


def aux_path(d: Path, aux_ids: Sequence[int]) -> Path:
    """The aux states of a cache dir's turns at these aux layer ids."""
    return d / f"aux-{'-'.join(map(str, aux_ids))}.safetensors"


# ---------------------------------------------------------------- the draft's chains
def rounds_window(turn: Turn, max_new: int) -> range:
    """Positions t where a round of `walk` can start: t = prompt_len - 1 + (tokens out so far - 1) with
    fewer than min(answer_len, max_new) tokens out."""
    start = turn.prompt_len - 1
    return range(start, start + max(min(turn.answer_len, max_new), 1))


@torch.inference_mode()
def proposals(draft, turns: Sequence[Turn], aux: Sequence[torch.Tensor], k: int, max_new: int | None = None,
              chunk: int = 1024) -> list[np.ndarray]:
    """props[i] [k, T_i]: the target id step j of the draft proposes at position t of turn i's sequence,
    wherever `walk` can look at it (-1 elsewhere).

    Per sequence, one chain pass (`Eagle3Draft.ttt_states_at`) at the positions where a round can start
    (`rounds_window`), continued to step j + 1 only where proposals 0..j were all right (`walk` reads a
    proposal after a miss never); the logits are formed `chunk` positions at a time.
    """
    dev = next(draft.parameters()).device
    dtype = draft.fc.weight.dtype
    big = 1 << 30 if max_new is None else max_new
    out = []
    for turn, a in zip(turns, aux, strict=True):
        ids = torch.tensor(turn.ids, device=dev)
        L = len(turn.ids)
        w = rounds_window(turn, big)
        at = torch.zeros(L, dtype=torch.bool, device=dev)
        at[w.start : min(w.stop, L)] = True
        props = torch.full((k, L), -1, dtype=torch.long)
        nxt = torch.cat([ids, ids.new_full((k + 2,), -1)])  # the target's tokens, -1 past the end

        # called by ttt_states_at below, within this iteration: props and nxt bound as defaults all the same
        def keep(j: int, t: torch.Tensor, normed: torch.Tensor, *, props=props, nxt=nxt) -> torch.Tensor:
            p = torch.cat([draft.to_target_ids(draft.logits(normed[c : c + chunk]).argmax(-1))
                           for c in range(0, normed.shape[0], chunk)])  # [n]
            props[j, t.cpu()] = p.cpu()
            return p == nxt[t + j + 2]  # proposal j at t is checked against the target's token t + j + 2

        draft.ttt_states_at(ids[None], a.to(dev, dtype)[None], k, at, keep)
        out.append(props.numpy())
    return out


# ---------------------------------------------------------------- the rounds
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


def replay_counts(draft, turns: Sequence[Turn], aux: Sequence[torch.Tensor], k: int, max_new: int,
                  eos: set[int]) -> list[float]:
    """[accepted tokens, rounds (verify passes), rounds reaching position 1..k] summed over `turns`:
    what the trainer sums over ranks (tau = 1 + accepted / rounds)."""
    out = [0.0] * (2 + k)
    if not turns:
        return out
    for t, p in zip(turns, proposals(draft, turns, aux, k, max_new), strict=True):
        for a in walk(t, p, k, max_new, eos):
            out[0] += a
            out[1] += 1
            for j in range(a):
                out[2 + j] += 1
    return out


# ---------------------------------------------------------------- a replay set for the trainer
@dataclass
class ReplaySet:
    """Held-out prompts with the target's greedy answers and their aux states (one cache dir of
    `continuations` + `aux_states`): what the trainer replays at each validation."""

    dir: Path
    turns: list[Turn]
    aux: list[torch.Tensor]
    stop_ids: set[int]
    max_new: int
    model_fingerprint: str
    fingerprint: str  # of the turns and the aux file

    @classmethod
    def load(cls, d: str | Path, aux_ids: Sequence[int]) -> "ReplaySet":
        from safetensors.torch import load_file

        d = Path(d)
        try:
            man = json.loads((d / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{d}: not a replay set ({MANIFEST}: {e}); build one with `eagle3 replay-set`") from None
        if man.get("format") != FORMAT:
            raise ValueError(f"{d}: replay set format {man.get('format')}, this eagle3 reads {FORMAT}: rebuild it")
        path = aux_path(d, aux_ids)
        if not path.is_file():
            raise ValueError(f"{d}: no aux states for aux ids {list(aux_ids)} ({path.name}); build the set with them")
        with open(d / TURNS, encoding="utf-8") as f:
            turns = [Turn(**json.loads(line)) for line in f]
        t = load_file(str(path))
        aux = [t[str(i)] for i in range(len(turns))]
        return cls(d, turns, aux, set(man["stop_ids"]), int(man["max_new"]), man["model_fingerprint"],
                   sha256_json({"turns": sha256_file(d / TURNS), "aux": sha256_file(path)}))
