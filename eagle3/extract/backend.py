"""The backend that computes hidden states (transformers or vLLM, eagle3/extract/hf.py and vllm.py), built one at
a time per process."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Protocol

import torch

from eagle3.config import ExtractConfig
from eagle3.model.target import Target


class Backend(Protocol):
    name: str

    def extract(self, samples, on_tokens=None):  # -> Iterator[(sample_id, token_ids [T], hidden [T, L, H])]
        ...



def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_dtype(cfg: ExtractConfig) -> str:
    """The target's compute dtype for this stage on this host ("float32" or "bfloat16"), either backend."""
    from eagle3.runtime.floats import resolve_compute_dtype

    return resolve_compute_dtype(cfg.dtype, _device())


# One backend built at a time per process. Ranges (and online producers) may run as threads of one process, and
# transformers' loading swaps process-wide hooks while it builds a model on the meta device: two loads interleaving
# can leave them swapped, and every model built after that in the process has meta weights (seen in the tests).
_BUILD = threading.Lock()



def make_backend(cfg: ExtractConfig, target: Target, layer_ids: list[int], out: Path, max_len: int) -> Backend:
    """Build the backend `cfg.backend` names (heavy: loads the model), one at a time in a process."""
    with _BUILD:
        return _make_backend(cfg, target, layer_ids, out, max_len)



def _make_backend(cfg: ExtractConfig, target: Target, layer_ids: list[int], out: Path, max_len: int) -> Backend:
    if cfg.backend == "hf":
        from eagle3.extract.hf import HFBackend

        model = target.load_model(head=False, device=_device(), dtype=getattr(torch, compute_dtype(cfg)))
        return HFBackend(model, layer_ids, cfg.batch_tokens)
    from eagle3.extract.vllm import VllmBackend

    return VllmBackend(target.path, layer_ids, cfg, max_len=max_len, tmp_dir=out / ".vllm-hidden-states",
                       trust_remote_code=target.trust_remote_code)
