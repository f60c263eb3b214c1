"""Batched decoding with transformers and a KV cache, shared by `eagle3 regenerate` (the target rewrites
a dataset's answers) and replay evaluation (the target's greedy answers to benchmark prompts).

Exactness (hf): greedy output of a sequence in a left-padded batch is the same computation as
alone, but not the same floating-point reductions (padded attention, other GEMM shapes), so a
near-tie argmax could flip. Measured in fp32 on CPU: every turn equals `model.generate(
do_sample=False)` on the same history, one record at a time (tests, tiny Llama and SmolLM2), and
batch sizes 1, 4 and 8 write byte-identical files on 8 MT-Bench and 4-16 ShareGPT conversations
(benchmarks/speed/regenerate.py). bf16 on GPU is more tie-prone and was not measured; `batch_size=1` is
exact by construction.

Speed (hf, CPU): on a shared CPU give torch one thread (`--threads 1`): with other processes busy,
2 threads decoded SmolLM2 about 8x slower than 1 (OpenMP oversubscription).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagle3.config import RegenConfig
from eagle3.decoding.cpu_linear import packed_linears
from eagle3.runtime import heap
from eagle3.runtime.floats import resolve_compute_dtype


@dataclass
class Gen:
    """One finished generation: token ids without the stop token, and why it ended."""

    ids: list[int]
    finish: str  # "stop" (a stop token) or "length" (max_new_tokens)
    raw: list[int] = field(default_factory=list)  # hf: every decoded token, the stop and any `tail` past it


class Generator(Protocol):
    """What the driver asks of a backend: one answer per token-id prompt, in prompt order."""

    name: str
    dtype: str

    def generate(self, prompts: Sequence[list[int]], seeds: Sequence[int]) -> list[Gen]:
        ...


def finish(ids: list[int], eos: set[int], max_new: int, keep_stop: bool = False) -> Gen:
    """Cut at the first stop token within max_new tokens, or at max_new. The stop token is dropped (a
    regenerated turn, whose template closes it) or, with `keep_stop`, kept (an evaluated answer: vLLM
    returns it, and it is a token the draft must propose too)."""
    for i, t in enumerate(ids[:max_new]):
        if t in eos:
            return Gen(ids[: i + 1 if keep_stop else i], "stop")
    return Gen(ids[:max_new], "length")


class HFGenerator:
    """Batched decoding with transformers and a KV cache: left-padded batches, rows dropped as they finish.

    Greedy (temperature 0) takes the argmax, as `generate(do_sample=False)` does. Sampling draws each
    row from its own torch.Generator seeded per (record, turn), so a row's tokens do not depend on
    which other rows share its batch.
    """

    name = "hf"
    cpu_linear = True  # on CPU, linear layers on oneDNN-prepacked weights (eagle3/decoding/cpu_linear.py)
    grouped_prefill = True  # prefill rows of similar length together (`_prefill`); False: one padded forward

    def __init__(self, model: torch.nn.Module, eos: set[int], cfg: RegenConfig, pad_id: int, tail: int = 0):
        # tail: keep decoding this many tokens past the stop (replay evaluation checks a draft's
        # proposals against the target's greedy tokens up to k past the end of an answer)
        self.model, self.eos, self.cfg, self.pad, self.tail = model, set(eos), cfg, pad_id, tail
        p = next(model.parameters())
        self.device = p.device
        self.dtype = str(p.dtype).removeprefix("torch.")
        self.tokens = 0  # generated, for tok/s
        self.on_step: Callable[[int, int], None] | None = None  # (tokens decoded in this batch, rows left), per step

    def generate(self, prompts: Sequence[list[int]], seeds: Sequence[int]) -> list[Gen]:
        # Longest first and similar lengths together: little padding, and the largest KV cache early.
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        out: list[Gen | None] = [None] * len(prompts)
        # On CPU the linear layers run on oneDNN-prepacked weights (eagle3/decoding/cpu_linear.py): a decode
        # step multiplies only `batch` rows per weight, where torch's stock fp32 GEMM is slowest.
        with packed_linears(self.model) if self.cpu_linear else contextlib.nullcontext():
            for idx in self.batches([len(prompts[i]) for i in order]):
                idx = [order[k] for k in idx]
                for i, g in zip(idx, self._batch([prompts[i] for i in idx], [seeds[i] for i in idx]), strict=True):
                    out[i] = g
        return out  # type: ignore[return-value]

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Consecutive runs of `lengths` (longest first) with <= batch_size rows and <= batch_tokens padded tokens."""
        res: list[list[int]] = []
        for k in range(len(lengths)):
            cur = res[-1] if res else None
            # the first row of a batch is its longest: padded size = rows x that length
            if (cur is None or len(cur) >= self.cfg.batch_size
                    or (len(cur) + 1) * lengths[cur[0]] > self.cfg.batch_tokens):
                res.append([k])
            else:
                cur.append(k)
        return res

    def _pick(self, logits: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
        """Next token per row. logits [b, V] -> ids [b]."""
        if self.cfg.temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / self.cfg.temperature, -1)  # [b, V]
        if self.cfg.top_p < 1.0:
            p, ix = probs.sort(-1, descending=True)
            keep = p.cumsum(-1) - p < self.cfg.top_p  # the smallest prefix whose mass reaches top_p
            probs = torch.zeros_like(probs).scatter(-1, ix, p * keep)
        return torch.stack([torch.multinomial(probs[r].cpu(), 1, generator=g)[0] for r, g in enumerate(gens)]).to(
            logits.device
        )

    @torch.inference_mode()
    def _batch(self, prompts: list[list[int]], seeds: list[int]) -> list[Gen]:
        # KV cache in preallocated buffers and grouped one-token attention: no per-step copy of the
        # cache (eagle3/decoding/batch_decode.py), so a batch of 32-64 rows scales on a CPU
        from eagle3.decoding.batch_decode import buffer_cache, gqa_decoding

        # room for 256 new tokens at first; a longer run grows the buffers (rarely: most rows stop early)
        reserve = max(map(len, prompts)) + min(self.cfg.max_new_tokens + self.tail, 256)
        with gqa_decoding(self.model):
            gens = self._decode(prompts, seeds, buffer_cache(self.model, reserve))
        # The batch's KV cache and prefill activations are freed now; on the kept heap (eagle3/runtime/heap.py)
        # they would stay resident beside the next batch's, which rarely fits in their place.
        heap.trim()
        return gens

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache, lengths: list[int]):
        """The prompts' K/V into `cache` and each row's next-token logits [B, V], from the left-padded [B, L] batch.

        One forward over the whole batch would compute every padding column too: MT-Bench's first turns are 42 to
        402 tokens, 7,988 in all, padded to 32,160 in its 80-row batch (second turns: 28,118 padded to 55,440).
        Consecutive rows of similar length (`prefill_groups`; `generate` orders rows longest first) are prefilled
        together instead, each group padded to its own longest row and written into its rows of the batch's
        buffers from its own start column on (`BufferLayer.window`). The columns before that start are zeroed
        and masked, as padding is, so decoding reads the same cache but for those masked zeros."""
        from transformers import DynamicCache

        from eagle3.decoding.batch_decode import BufferLayer

        def run(rows: slice, start: int, sub) -> torch.Tensor:
            return self.model(input_ids=ids[rows, start:], attention_mask=mask[rows, start:],
                              position_ids=pos[rows, start:], past_key_values=sub, use_cache=True,
                              logits_to_keep=1).logits[:, -1]

        groups = prefill_groups(lengths) if self.grouped_prefill else [(0, len(lengths))]
        layers = cache.layers
        if len(groups) == 1 or not all(isinstance(x, BufferLayer) for x in layers):
            return run(slice(None), 0, cache)
        B, L = ids.shape
        out = []
        for g, (r0, r1) in enumerate(groups):
            rows, start = slice(r0, r1), L - max(lengths[r0:r1])
            sub = DynamicCache(config=self.model.config)
            if g > 0:  # in place, into the buffers the first group allocated
                sub.layers = [x.window(rows, start) for x in layers]
            out.append(run(rows, start, sub))
            for x, y in zip(layers, sub.layers, strict=True):
                if g == 0:  # its K/V [b, Hkv, n, D] size the batch's buffers (MLA: K and V of their own widths)
                    x.lazy_initialization(y.keys.new_empty(B, y.keys.shape[1], 0, y.keys.shape[3]),
                                          y.values.new_empty(B, y.values.shape[1], 0, y.values.shape[3]))
                    x.kbuf[rows, :, start:L], x.vbuf[rows, :, start:L] = y.keys, y.values
                x.kbuf[rows, :, :start] = 0
                x.vbuf[rows, :, :start] = 0
        for x in layers:
            x.n = L
            x._views()
        return torch.cat(out)

    def _decode(self, prompts: list[list[int]], seeds: list[int], cache) -> list[Gen]:
        B, dev = len(prompts), self.device
        ids, mask, pos = left_padded(prompts, self.pad, dev)
        gens = [torch.Generator().manual_seed(s) if self.cfg.temperature > 0 else None for s in seeds]
        logits = self._prefill(ids, mask, pos, cache, [len(p) for p in prompts])  # [B, V]
        last = pos[:, -1]  # [B] position of each row's newest token
        rows = list(range(B))  # batch row -> prompt index, for rows still running
        out: list[list[int]] = [[] for _ in range(B)]
        done: list[Gen | None] = [None] * B
        end: list[int | None] = [None] * B  # decoded length at which a row stops: its stop + tail
        max_new = self.cfg.max_new_tokens
        while rows:
            nxt = self._pick(logits, [gens[i] for i in rows]).tolist()  # [b]
            keep = []
            for r, (i, t) in enumerate(zip(rows, nxt, strict=True)):
                out[i].append(t)
                self.tokens += 1
                if end[i] is None and (t in self.eos or len(out[i]) >= max_new):
                    end[i] = len(out[i]) + self.tail
                if end[i] is not None and len(out[i]) >= end[i]:
                    done[i] = finish(out[i], self.eos, max_new)
                    done[i].raw = out[i]
                else:
                    keep.append(r)
            if self.on_step is not None:
                self.on_step(len(out[rows[0]]), len(keep))
            if not keep:
                break
            if len(keep) < len(rows):  # finished rows leave the batch (and the cache)
                k = torch.tensor(keep, device=dev)
                cache.batch_select_indices(k)
                mask, last = mask[k], last[k]
                rows = [rows[r] for r in keep]
                nxt = [nxt[r] for r in keep]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], 1)  # [b, L + t]
            last = last + 1
            logits = self.model(input_ids=torch.tensor(nxt, device=dev)[:, None], attention_mask=mask,
                                position_ids=last[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
        return done  # type: ignore[return-value]


PREFILL_GROUP_RATIO = 0.75  # a group's rows are at least this share of its longest: <= 1/3 of it padding


def prefill_groups(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive [r0, r1) runs of `lengths` prefilled together: a run ends before a row shorter than
    PREFILL_GROUP_RATIO x its longest. The first run holds the longest row when rows come longest first."""
    groups: list[tuple[int, int]] = []
    r0, top = 0, 0
    for r, n in enumerate(lengths):
        if r > r0 and n < PREFILL_GROUP_RATIO * top:
            groups.append((r0, r))
            r0, top = r, 0
        top = max(top, n)
    groups.append((r0, len(lengths)))
    return groups


def left_padded(prompts: Sequence[list[int]], pad: int, device: torch.device | str = "cpu"):
    """(ids, mask, positions), each [B, L]: every row's last prompt token at column L - 1, real positions
    counted from 0 after the padding."""
    B, L = len(prompts), max(map(len, prompts))
    ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, L - len(p) :] = torch.tensor(p)
        mask[r, L - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def resolve_dtype(cfg: RegenConfig, device: torch.device) -> torch.dtype:
    """`cfg.dtype` on `device`: auto = fp32 on CPU, bf16 on CUDA; fast = bf16 also on a CPU with bf16 units."""
    return getattr(torch, resolve_compute_dtype(cfg.dtype, device))
