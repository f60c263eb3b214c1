"""The transformers backend: one forward pass of the base model, aux + final states caught by hooks.

Layer ids follow vLLM (id k < N: the stream entering decoder layer k; id N: the last layer's
output before the final norm), caught by `eagle3.model.capture.catch`. Nothing else is kept (no N+1
hidden-state list) and the LM head is never loaded, so no logits are computed.

The model is `Target.load_model(head=False)`: the decoder stack, built by transformers' own
classes from the text config (a VLM's wrapper and vision tower are never loaded).

Batching: samples are sorted by length and grouped up to a token budget (B * T_max), right-padded.
Attention is causal, so a real token never attends to the padding that follows it: the
states of real tokens equal an unbatched run up to float noise, with no mask to build.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from eagle3.decoding.cpu_linear import packed_linears
from eagle3.model.capture import catch, padded_batches
from eagle3.runtime import heap
from eagle3.storage.faults import point

Sample = tuple[str, torch.Tensor]  # (sample_id, input_ids [T])


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

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] (right-padded) -> states [B, T, n_aux + 1, H] in compute dtype."""
        with catch(self.model, self.layer_ids) as caught:
            self.model(input_ids=ids.to(self.device), use_cache=False)
        return torch.stack(caught, dim=2)

    @torch.inference_mode()
    def references(self, samples: Sequence[Sample], head) -> tuple[dict, str]:
        """The target's own next-token choice at each position of `samples` (eagle3.extract.check): transformers'
        output (its own final norm applied) through the target's lm_head, a path that never reads the states the
        hooks catch."""
        out = {}
        for sid, ids in samples:
            h = self.model(input_ids=ids[None].to(self.device), use_cache=False).last_hidden_state[0, :-1]
            out[sid] = head.tops(h.float().cpu())
        return out, "transformers' own forward"

    def extract(
        self, samples: Sequence[Sample], on_tokens: Callable[[int], None] | None = None
    ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """Yield (sample_id, token_ids [T], hidden [T, n_aux + 1, H] on CPU) for every sample."""
        # On CPU the linear layers run on oneDNN-prepacked weights (eagle3.decoding.cpu_linear; 0.87x stock's time
        # at extraction's row counts), always that kernel (timed=False), so reruns are bitwise equal.
        with packed_linears(self.model, timed=False):
            for group, lengths, ids in padded_batches([ids for _, ids in samples], self.batch_tokens, self.pad_id):
                h = self.forward(ids).cpu()  # [B, T_max, L, H]
                for r, (i, n) in enumerate(zip(group, lengths, strict=True)):
                    sid, tok = samples[i]
                    yield sid, tok, h[r, :n]
                if on_tokens is not None:
                    on_tokens(sum(lengths))
                heap.release()  # now and then: the next batch reuses this one's freed blocks (eagle3.runtime.heap)
                point("extract.batch")
