"""A CPU stand-in for the parts of vLLM that native hidden-state extraction touches.

It follows the contract of the real source (vllm-project/vllm, read for this project):
- vllm/entrypoints/llm.py: `LLM(model, *, tensor_parallel_size=1, gpu_memory_utilization=0.9,
  **engine_args)`; a dict `kv_transfer_config` is turned into a KVTransferConfig; request ids are
  `str(next(counter))`; `generate(prompts, sampling_params, use_tqdm=...)` returns RequestOutputs
  with `request_id`, `prompt_token_ids`, `outputs`, `finished` and `kv_transfer_params`.
- vllm/v1/spec_decode/extract_hidden_states.py: method "extract_hidden_states" asserts
  `num_speculative_tokens == 1`, raises ValueError without
  `draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`, and stacks one [T, H] state
  per id, in the order given, into [T, n_ids, H] of the model dtype.
- docs/features/speculative_decoding/extract_hidden_states.md: id `num_hidden_layers` is the
  last layer's output before the final norm; chunked prefill must be disabled.
- vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py: files go to
  `<shared_storage_path>/<req_id>.safetensors` (default dir /tmp) holding `hidden_states`
  [T, n_ids, H] and `token_ids` [T] (the prompt ids); `request_finished` returns
  `{"hidden_states_path": filename}` as the request's kv_transfer_params; the worker takes an
  exclusive flock on `<file>.lock` before the client sees the path and a writer thread releases
  it after `save_file`; `load_hidden_states(path)` takes a shared flock on the lock file and
  then `load_file(path)`; `cleanup_hidden_states(path, keep_hidden_states=False)` removes the
  lock and the file.
- vllm/entrypoints/llm.py + vllm/transformers_utils/tokenizer.py: the engine loads the target's
  tokenizer at start-up with the `trust_remote_code` it was given, so a custom-code tokenizer
  (Kimi-K2.5's, named by `auto_map`) fails without it. The text model is vLLM's own
  implementation of the architecture; the fake stands in transformers' (`families.reference_lm`),
  which also reads the Kimi-K2.5 wrapper's `text_config` and `language_model.*` weights.
- vllm/v1/engine/logprobs.py: `prompt_logprobs=k` gives, per prompt position, None at position 0, then a
  dict token id -> Logprob(logprob, rank) holding the k most likely tokens (ranks 1..k) and the prompt's own
  token with its rank.
- Prefix caching: with it on, a prompt whose leading blocks are cached is not
  recomputed there, so its dump comes out short. vLLM's V1 default is on; the fake mimics the
  shortfall (block size 16) unless `enable_prefix_caching=False`.

Unlike the real `LLM.generate` (which sorts by request id) the fake returns outputs shuffled,
so code that maps outputs to samples by position fails here.
"""
from __future__ import annotations

import fcntl
import itertools
import os
import random
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file, save_file

BLOCK = 16
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


@dataclass
class SamplingParams:
    max_tokens: int | None = 16
    temperature: float = 1.0
    extra_args: dict | None = None
    prompt_logprobs: int | None = None


@dataclass
class Logprob:  # vllm/logprobs.py
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class KVTransferConfig:
    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def get_from_extra_config(self, key, default):
        return self.kv_connector_extra_config.get(key, default)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str = ""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    kv_transfer_params: dict[str, Any] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def load_hidden_states(path: str) -> dict[str, torch.Tensor]:
    with open(path + ".lock") as lf:
        fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps until the writer releases LOCK_EX
        return load_file(path, device="cpu")


def cleanup_hidden_states(path: str, keep_hidden_states: bool = False) -> None:
    if os.path.exists(path + ".lock"):
        os.remove(path + ".lock")
    if not keep_hidden_states and os.path.exists(path):
        os.remove(path)


