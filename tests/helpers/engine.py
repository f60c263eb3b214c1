"""What the tests on the real vLLM engine share.

`enforce_eager` skips vLLM's torch.compile warm-up: on these 2-core CPUs an engine then starts in
~45 s instead of ~150 s, and the eager kernels are the ones whose results the tests compare.
"""
from __future__ import annotations

import torch

ENGINE = {"enforce_eager": True}


def assert_stores_close(a, b, rtol: float, atol: float) -> None:
    """Two hidden-state stores hold the same samples, ids equal, states within tolerance."""
    assert a.sample_ids == b.sample_ids
    for i in range(len(a.sample_ids)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        for key in ("aux_hidden_states", "final_hidden_states"):
            torch.testing.assert_close(x[key].float(), y[key].float(), rtol=rtol, atol=atol,
                                       msg=lambda m, i=i, key=key: f"sample {i} {key}: {m}")


def engine_processes(wait: float = 15.0) -> list[str]:
    """vLLM engine processes still running under this one after `wait` seconds (an engine a stage built must be
    stopped by it; vLLM's shutdown signals its processes and may return before they are gone)."""
    import time

    import psutil

    deadline = time.time() + wait
    while True:
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and "VLLM" in " ".join(p.cmdline() + [p.name()]):
                    out.append(f"{p.pid} {p.name()}")
            except psutil.NoSuchProcess:
                pass
        if not out or time.time() > deadline:
            return out
        time.sleep(0.2)
