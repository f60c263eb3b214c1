"""Planning: estimate what each remaining stage will write, need and take, and refuse a run that cannot finish.

`plan(cfg)` chains the estimates (`estimates`: tokens, samples, the target's shape, the draft's parameters)
into the typed rows of a `Plan` (`table`): disk (`disk`), memory (`memory`) and wall time (`timing`), each
check adding its rows and returning its problems; `check` raises them. The rates behind every time are in
`rates`. Estimates, in bytes unless said:
- prepare: tokens x 5 (int32 ids + int8 mask; Parquet compresses this further);
- extract: tokens x bytes_per_token(3 aux + final, H, storage) -- the dominant term (offline: the store);
  online (`mode: online`): the spool's cap, `spool_bytes`, which must hold the validation shard plus two steps;
- verifier: (2 V + Vd) x H x weight bytes;
- train: draft params P x (4 weights + 8 AdamW) per checkpoint, times (keep_last + best + one being written),
  plus the fp32 export; CPU peak memory per rank (`memory.train_memory`);
- extract on GPU (vLLM): weights P_target x weight_bytes / (TP x PP) must fit gpu_memory_utilization.
Token counts come from the prepare manifest when it exists, else from the first 1,000 records of the source run
through prepare's own stream and scaled to the records it will read (else ShareGPT's measured share and mean).

Wall time per remaining stage, on CPU from SmolLM2 rates measured on a 2-core host, scaled by the target's size
and by this host's speed (`host`: a few seconds of the same kernels, eagle3/probe.py: hosts of one kind run
this code 1.2-1.8x apart), on GPU from measured rates turned into FLOP/s per GPU; a run over `max_hours` is
refused. On CPU the eval's answer build (the replay's batched greedy decoding, the run's memory peak) must fit
MemAvailable with at least 8 rows at once, else the run is refused with the options. Extraction over
`extract.workers` hosts takes the largest range's share of one host's time. Online, extraction runs once per
epoch the trainer reads, beside the trainer: the pair takes the longer of the two plus one shard's start-up.
"""
from __future__ import annotations

import os
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.planning.disk import disk_plan, stage_disk
from eagle3.planning.estimates import draft_params, expected_tokens, target_plan, worker_share
from eagle3.planning.memory import eval_memory, gpu_weights, train_memory
from eagle3.planning.rates import HEADROOM, PROBE_OVER_S
from eagle3.planning.table import Plan, Row
from eagle3.planning.timing import precision_rows, time_rows
from eagle3.probe import HostSpeed
from eagle3.runtime.heap import proc_bytes
from eagle3.runtime.progress import hms
from eagle3.storage.space import GIB, PreflightError, disk_free, human

__all__ = ["GIB", "HEADROOM", "Plan", "PreflightError", "Row", "check", "hms", "human", "measure_host", "plan",
           "target_plan", "worker_share"]


def plan(cfg: PipelineConfig, free_bytes: int | None = None, free_mem: int | None = None,
         max_hours: float = 0.0, host: HostSpeed | None = None) -> Plan:
    """Estimate every stage not yet finished; list the problems (does not raise). `host`: this host's speed
    (`measure_host`); default: the reference host's rates. `free_bytes` / `free_mem`: the free disk under
    run_dir and MemAvailable, read from this host where not given."""
    t = target_plan(cfg)
    tokens = expected_tokens(cfg)
    vd = cfg.prepare.draft_vocab or min(32000, t.vocab_size)
    P = draft_params(t, vd, cfg.train.draft_layer)
    pl = Plan(tokens=tokens, max_hours=max_hours, host=host or HostSpeed())
    free = disk_free(Path(cfg.run_dir)) if free_bytes is None else free_bytes
    pl.problems += disk_plan(pl, cfg, t, stage_disk(cfg, t, tokens, vd, P), free)
    cuda = _has_cuda()
    mem = free_mem if free_mem is not None else proc_bytes("/proc/meminfo", "MemAvailable")
    pl.problems += train_memory(pl, cfg, t, P, vd, None if cuda else mem)
    if cfg.eval.backend == "hf" and cfg.eval.mode == "replay" and not cuda:
        pl.problems += eval_memory(pl, cfg, t, mem)
    if cfg.eval.backend == "vllm" and t.kv_lora_rank and cfg.train.draft_layer == "llama" and not cuda:
        pl.problems.append("eval: vLLM's CPU engine cannot serve a Llama-layer draft beside this MLA target (their KV "
                           "blocks have no common size there); set train.draft_layer: mla, or eval.backend: hf")
    pl.problems += precision_rows(pl, cfg)
    pl.problems += time_rows(pl, cfg, t, tokens, P, vd)
    if cfg.extract.backend == "vllm":
        pl.problems += gpu_weights(pl, cfg, t)
    return pl


def check(cfg: PipelineConfig, **kw) -> Plan:
    """`plan`, raising PreflightError with every problem when the run cannot finish."""
    return plan(cfg, **kw).refuse()


def measure_host(cfg: PipelineConfig) -> HostSpeed:
    """This host's speed (eagle3/probe.py, measured once per process) where the run's remaining CPU work
    is estimated over PROBE_OVER_S at the reference rates; else the reference (no probe). On a host whose
    stages run on GPUs the CPU rates plan nothing big, so it is not measured there either."""
    if _has_cuda():
        return HostSpeed()
    if plan(cfg, free_bytes=1 << 60, free_mem=1 << 60).total_seconds() <= PROBE_OVER_S:
        return HostSpeed()
    from eagle3.probe import measure

    return measure()


def _has_cuda() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
