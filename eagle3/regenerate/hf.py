"""The transformers backend of `eagle3 regenerate`: the target loaded with transformers' own classes,
decoded in batches with a KV cache (`eagle3.decoding.generate.HFGenerator`)."""
from __future__ import annotations

from typing import Any

import torch

from eagle3.config import RegenConfig
from eagle3.decoding.generate import HFGenerator, resolve_dtype
from eagle3.model.target import Target


def load_hf(target: Target, cfg: RegenConfig, device: str | None = None) -> tuple[HFGenerator, Any]:
    """(HFGenerator, tokenizer) for a target."""
    tok = target.tokenizer()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = target.load_model(head=True, device=dev, dtype=resolve_dtype(cfg, dev))
    eos = target.stop_ids()
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos)
    return HFGenerator(model, eos, cfg, pad), tok
