"""Memory: the CPU trainer's peak per rank, the replay answers' build on CPU, and the target's weights per
GPU under vLLM; a run that cannot fit is refused here with the options, before any stage starts."""
from __future__ import annotations

from eagle3.config import PipelineConfig, TargetPlan
from eagle3.planning.estimates import eval_turns
from eagle3.planning.rates import EVAL_PROMPT_TOKENS
from eagle3.planning.table import Plan
from eagle3.storage.space import GIB, human


def eval_memory(pl: Plan, cfg: PipelineConfig, t: TargetPlan, mem: int | None) -> list[str]:
    """The replay's answer build on CPU: a wave of rows (one turn of every prompt) decoded together, each row's
    fp32 KV cache counted twice (eagle3/decoding/batch_decode.py, `answer_rows`), beside the target's fp32 weights.
    The build takes fewer rows at once where they do not fit; below 8 it is refused, here first."""
    from eagle3.decoding.batch_decode import ANSWER_FLOOR_ROWS, KV_SLACK

    e = cfg.eval
    wave = eval_turns(cfg) // 2 if e.prompts == "mt-bench" else eval_turns(cfg)
    seq = EVAL_PROMPT_TOKENS + 2 * (e.max_new_tokens + max(e.k, 8))
    row = KV_SLACK * t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim * 4 * seq
    weights = 4 * t.num_parameters
    rows = min(wave, 128)
    need = weights + rows * row + int(0.5 * GIB)  # + the runtime
    pl.row("eval", f"memory of the replay answers, {rows} rows at once (estimate)", human(need), need)
    if not mem or need <= mem:
        return []
    fit = int((0.9 * mem - weights - 0.5 * GIB) // row)
    if fit >= min(ANSWER_FLOOR_ROWS, rows):
        pl.row("eval", "the answers decode in smaller batches to fit MemAvailable", f"{fit} rows at once")
        return []
    return [f"memory: the eval's replay answers need about {human(weights + ANSWER_FLOOR_ROWS * row)} for "
            f"{ANSWER_FLOOR_ROWS} rows at once, {human(mem)} is available; lower eval.max_new_tokens or eval.limit, "
            f"use eval.mode live, or free memory"]


def train_memory(pl: Plan, cfg: PipelineConfig, t: TargetPlan, P: int, vd: int, mem: int | None) -> list[str]:
    """The CPU trainer's peak per rank (a row), and the problem where nproc ranks of it do not fit `mem`.
    Saved for backward per token and TTT step: ~3 MLP-wide + ~14 H-wide fp32 rows (measured: 308 MB for
    SmolLM2 at k=3, 2048 tokens); the loss keeps no [L, Vd] tensor, only the targets' [L, Vd] and one chunk;
    two [V, H] fp32 copies (embedding, target head; one when tied); params + grads + AdamW; ~0.35 GB of
    torch runtime. SmolLM2 k=3 Vd=8192 at 2048 tokens: 1.2 GB estimated, 1.39 GB peak RSS measured
    (benchmarks/speed/train.py). On GPU the memory is torch's, checked when the trainer starts."""
    tc = cfg.train
    act = (tc.ttt_steps * tc.pack_tokens * 4 * (3 * t.intermediate_size + 14 * t.hidden_size)
           + 2 * tc.pack_tokens * vd * 4 + 2 * t.vocab_size * t.hidden_size * 4 + P * 16 + int(0.35 * GIB))
    pl.row("train", "activation memory per rank (estimate)", human(act), act)
    if mem and act * tc.nproc_per_node > mem:
        return [f"memory: training needs about {human(act * tc.nproc_per_node)} ({tc.nproc_per_node} process(es)), "
                f"{human(mem)} is available; lower train.pack_tokens, train.ttt_steps or the draft vocab"]
    return []


def gpu_weights(pl: Plan, cfg: PipelineConfig, t: TargetPlan) -> list[str]:
    """vLLM extraction: the target's weights per device (TP x PP shards) against gpu_memory_utilization of one
    GPU; over 90% of it leaves no KV cache."""
    ex = cfg.extract
    per_gpu = t.num_parameters * t.weight_bytes / (ex.tensor_parallel_size * ex.pipeline_parallel_size)
    budget = cfg.gpu_memory_gib * GIB * ex.gpu_memory_utilization
    pl.row("extract", "GPU weights per device / budget", f"{human(per_gpu)} / {human(budget)}", per_gpu)
    if per_gpu > 0.9 * budget:
        return [f"GPU memory: {human(per_gpu)} of weights per GPU leaves no KV cache within {human(budget)}; raise "
                f"tensor_parallel_size or pipeline_parallel_size"]
    return []
