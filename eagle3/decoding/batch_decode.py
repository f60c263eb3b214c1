"""Batched greedy decoding of an HF causal LM without per-step copies of the KV cache.

transformers' stock path costs a copy of the whole KV cache at every decode step, twice:
* `DynamicLayer.update` grows the cache with `torch.cat` (every step copies [B, Hkv, n, D] per
  layer, K and V);
* with a padding mask, its SDPA wrapper expands grouped K/V heads to the query heads
  (`repeat_kv`, a [B, Hq, n, D] copy per layer) before `scaled_dot_product_attention`.
At batch 64 and n = 400 on SmolLM2-135M (30 layers, 3 KV heads of 9) that is ~3 GB of copies a step,
and decoding stops scaling with the batch (measured by benchmarks/speed/regenerate.py).

Here the cache of each layer lives in a preallocated buffer that an append writes into
(`BufferLayer`), and a one-token query attends grouped: the query heads that share a KV head become
that head's g "query rows", [B, Hkv, g, D] against K/V [B, Hkv, n, D], one SDPA call, no copy
(`gqa_decode_attention`). Prefill (more than one query token) keeps the stock SDPA path. The math
is the same attention; the reductions run in another order, so a float near-tie may flip an argmax,
as any batching does.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

ATTN = "eagle3_gqa_decode"


class BufferLayer(DynamicLayer):
    """A DynamicLayer whose K/V [B, Hkv, capacity, D] are allocated once (`reserve` positions, grown
    by half when exceeded); `keys`/`values` are views of the first n positions."""

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve, self.n = max(int(reserve), 1), 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        B, H, _, _ = key_states.shape
        self.kbuf = key_states.new_empty(B, H, self.reserve, key_states.shape[-1])
        self.vbuf = value_states.new_empty(B, H, self.reserve, value_states.shape[-1])
        self.n, self.is_initialized = 0, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m = self.n + key_states.shape[-2]
        if m > self.kbuf.shape[2]:  # past the reservation: grow (amortized, never per step)
            cap = max(m, self.kbuf.shape[2] * 3 // 2)
            self.kbuf, self.vbuf = (
                torch.cat([b[:, :, : self.n], b.new_empty(*b.shape[:2], cap - self.n, b.shape[3])], 2)
                for b in (self.kbuf, self.vbuf)
            )
        self.kbuf[:, :, self.n : m] = key_states
        self.vbuf[:, :, self.n : m] = value_states
        self.n = m
        self._views()
        return self.keys, self.values

    def _views(self) -> None:
        self.keys, self.values = self.kbuf[:, :, : self.n], self.vbuf[:, :, : self.n]

    def get_seq_length(self) -> int:
        return self.n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count (tokens to remove from the end)")
        if self.is_initialized:
            self.n = max(self.n + tokens_to_remove, 0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (finished rows leave the batch). Ascending indices (the decoder's) are
        compacted in place: row j takes row indices[j] >= j, moved in ascending order, so no source is
        overwritten before it is read, and the buffers stay where they are. A gather into new buffers
        instead allocated 60 buffers per round as rows left; on the kept heap (eagle3/runtime/heap.py) the freed
        ones fragmented it: the eval building the 80-row MT-Bench answers peaked at 10.76 GiB, 9.17 GiB
        compacting in place, with the same answers bit for bit and no slower (255 s against 270 s)."""
        if not self.is_initialized:
            return
        idx = indices.tolist()
        if idx != sorted(set(idx)):  # any other selection (reorder, repeats): a gather
            self.kbuf, self.vbuf = self.kbuf[indices], self.vbuf[indices]
        else:
            for j, i in enumerate(idx):
                if i != j:
                    self.kbuf[j, :, : self.n] = self.kbuf[i, :, : self.n]
                    self.vbuf[j, :, : self.n] = self.vbuf[i, :, : self.n]
            self.kbuf, self.vbuf = self.kbuf[: len(idx)], self.vbuf[: len(idx)]  # views: [b, Hkv, cap, D]
        self._views()

    def window(self, rows: slice, start: int) -> "BufferLayer":
        """An empty layer over `rows` of this (allocated) layer's buffers from position `start` on: a prefill of
        those rows alone, through it, writes their K/V in place (`HFGenerator`'s grouped prefill)."""
        w = BufferLayer(self.kbuf.shape[2] - start)
        w.kbuf, w.vbuf = self.kbuf[rows, :, start:], self.vbuf[rows, :, start:]
        w.dtype, w.device, w.n, w.is_initialized = self.dtype, self.device, 0, True
        return w

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("BufferLayer is for greedy/sampled batch decoding, not beam search")


