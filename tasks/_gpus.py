"""The `gpus` global concurrency limit, held by the stages that use the GPU host's devices."""
from __future__ import annotations

import os

from prefect.concurrency.sync import concurrency


def gpu_slots() -> int:
    """One slot per device the stage can see (CUDA_VISIBLE_DEVICES, set by the gpu pool), else 1.

    Processes do not pick distinct devices among the visible ones, so a stage holds all of them:
    two stages can never share the 8-GPU host's devices.
    """
    return len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]) or 1


def hold_gpus():
    """Wait for, then hold, `gpu_slots()` slots of the `gpus` limit; a no-op where no such limit exists."""
    return concurrency("gpus", occupy=gpu_slots(), strict=False)
