"""The vLLM backend of `eagle3 regenerate` (GPU host or CPU engine): tensor parallel, continuous batching.

Contract, as read in vLLM's source (facts only):
- `vllm/entrypoints/llm.py`: `LLM(model, *, tensor_parallel_size=1, dtype="auto", seed=None,
  gpu_memory_utilization=0.9, **engine_args)`; dtype "auto" turns an fp32 config (SmolLM2's)
  into fp16, so the dtype is passed explicitly (`eagle3.runtime.vllm_engine.resolve_dtype`).
  `generate(prompts, sampling_params, *, use_tqdm=True)` takes `{"prompt_token_ids": [...]}` prompts
  and either one SamplingParams or a list "paired one by one with the prompt" (a length mismatch
  raises ValueError). Each request gets `request_id = str(next(counter))`; the engine schedules all
  of them at once (continuous batching) and the finished outputs are returned sorted by
  `int(request_id)`, i.e. "in the same order as the input prompts".
- `vllm/sampling_params.py`: `SamplingParams(temperature, top_p, seed, max_tokens,
  stop_token_ids, detokenize, ...)`; temperature 0 is greedy; a per-request `seed` gives that
  request its own random stream (so a sampled answer does not depend on its batch); stop token
  ids "will be contained in the output unless they are special tokens".
- `vllm/outputs.py`: `RequestOutput(request_id, prompt_token_ids, outputs=[CompletionOutput])`,
  `CompletionOutput.token_ids` and `finish_reason` ("stop", "length", or "abort").

So each wave of the driver is one `generate` call; outputs are matched to prompts by order and
checked against their `prompt_token_ids`; a trailing stop token is dropped whether or not vLLM
kept it. Text is decoded by the driver (detokenize=False here), as for the hf backend.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3.config import RegenConfig
from eagle3.decoding.generate import Gen
from eagle3.runtime.vllm_engine import on_cpu, resolve_dtype, shutdown, start_engine


def llm_kwargs(model: str | Path, cfg: RegenConfig, max_len: int, trust_remote_code: bool = False) -> dict[str, Any]:
    """The LLM(...) arguments (one place, so tests can check them)."""
    from eagle3.model.target import Target

    dtype = resolve_dtype(cfg.dtype)
    return dict(
        model=str(model),
        trust_remote_code=trust_remote_code,  # Kimi's tokenizer is custom code
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        dtype=dtype,
        **Target.open(model).vllm_args(dtype, on_cpu()),
        max_model_len=max_len,
        seed=cfg.seed,
        # Later turns of a conversation share their whole history with earlier ones: prefix caching
        # turns that into cache hits (greedy output is unchanged; extract is where it must stay off).
        enable_prefix_caching=True,
    ) | cfg.engine_args


class VllmGenerator:
    """One `LLM` for the whole run; `generate` answers a wave of prompts in one call."""

    name = "vllm"

    def __init__(self, model: str | Path, cfg: RegenConfig, max_len: int, eos: set[int],
                 trust_remote_code: bool = False):
        self.cfg, self.eos, self.dtype = cfg, set(eos), resolve_dtype(cfg.dtype)
        self.llm = start_engine("regenerate --backend vllm", **llm_kwargs(model, cfg, max_len, trust_remote_code))

    def params(self, seeds: Sequence[int]) -> list[Any]:
        from vllm import SamplingParams

        c = self.cfg
        return [SamplingParams(temperature=c.temperature, top_p=c.top_p if c.temperature > 0 else 1.0,
                               seed=s if c.temperature > 0 else None, max_tokens=c.max_new_tokens,
                               stop_token_ids=sorted(self.eos), detokenize=False) for s in seeds]

    def generate(self, prompts: Sequence[list[int]], seeds: Sequence[int]) -> list[Gen]:
        if not prompts:
            return []
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], self.params(seeds), use_tqdm=False)
        if len(outs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outs)} outputs for {len(prompts)} prompts")
        res = []
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
            if list(o.prompt_token_ids) != list(p):
                raise RuntimeError(f"vLLM output {i} (request {o.request_id}) answers another prompt: "
                                   "outputs are not in prompt order")
            co = o.outputs[0]
            if co.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request {o.request_id} ended with finish_reason={co.finish_reason!r}")
            ids = list(co.token_ids)[: self.cfg.max_new_tokens]
            stop = co.finish_reason == "stop"
            if stop and ids and ids[-1] in self.eos:
                ids = ids[:-1]  # vLLM keeps a non-special stop token; the hf backend never does
            res.append(Gen(ids, "stop" if stop else "length"))
        return res

    def close(self) -> None:
        shutdown(self.llm)