def load_tokenizer(model: str, trust_remote_code: bool):
    """The engine's tokenizer: a custom class named by auto_map runs only with trust_remote_code."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    tc = Path(model) / "tokenizer_config.json"
    ref = (json.loads(tc.read_text()).get("auto_map") or {}).get("AutoTokenizer") if tc.is_file() else None
    if ref:
        if not trust_remote_code:
            raise ValueError(f"Loading {model} requires you to execute the tokenizer file in that repo on your local "
                             "machine. Set `trust_remote_code=True` to remove this error.")
        return get_class_from_dynamic_module(ref[0] if isinstance(ref, list) else ref, model).from_pretrained(model)
    return AutoTokenizer.from_pretrained(model)


class LLM:
    instances: list["LLM"] = []  # every LLM built, for tests to inspect

    def __init__(self, model: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
                 dtype: str = "auto", trust_remote_code: bool = False, **kwargs: Any):
        from tests.helpers.families import reference_lm

        self.kwargs = dict(model=model, tensor_parallel_size=tensor_parallel_size,
                           gpu_memory_utilization=gpu_memory_utilization, dtype=dtype,
                           trust_remote_code=trust_remote_code, **kwargs)
        self.tokenizer = load_tokenizer(model, trust_remote_code)
        kv = kwargs.get("kv_transfer_config")
        if isinstance(kv, dict):
            kv = KVTransferConfig(**kv)
        spec = kwargs.get("speculative_config") or {}
        if spec.get("method") != "extract_hidden_states":
            raise ValueError(f"fake vLLM supports only method extract_hidden_states, got {spec.get('method')}")
        assert spec.get("num_speculative_tokens") == 1
        ids = (((spec.get("draft_model_config") or {}).get("hf_config")) or {}).get("eagle_aux_hidden_state_layer_ids")
        if not ids:
            raise ValueError("eagle_aux_hidden_state_layer_ids must be set in the draft model config "
                             "for extract_hidden_states method")
        # eagle3's connector subclasses the stock one and keeps its file protocol (CPU write path aside)
        ours = (kv is not None and kv.kv_connector == "Eagle3HiddenStatesConnector"
                and kv.kv_connector_module_path == "eagle3.extract.vllm_connector")
        if kv is None or not (ours or kv.kv_connector == "ExampleHiddenStatesConnector"):
            raise ValueError("extract_hidden_states needs the ExampleHiddenStatesConnector (or a subclass) "
                             "in this fake")
        if kwargs.get("enable_chunked_prefill", True) is not False:
            raise ValueError("Chunked prefill is not compatible with extract_hidden_states")
        self.layer_ids = list(ids)
        self.storage = kv.get_from_extra_config("shared_storage_path", "/tmp")
        self.prefix_caching = kwargs.get("enable_prefix_caching", True) is not False
        self.dtype = torch.bfloat16 if dtype in ("auto", "bfloat16") else getattr(torch, dtype)
        self.model = reference_lm(model)
        self.request_counter = itertools.count()
        self._cached_blocks: set[tuple[int, ...]] = set()
        self._threads: list[threading.Thread] = []
        self.swap_paths = False  # tests: simulate a wrong path for a request
        LLM.instances.append(self)

    def _states(self, ids: list[int]) -> tuple[torch.Tensor, int, torch.Tensor]:
        """[T, n_ids, H] in the model dtype, the next token, and the log-probabilities [T, V]."""
        m = self.model
        n = m.config.num_hidden_layers
        # id k < N: HF hidden_states[k] (the stream entering layer k). id N: the pre-norm last output,
        # caught as the last decoder layer's own output (HF's last hidden_states entry is normed).
        cap = {}
        h = m.model.layers[-1].register_forward_hook(
            lambda mod, a, out: cap.setdefault("x", out[0] if isinstance(out, tuple) else out))
        try:
            with torch.no_grad():
                o = m(torch.tensor([ids]), output_hidden_states=True)
        finally:
            h.remove()
        per = [o.hidden_states[k][0] if k < n else cap["x"][0] for k in self.layer_ids]
        return torch.stack(per, dim=1).to(self.dtype), int(o.logits[0, -1].argmax()), o.logits[0].log_softmax(-1)

    def _write_async(self, path: str, tensors: dict[str, torch.Tensor]) -> None:
        # exclusive lock first (worker side, before the client gets the path), write later
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)

        def write():
            try:
                time.sleep(0.01)  # the file is reported before the disk write ends
                save_file(tensors, path)
            finally:
                os.close(fd)

        t = threading.Thread(target=write)
        t.start()
        self._threads.append(t)

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kw) -> list[RequestOutput]:
        if isinstance(prompts, dict):
            prompts = [prompts]
        outs = []
        for p in prompts:
            if not isinstance(p, dict) or "prompt_token_ids" not in p:
                raise TypeError("this fake takes TokensPrompt dicts only")
            ids = [int(x) for x in p["prompt_token_ids"]]
            req_id = str(next(self.request_counter))
            states, nxt, logp = self._states(ids)
            tok = torch.tensor(ids)
            if self.prefix_caching:
                # full blocks already in the cache are not recomputed: they are missing from the dump
                skip = 0
                while skip + BLOCK <= len(ids) - 1 and tuple(ids[: skip + BLOCK]) in self._cached_blocks:
                    skip += BLOCK
                for b in range(BLOCK, len(ids) + 1, BLOCK):
                    self._cached_blocks.add(tuple(ids[:b]))
                states = states[skip:]
            path = os.path.join(self.storage, f"{req_id}.safetensors")
            self._write_async(path, {"hidden_states": states.contiguous(), "token_ids": tok})
            outs.append(RequestOutput(req_id, None, ids, [CompletionOutput(0, [nxt])], True,
                                      {"hidden_states_path": path},
                                      prompt_logprobs(ids, logp, getattr(sampling_params, "prompt_logprobs", None))))
        if self.swap_paths and len(outs) > 1:
            outs[0].kv_transfer_params, outs[1].kv_transfer_params = (outs[1].kv_transfer_params,
                                                                      outs[0].kv_transfer_params)
        random.Random(len(outs)).shuffle(outs)
        return outs


def prompt_logprobs(ids: list[int], logp: torch.Tensor, k: int | None) -> list[dict[int, Logprob] | None] | None:
    """vLLM's prompt logprobs: position t > 0 holds the top k of the distribution of token t and token t itself."""
    if k is None:
        return None
    out: list[dict[int, Logprob] | None] = [None]
    for t in range(1, len(ids)):
        row = logp[t - 1]
        order = row.argsort(descending=True)
        d = {int(order[r]): Logprob(float(row[order[r]]), r + 1) for r in range(k)}
        if ids[t] not in d:
            d[ids[t]] = Logprob(float(row[ids[t]]), int((row > row[ids[t]]).sum()) + 1)
        out.append(d)
    return out


def install(monkeypatch) -> None:
    """Put the fake into sys.modules under vLLM's real module paths."""
    names = ["vllm", "vllm.config", "vllm.config.kv_transfer", "vllm.distributed", "vllm.distributed.kv_transfer",
             "vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.v1",
             CONNECTOR_MODULE]
    mods = {n: types.ModuleType(n) for n in names}
    mods["vllm"].LLM = LLM
    mods["vllm"].SamplingParams = SamplingParams
    mods["vllm.config.kv_transfer"].KVTransferConfig = KVTransferConfig
    mods[CONNECTOR_MODULE].load_hidden_states = load_hidden_states
    mods[CONNECTOR_MODULE].cleanup_hidden_states = cleanup_hidden_states
    for n in names[1:]:
        parent, _, child = n.rpartition(".")
        setattr(mods[parent], child, mods[n])
    for n, m in mods.items():
        monkeypatch.setitem(sys.modules, n, m)
    LLM.instances.clear()
