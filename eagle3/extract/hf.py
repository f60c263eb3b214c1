"""The transformers backend: one forward pass of the base model, aux + final states caught by hooks.

Layer ids follow vLLM (REFERENCE §2): id k < N is the residual stream *entering* decoder layer k
(HF's `hidden_states[k]`), id N is the last layer's output *before* the final norm (HF's last
`hidden_states` entry has the norm applied, so it is not id N). A forward pre-hook on layer k
sees exactly the stream entering it; a pre-hook on `norm` sees the pre-norm output. Nothing else
is kept (no N+1 hidden-state list) and the LM head is never loaded, so no logits are computed.

The model is `Target.load_model(head=False)`: the decoder stack, built by transformers' own
classes from the text config (a VLM's wrapper and vision tower are never loaded).

Batching: samples are sorted by length and grouped up to a token budget (B * T_max), right-padded.
Attention is causal, so a real token never attends to the padding that follows it: the
states of real tokens equal an unbatched run up to float noise, with no mask to build.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from eagle3.faults import point

Sample = tuple[str, torch.Tensor]  # (sample_id, input_ids [T])


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


class HFBackend:
    """Extract hidden states [T, n_aux + 1, H] with a transformers decoder model."""

    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        layer_ids: Sequence[int],
        batch_tokens: int = 16384,
        pad_id: int = 0,
    ):
        self.model = model
        self.layers = model.layers
        self.n = len(self.layers)
        self.layer_ids = list(layer_ids)
        if self.layer_ids[-1] != self.n or any(not 0 <= k < self.n for k in self.layer_ids[:-1]):
            raise ValueError(
                f"layer ids {self.layer_ids} must be aux ids in [0, {self.n}) followed by {self.n} "
                "(the final pre-norm state)"
            )
        self.batch_tokens = batch_tokens
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self._caught: dict[int, torch.Tensor] = {}

    def _hook(self, layer_id: int) -> Callable:
        def pre_hook(module, args, kwargs):
            # args[0] / kwargs["hidden_states"]: [B, T, H], the stream entering this module.
            self._caught[layer_id] = args[0] if args else kwargs["hidden_states"]

        return pre_hook

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] (right-padded) -> states [B, T, n_aux + 1, H] in compute dtype."""
        handles = []
        for k in self.layer_ids:
            mod = self.model.norm if k == self.n else self.layers[k]
            handles.append(mod.register_forward_pre_hook(self._hook(k), with_kwargs=True))
        try:
            self._caught.clear()
            self.model(input_ids=ids.to(self.device), use_cache=False)
            return torch.stack([self._caught[k] for k in self.layer_ids], dim=2)
        finally:
            for h in handles:
                h.remove()
            self._caught.clear()

    def extract(self, samples: Sequence[Sample], on_tokens: Callable[[int], None] | None = None) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """Yield (sample_id, token_ids [T], hidden [T, n_aux + 1, H] on CPU) for every sample."""
        lengths = [int(ids.numel()) for _, ids in samples]
        for group in batches_by_length(lengths, self.batch_tokens):
            width = lengths[group[0]]
            ids = torch.full((len(group), width), self.pad_id, dtype=torch.long)
            for r, i in enumerate(group):
                ids[r, : lengths[i]] = samples[i][1]
            h = self.forward(ids).cpu()  # [B, width, L, H]
            for r, i in enumerate(group):
                sid, tok = samples[i]
                yield sid, tok, h[r, : lengths[i]]
            if on_tokens is not None:
                on_tokens(sum(lengths[i] for i in group))
            point("extract.batch")
