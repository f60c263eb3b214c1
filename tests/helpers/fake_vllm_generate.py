"""A CPU stand-in for the generation side of vLLM's offline API, for `eagle3 regenerate --backend vllm`.

It follows the contract of the real source (vllm-project/vllm, read for this):
- vllm/entrypoints/llm.py: `LLM(model, *, tensor_parallel_size=1, dtype="auto", seed=None,
  gpu_memory_utilization=0.9, **engine_args)`. `generate(prompts, sampling_params=None, *,
  use_tqdm=True)`: a single prompt dict is wrapped in a list; a list of SamplingParams must match
  the prompts in length ("The lengths of prompts and params must be the same."), a single one
  applies to all; request ids are `str(next(counter))` (the counter lives on the LLM, so ids keep
  growing across calls); requests finish in any order and the outputs are returned sorted by
  `int(request_id)`.
- vllm/sampling_params.py: temperature 0 is greedy; `seed` gives a request its own stream;
  `max_tokens` (default 16); `stop_token_ids`; generation also stops at the tokenizer's eos.
- vllm/outputs.py: `RequestOutput(request_id, prompt, prompt_token_ids, outputs, finished)` with
  `CompletionOutput(index, text, token_ids, cumulative_logprob, logprobs, finish_reason)`;
  finish_reason is "stop" or "length".

The "engine" decodes each request alone with transformers in fp32 (whatever `dtype` says) and a
KV cache, so its greedy output is the target's own. `keep_stop_token` chooses whether a stop token
stays at the end of `token_ids` (vLLM keeps non-special ones); both must work.
"""
from __future__ import annotations

import itertools
import random
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    detokenize: bool = True
    skip_special_tokens: bool = True


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Any = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


class LLM:
    instances: list["LLM"] = []
    keep_stop_token = True

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, dtype: str = "auto", seed: int | None = None,
                 gpu_memory_utilization: float = 0.9, trust_remote_code: bool = False, **kwargs: Any):
        from tests.helpers.fake_vllm import load_tokenizer
        from tests.helpers.families import reference_lm

        self.kwargs = dict(model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
                           gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code, **kwargs)
        self.model = reference_lm(model)  # vLLM runs its own implementation; transformers' stands in
        self.eos = load_tokenizer(model, trust_remote_code).eos_token_id
        self.max_model_len = kwargs.get("max_model_len") or self.model.config.max_position_embeddings
        self.request_counter = itertools.count()
        self.calls: list[int] = []  # prompts per generate call
        LLM.instances.append(self)

    @torch.inference_mode()
    def _decode(self, ids: list[int], sp: SamplingParams) -> CompletionOutput:
        from transformers import DynamicCache

        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens is longer than max_model_len {self.max_model_len}")
        stops = set(sp.stop_token_ids or []) | {self.eos}
        g = torch.Generator().manual_seed(sp.seed if sp.seed is not None else random.randrange(1 << 30))
        cache = DynamicCache(config=self.model.config)
        x, out = torch.tensor([ids]), []
        while True:
            logits = self.model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            if sp.temperature == 0:
                t = int(logits.argmax())
            else:
                t = int(torch.multinomial(torch.softmax(logits / sp.temperature, -1), 1, generator=g))
            if t in stops:
                return CompletionOutput(0, "", out + ([t] if self.keep_stop_token else []), finish_reason="stop")
            out.append(t)
            if len(out) >= sp.max_tokens or len(ids) + len(out) >= self.max_model_len:
                return CompletionOutput(0, "", out, finish_reason="length")
            x = torch.tensor([[t]])

    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True, **kw) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(sampling_params, list) and len(sampling_params) != len(prompts):
            raise ValueError("The lengths of prompts and params must be the same.")
        reqs = []
        for i, p in enumerate(prompts):
            if not isinstance(p, dict) or "prompt_token_ids" not in p:
                raise TypeError("this fake takes TokensPrompt dicts only")
            sp = sampling_params[i] if isinstance(sampling_params, list) else sampling_params
            reqs.append((str(next(self.request_counter)), [int(t) for t in p["prompt_token_ids"]], sp))
        self.calls.append(len(reqs))
        finished = [RequestOutput(rid, None, ids, [self._decode(ids, sp)]) for rid, ids, sp in reqs]
        random.Random(len(finished)).shuffle(finished)  # requests finish in any order ...
        return sorted(finished, key=lambda o: int(o.request_id))  # ... and come back in request order


def install(monkeypatch) -> None:
    """Put the fake into sys.modules as `vllm`."""
    mod = types.ModuleType("vllm")
    mod.LLM = LLM
    mod.SamplingParams = SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    LLM.instances.clear()
    LLM.keep_stop_token = True