def buffer_cache(model: torch.nn.Module, reserve: int) -> DynamicCache:
    """A DynamicCache for `model` whose full-attention layers are `BufferLayer`s of `reserve` positions
    (sliding-window and other special layers keep transformers' own class)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [BufferLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def gqa_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, **kwargs):
    """An attention function for transformers' AttentionInterface.

    query [B, Hq, 1, D] (one decode step), key/value [B, Hkv, n, D] with Hq = g * Hkv: query head
    h reads KV head h // g (transformers' repeat_kv order), so viewing the query as [B, Hkv, g, D]
    puts each KV head's g query heads in its "query length" slot. attention_mask [B, 1, 1, n]
    (bool, True = attend) broadcasts over heads and rows. Returns [B, 1, Hq, D] as the stock path does.
    Anything else (prefill, no grouping, dropout) goes to the stock SDPA function.
    """
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    if T != 1 or Hq == Hkv or Hq % Hkv or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    g = Hq // Hkv
    out = F.scaled_dot_product_attention(query.view(B, Hkv, g, D), key, value, attn_mask=attention_mask,
                                         scale=scaling)  # [B, Hkv, g, Dv]
    return out.reshape(B, 1, Hq, out.shape[-1]), None


AttentionInterface.register(ATTN, gqa_decode_attention)
AttentionMaskInterface.register(ATTN, sdpa_mask)  # the same boolean masks SDPA gets


@contextmanager
def gqa_decoding(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` with `gqa_decode_attention` inside the block (only when it was on SDPA)."""
    cfg = model.config
    old = getattr(cfg, "_attn_implementation", None)
    if old != "sdpa":
        yield
        return
    cfg._attn_implementation = ATTN
    try:
        yield
    finally:
        cfg._attn_implementation = old


# ---------------------------------------------------------------- how many rows fit
def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take over all layers of a decoder (GQA: kv heads x head dim each)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * 2 * heads * head_dim * dtype.itemsize


# A row's KV cache counted twice: its buffers grow by reallocation, and compacting them as rows leave
# the batch holds both copies for a moment. With the weights beside it this is what the demo's 80-row
# build peaked at (SmolLM2, fp32: ~8.5 GiB measured, ~8 GiB estimated).
KV_SLACK = 2
ANSWER_FLOOR_ROWS = 8  # fewer rows decode at a poor rate: below this the build is refused (eval memory)


def answer_rows(per_token: int, seq_len: int, free: int | None, cap: int) -> int:
    """Rows of one answer batch whose KV caches (seq_len tokens each, x KV_SLACK) fit in 90% of `free` bytes,
    at most `cap`; `cap` when `free` is unknown. Raises MemoryError below ANSWER_FLOOR_ROWS, with the options."""
    if free is None:
        return cap
    rows = min(cap, int(0.9 * free) // max(KV_SLACK * per_token * seq_len, 1))
    if rows < min(ANSWER_FLOOR_ROWS, cap):
        raise MemoryError(
            f"the replay answers need ~{KV_SLACK * per_token * seq_len * min(ANSWER_FLOOR_ROWS, cap) / 2**30:.2f} GiB "
            f"for {min(ANSWER_FLOOR_ROWS, cap)} rows of {seq_len} tokens, {free / 2**30:.2f} GiB is available: "
            f"lower eval.max_new_tokens or eval.limit, or free memory")
    return rows
