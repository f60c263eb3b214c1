"""Trainer on CUDA: bf16 autocast with DDP and with FSDP2 (runs where a GPU exists)."""
from __future__ import annotations

import json

import pytest

from tests.helpers.training import losses, run_train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fsdp", [False, True])
def test_cuda_training_learns_and_exports(stages, tmp_path, fsdp):  # noqa: F811
    out = tmp_path / ("fsdp" if fsdp else "ddp")
    run_train(stages, out, "--max-steps", "6", *(["--fsdp"] if fsdp else []))
    ls = losses(out)
    assert sorted(ls) == list(range(1, 7)) and ls[6] < ls[1]
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
