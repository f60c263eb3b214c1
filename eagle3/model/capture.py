"""Catching a target's hidden states at vLLM's layer ids, with forward pre-hooks.

Aux id k < N is the residual stream *entering* decoder layer k: a forward pre-hook on layer k sees
it (it is HF's `hidden_states[k]`). Id N is the last layer's output *before* the final norm: a
pre-hook on `norm` sees it (HF's last `hidden_states` entry has the norm applied, so it is not id
N). Off-by-one mistakes here collapse acceptance silently (vLLM #43671, #50170). The hooks live for
one forward only, so a plain forward never pays for them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


@contextlib.contextmanager
def catch(base: torch.nn.Module, layer_ids: Sequence[int]) -> Iterator[list[torch.Tensor | None]]:
    """During the block, `caught[i]` receives the [B, T, H] stream at `layer_ids[i]` of the decoder
    stack `base` (a model with `.layers` and `.norm`) on each forward."""
    n = len(base.layers)
    bad = [k for k in layer_ids if not 0 <= k <= n]
    if bad:
        raise ValueError(f"layer ids {bad} are outside [0, {n}] for this {n}-layer target")
    caught: list[torch.Tensor | None] = [None] * len(layer_ids)

    def hook(i: int):
        def pre_hook(module, args, kwargs):
            caught[i] = args[0] if args else kwargs["hidden_states"]  # [B, T, H]

        return pre_hook

    mods = [base.norm if k == n else base.layers[k] for k in layer_ids]
    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(mods)]
    try:
        yield caught
    finally:
        for h in handles:
            h.remove()


def batches_by_length(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group indices (longest first) so that len(group) * longest <= batch_tokens.

    A sample longer than the budget forms a batch of its own. Deterministic: ties keep input order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        # The first (longest) index of `cur` sets the padded width.
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def padded_batches(samples: Sequence[torch.Tensor], batch_tokens: int, pad_id: int = 0
                   ) -> Iterator[tuple[list[int], list[int], torch.Tensor]]:
    """(sample indices, their lengths, ids [B, T_max] right-padded) for token-id tensors, longest first.

    Right padding needs no mask: attention is causal, so a real token never attends to the padding
    after it, and its states equal an unbatched run up to float noise.
    """
    lengths = [int(ids.numel()) for ids in samples]
    for group in batches_by_length(lengths, batch_tokens):
        ids = torch.full((len(group), lengths[group[0]]), pad_id, dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, : lengths[i]] = samples[i]
        yield group, [lengths[i] for i in group], ids


@torch.inference_mode()
def hidden_states(base: torch.nn.Module, samples: Sequence[torch.Tensor], layer_ids: Sequence[int],
                  batch_tokens: int = 16384) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, states [T, len(layer_ids), H] on CPU) for each token-id tensor [T], in length-sorted batches."""
    dev = next(base.parameters()).device
    for group, lengths, ids in padded_batches(samples, batch_tokens):
        with catch(base, layer_ids) as caught:
            base(input_ids=ids.to(dev), use_cache=False)
        h = torch.stack(caught, dim=2).cpu()  # [B, T_max, n_ids, H]
        for r, (i, n) in enumerate(zip(group, lengths, strict=True)):
            yield i, h[r, :n]
