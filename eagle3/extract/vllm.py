"""The vLLM backend: vLLM's native hidden-state extraction, tensor/pipeline parallel.

Contract, as read in vLLM's source (facts only):
- `vllm/v1/spec_decode/extract_hidden_states.py`: the speculative method
  "extract_hidden_states" requires `num_speculative_tokens == 1` and reads the layer ids from
  `draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`; it stacks one [T, H] tensor
  per id into [T, n_ids, H], in the order given.
- `docs/features/speculative_decoding/extract_hidden_states.md`: passing `num_hidden_layers`
  as an id stores the last layer's output *without* the final norm (our id N); chunked prefill
  is incompatible and must be disabled.
- `vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py`
  (ExampleHiddenStatesConnector): `kv_connector_extra_config["shared_storage_path"]` is the
  directory (default /tmp); each finished request's file is `<dir>/<req_id>.safetensors` with
  `hidden_states [T, n_ids, H]` (model dtype) and `token_ids [T]` (the prompt ids); the path
  comes back in `RequestOutput.kv_transfer_params["hidden_states_path"]`; only TP rank 0
  writes; the write is asynchronous and guarded by an exclusive flock on `<file>.lock`
  (`use_synchronization_lock`, default on), which `load_hidden_states(path)` waits on with a
  shared lock; `cleanup_hidden_states(path)` removes the file and its lock.
- `vllm/entrypoints/llm.py`: `LLM(model, tensor_parallel_size=..., **engine_args)` accepts
  `kv_transfer_config` as a dict or a KVTransferConfig; `generate(prompts, sampling_params)`
  takes `{"prompt_token_ids": [...]}` prompts and returns one RequestOutput per request,
  each with its own `request_id` and `prompt_token_ids`.
- With prefix caching on, a prompt whose leading blocks are cached is not recomputed there, so
  its dumped states come out short: keep it off.

Outputs are mapped back to samples through the request itself -- the token ids the connector
saved for it, which must equal its prompt -- never through the position in the output list.
The old custom-worker + `collective_rpc` route is not used here: `MultiprocExecutor.collective_rpc(...,
unique_reply_rank=0)` returns rank 0's value bare while `LLM.collective_rpc` returns a list, and
indexing [0] on the bare value once silently kept 1 of 4 layers. Every sample is still validated for
layer count and shape.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from eagle3.config import ExtractConfig
from eagle3.runtime.vllm_engine import import_vllm, on_cpu, resolve_dtype, shutdown, start_engine

# Our subclass of vLLM's ExampleHiddenStatesConnector: the stock write path on CUDA, a synchronous
# one on a CPU engine (the stock one needs CUDA streams and pinned memory). vLLM imports it by path.
CONNECTOR = "Eagle3HiddenStatesConnector"
CONNECTOR_MODULE = "eagle3.extract.vllm_connector"


def llm_kwargs(model: str | Path, layer_ids: Sequence[int], cfg: ExtractConfig, max_len: int, storage_dir: Path,
               trust_remote_code: bool = False) -> dict:
    """The LLM(...) arguments for native extraction (one place, so tests can check them)."""
    from eagle3.model.target import Target

    dtype = resolve_dtype(cfg.dtype)
    kw = dict(
        model=str(model),
        trust_remote_code=trust_remote_code,  # Kimi-K2.5's tokenizer (and config class) are custom code
        tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        dtype=dtype,
        **Target.open(model).vllm_args(dtype, on_cpu()),
        # +1: the prompt plus the one token max_tokens=1 samples.
        max_model_len=max_len + 1,
        enable_prefix_caching=False,  # prefix hits skip the forward of cached tokens: short dumps
        enable_chunked_prefill=False,  # required by extract_hidden_states (vLLM docs)
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
        },
    )
    if cfg.max_num_batched_tokens is not None:
        if cfg.max_num_batched_tokens < max_len + 1:
            # Without chunked prefill a prompt must fit one scheduler step.
            raise ValueError(
                f"max_num_batched_tokens={cfg.max_num_batched_tokens} is below the longest prepared "
                f"sample ({max_len} tokens + 1); chunked prefill is off, so raise it"
            )
        kw["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    return {**kw, **cfg.engine_args}


class VllmBackend:
    """Extract hidden states [T, n_aux + 1, H] with vLLM's extract_hidden_states method."""

    name = "vllm"

    def __init__(self, model: str | Path, layer_ids: Sequence[int], cfg: ExtractConfig, max_len: int, tmp_dir: Path,
                 trust_remote_code: bool = False):
        vllm = import_vllm("--backend vllm")
        from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as conn

        self.layer_ids = list(layer_ids)
        self.tmp_dir = Path(tmp_dir)
        if self.tmp_dir.exists():
            shutil.rmtree(self.tmp_dir)  # files of a killed run: their requests will be redone
        self.tmp_dir.mkdir(parents=True)
        self._load: Callable[[str], dict] = conn.load_hidden_states
        self._cleanup: Callable[[str], None] | None = getattr(conn, "cleanup_hidden_states", None)
        self._params = vllm.SamplingParams(max_tokens=1)
        self.llm = start_engine("--backend vllm", **llm_kwargs(model, self.layer_ids, cfg, max_len, self.tmp_dir,
                                                                 trust_remote_code))

    def _remove(self, path: str) -> None:
        if self._cleanup is not None:
            self._cleanup(path)
        else:
            for p in (path + ".lock", path):
                if os.path.exists(p):
                    os.remove(p)

    def extract(
        self, samples: Sequence[tuple[str, torch.Tensor]], on_tokens: Callable[[int], None] | None = None
    ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """Yield (sample_id, token_ids [T], hidden [T, n_aux + 1, H]) for every sample, in any order."""
        # content -> sample ids waiting for it (identical prompts give identical states)
        waiting: dict[tuple[int, ...], list[str]] = {}
        for sid, ids in samples:
            waiting.setdefault(tuple(ids.tolist()), []).append(sid)
        prompts = [{"prompt_token_ids": ids.tolist()} for _, ids in samples]
        outputs = self.llm.generate(prompts, self._params, use_tqdm=False)
        if len(outputs) != len(samples):
            raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(samples)} prompts")
        seen_requests: set[str] = set()
        pending = {str(o.request_id): (o.kv_transfer_params or {}).get("hidden_states_path") for o in outputs}
        try:
            yield from self._convert(outputs, waiting, seen_requests, pending, on_tokens)
        finally:
            # On an error (or an abandoned generator) the connector may still be writing the files
            # of unconverted requests: wait for each one's lock, then delete it.
            for path in pending.values():
                if path:
                    self._discard(path)

    def references(self, samples: Sequence[tuple[str, torch.Tensor]], head=None) -> tuple[dict, str]:
        """The engine's own next-token choice at each position of `samples` (eagle3.extract.check): its prompt
        logprobs, top 2, from this same engine, which never reads the states the connector dumps (those of these
        requests are deleted unread)."""
        from eagle3.extract.check import Tops

        vllm = import_vllm("--backend vllm")
        sp = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
        by_prompt = {tuple(ids.tolist()): sid for sid, ids in samples}
        outputs = self.llm.generate([{"prompt_token_ids": ids.tolist()} for _, ids in samples], sp, use_tqdm=False)
        out = {}
        for o in outputs:
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if path:
                self._discard(path)
            top1, margin = [], []
            for pos in (o.prompt_logprobs or [None])[1:]:  # entry t: the distribution of token t; entry 0 is None
                by_rank = {lp.rank: (tok, lp.logprob) for tok, lp in pos.items()}
                top1.append(by_rank[1][0])
                margin.append(by_rank[1][1] - by_rank[2][1])
            out[by_prompt[tuple(o.prompt_token_ids)]] = Tops(torch.tensor(top1, dtype=torch.long),
                                                            torch.tensor(margin, dtype=torch.float32))
        return out, "vLLM prompt_logprobs"

    def _discard(self, path: str) -> None:
        import fcntl

        lock = path + ".lock"
        if os.path.exists(lock):
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
        self._remove(path)

    def _convert(self, outputs, waiting, seen_requests, pending, on_tokens):
        for out in outputs:
            rid = str(out.request_id)
            if rid in seen_requests:
                raise ValueError(f"vLLM returned request {rid} twice")
            seen_requests.add(rid)
            params = out.kv_transfer_params or {}
            path = params.get("hidden_states_path")
            if not path:
                raise ValueError(f"vLLM request {rid}: no hidden_states_path in kv_transfer_params ({params})")
            data = self._load(path)  # waits on the connector's lock until the file is complete
            tok = data["token_ids"].reshape(-1).to(torch.int64)
            prompt = tuple(int(x) for x in out.prompt_token_ids)
            if tuple(tok.tolist()) != prompt:
                raise ValueError(
                    f"vLLM request {rid}: the saved token ids ({tok.numel()}) differ from its prompt "
                    f"({len(prompt)} tokens); {path}"
                )
            sids = waiting.get(prompt)
            if not sids:
                raise ValueError(f"vLLM request {rid}: its prompt matches no requested sample")
            sid = sids.pop()
            hidden = data["hidden_states"]  # [T, n_ids, H]; validated by the store before commit
            self._remove(path)  # converted: the connector's file and lock are no longer needed
            pending.pop(rid, None)
            yield sid, tok, hidden
            if on_tokens is not None:
                on_tokens(int(tok.numel()))

    def close(self) -> None:
        shutdown(self.llm)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)
