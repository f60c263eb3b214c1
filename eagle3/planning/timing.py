"""Wall time of each remaining stage: on GPU from FLOPs at measured FLOP/s per GPU, on CPU from SmolLM2's
measured rates scaled by the target's size and this host's speed; online, extract and train overlap."""
from __future__ import annotations

from eagle3.config import DEFAULT_DRAFT_VOCAB, PipelineConfig, TargetPlan
from eagle3.planning import rates
from eagle3.planning.estimates import (
    epochs_read,
    estimated_steps_per_epoch,
    eval_turns,
    expected_conversations,
    sampled,
    steps_share,
    val_samples,
    val_share,
    worker_share,
)
from eagle3.planning.table import Plan
from eagle3.probe import HostSpeed
from eagle3.runtime.progress import hms


def extract_seconds(cfg: PipelineConfig, t: TargetPlan, tokens: int, host: HostSpeed) -> float:
    """One pass of extraction over `tokens`: vLLM at the measured FLOP/s per GPU (2 x active parameters per
    token), else the hf backend at SmolLM2's CPU rate scaled by the active parameters and this host's forward
    speed; over `extract.workers` hosts, the largest range's share."""
    gpus = cfg.extract.tensor_parallel_size * cfg.extract.pipeline_parallel_size
    active = t.active_parameters or t.num_parameters
    if cfg.extract.backend == "vllm":
        s = 2 * active * tokens / (gpus * rates.GPU_EXTRACT_FLOPS["moe" if t.active_parameters else "dense"])
    else:
        rate = rates.EXTRACT_CPU_BF16_TOK_PER_S if extract_dtype(cfg) == "bfloat16" else rates.EXTRACT_CPU_TOK_PER_S
        s = tokens / rate * (active / rates.SMOLLM2_PARAMS) / host.forward
    return s * worker_share(cfg, t, tokens)


def train_seconds(cfg: PipelineConfig, t: TargetPlan, tokens: int, P: int, vd: int, host: HostSpeed) -> float:
    """The trainer's wall time: on GPU (a vLLM run) FLOPs at the measured FLOP/s per GPU; on CPU SmolLM2's
    measured first-epoch and later-epoch rates (and each validation at half a step's cost per token), scaled by
    the draft's size, the unroll and this host's speed; scaled to the steps max_steps sets, fewer or more."""
    tc = cfg.train
    if cfg.extract.backend == "vllm":
        pd = P - vd * t.hidden_size - 3 * t.hidden_size * t.hidden_size  # one TTT step's layer weights
        flops = (6 * (pd + vd * t.hidden_size) * tc.ttt_steps * tokens * tc.epochs
                 + 2 * t.vocab_size * t.hidden_size * tokens * tc.epochs)
        s = flops / (tc.world * rates.GPU_TRAIN_FLOPS)
    else:
        r1, r2 = rates.TRAIN_CPU_BF16_TOK_PER_S if cpu_precision(cfg) == "bf16" else rates.TRAIN_CPU_TOK_PER_S
        vals = tc.epochs + tc.epochs * estimated_steps_per_epoch(cfg, tokens) // tc.val_every
        step = rates.MUON_STEP_COST if tc.optimizer == "muon" else 1.0
        s = ((tokens / r1 * step + tokens * (tc.epochs - 1) / r2 * step + vals * tokens * val_share(cfg) * 0.5 / r2)
             * (P / 10e6) * (tc.ttt_steps / 3) + rates.TRAIN_CPU_START_S) / host.train
    return s * steps_share(cfg, tokens)


def cpu_precision(cfg: PipelineConfig) -> str:
    """What train.precision resolves to on this host's CPU ("bf16" or "fp32")."""
    from eagle3.runtime.floats import resolve_precision

    return resolve_precision(cfg.train.precision, "cpu")


def extract_dtype(cfg: PipelineConfig) -> str:
    """What extract.dtype resolves to on this host's CPU ("bfloat16" or "float32")."""
    from eagle3.runtime.floats import resolve_compute_dtype

    return resolve_compute_dtype(cfg.extract.dtype, "cpu")


def precision_rows(pl: Plan, cfg: PipelineConfig) -> list[str]:
    """The CPU extraction's and trainer's precision as rows; the problem where bf16 is asked of a CPU without bf16
    units (emulated, many times slower than fp32: a 2-core AVX2 host ran the probe's training step 13-16x
    slower)."""
    from eagle3.runtime.floats import cpu_bf16

    if cfg.extract.backend == "vllm":
        return []
    units = "bf16 units" if cpu_bf16() else "no bf16 units (avx512_bf16, AMX)"
    pl.row("extract", f"compute dtype on this CPU ({units}; extract.dtype: {cfg.extract.dtype})", extract_dtype(cfg))
    pl.row("train", f"precision on this CPU ({units}; train.precision: {cfg.train.precision})", cpu_precision(cfg))
    if cpu_bf16():
        return []
    problems = []
    if cfg.extract.dtype == "bfloat16":
        problems.append("extract: dtype bfloat16 on a CPU without bf16 units (avx512_bf16 or AMX in /proc/cpuinfo) is "
                        "emulated, as the trainer's bf16 is (13-16x slower than fp32 there); set extract.dtype: fast "
                        "(bf16 where the CPU has the units) or float32")
    if cfg.train.precision == "bf16":
        problems.append("train: precision bf16 on a CPU without bf16 units (avx512_bf16 or AMX in /proc/cpuinfo) is "
                        "emulated and many times slower than fp32; set train.precision: fast (bf16 where the CPU has "
                        "the units) or fp32")
    return problems


def time_rows(pl: Plan, cfg: PipelineConfig, t: TargetPlan, tokens: int, P: int, vd: int) -> list[str]:
    """Fill pl.seconds (each remaining stage; online, extraction once per epoch read, and the overlapping pair),
    add their rows, and return the problem where the total is over pl.max_hours."""
    from eagle3.planning.disk import offline_store_bytes, spool_val_bytes

    epochs = epochs_read(cfg, tokens) if cfg.mode == "online" else 1  # online: extraction runs once per epoch
    pl.seconds = stage_seconds(cfg, t, tokens, extract_seconds(cfg, t, tokens, pl.host) * epochs,
                               train_seconds(cfg, t, tokens, P, vd, pl.host), pl.host)
    if cfg.extract.workers > 1:
        pl.row("extract", f"over {cfg.extract.workers} workers: the largest range's share of the tokens",
               f"{worker_share(cfg, t, tokens):.3f}")
    for k, v in pl.seconds.items():
        pl.row(k, "wall time (estimate)", hms(v))
    if cfg.mode == "online" and {"extract", "train"} <= pl.seconds.keys():
        pl.pair_s = online_pair_seconds(cfg, pl.seconds, offline_store_bytes(cfg, t, tokens),
                                        spool_val_bytes(cfg, t, tokens), epochs)
        pl.row("extract + train", f"wall time together (online, {epochs} epoch(s) of extraction beside the trainer)",
               hms(pl.pair_s))
    total = pl.total_seconds()
    if not pl.max_hours or total <= pl.max_hours * 3600:
        return []
    big = ", ".join(f"{k} {hms(v)}" for k, v in sorted(pl.seconds.items(), key=lambda kv: -kv[1])[:2])
    return [f"time: about {hms(total)} ({big}) is over max_hours = {pl.max_hours:g} ({hms(pl.max_hours * 3600)}). "
            f"Options: raise max_hours in the run form (0: no limit), or fewer tokens (prepare.limit, "
            f"prepare.max_len) or fewer epochs (train.epochs, train.max_steps)"]


def online_pair_seconds(cfg: PipelineConfig, seconds: dict[str, float], store: float, val: float,
                        epochs: int) -> float:
    """Wall time of online extract and train run together, from each side's own time. Two stages over n shards
    take n x max(a, b) + min(a, b), a and b one shard's time on each side: a slower trainer starts once the first
    shard is produced, and behind a slower producer the last shard is trained after it ends. Assumes the two do
    not slow each other down (each on its own devices)."""
    ex, tr = seconds["extract"], seconds["train"]
    # the spool cuts windows at what its val shard (`val`) leaves over (producers + 1): each producer writes one
    # while the trainer reads another
    window = max(cfg.spool_bytes - val, 0) / (cfg.extract.workers + 1)
    share = min(1.0, window / max(store, 1.0))  # one window of one epoch
    return max(ex, tr) + min(ex / epochs, tr / cfg.train.epochs) * share



def stage_seconds(cfg: PipelineConfig, t: TargetPlan, tokens: int, ex_s: float, tr_s: float,
                  host: HostSpeed | None = None) -> dict[str, float]:
    """Wall time of each stage not yet finished, in pipeline order (extract and train computed by `plan`); CPU
    decoding at `host.decode` and forwards at `host.forward` times the reference host's rates."""
    from eagle3.storage.manifests import EvalReport, HiddenStates, PreparedData, TrainedDraft, VerifierWeights

    host = host or HostSpeed()
    size = (t.active_parameters or t.num_parameters) / rates.SMOLLM2_PARAMS  # CPU rates scale with the target's size
    vd = cfg.prepare.draft_vocab or min(DEFAULT_DRAFT_VOCAB, t.vocab_size)
    turns, new = eval_turns(cfg), cfg.eval.max_new_tokens
    if cfg.eval.backend == "vllm":  # two engines (target alone, speculative), each starts and decodes
        ev_s = 2 * rates.VLLM_START_S + 2 * turns * new / rates.VLLM_DECODE_TOK_PER_S
    elif cfg.eval.mode == "replay":  # cached greedy answers (batched), one forward for the aux states, a live check
        ev_s = rates.EVAL_CPU_START_S / host.decode + replay_seconds(turns, new, host) * size
        ev_s += 2 * min(cfg.eval.live_check, turns // 2 or 1) * (cfg.eval.live_max_new_tokens or new) * 2 \
            / (rates.EVAL_CPU_TOK_PER_S * host.decode) * size if cfg.eval.live_check else 0
    else:  # speculative and plain greedy decoding of every turn, one sequence at a time
        ev_s = turns * new * 2 / (rates.EVAL_CPU_TOK_PER_S * host.decode) * size
    if cfg.extract.backend != "vllm" and cfg.train.replay_prompts:  # the replay set, built before training
        n = min(cfg.train.replay_prompts, val_samples(cfg))
        tr_s += (rates.REPLAY_SET_CPU_START_S + n * rates.REPLAY_SET_CPU_S_PER_PROMPT
                 + cfg.train.replay_max_new_tokens / rates.REPLAY_SET_CPU_STEPS_PER_S) / host.decode * size
    done = {"prepare": PreparedData, "extract": HiddenStates, "verifier": VerifierWeights, "train": TrainedDraft,
            "eval": EvalReport}
    s = sampled(cfg)  # prepare's own stream timed on a sample of the source, where there is one
    n_conv = expected_conversations(cfg)
    prep = s[3] * n_conv / s[0] if s else 5 + n_conv / rates.PREPARE_CONV_PER_S
    est = {"prepare": prep, "extract": ex_s,
           "verifier": 0.7 + (2 * t.vocab_size + vd) * t.hidden_size * t.weight_bytes / 500e6, "train": tr_s,
           "eval": ev_s}
    out = {k: v for k, v in est.items() if not done[k].exists(cfg.stage_dir(k))}
    r = cfg.regenerate
    if r is not None:  # an upper bound: every assistant turn (~3 per conversation) at max_new_tokens
        n = min(expected_conversations(cfg), r.limit) if r.limit else expected_conversations(cfg)
        rate = rates.VLLM_DECODE_TOK_PER_S if r.backend == "vllm" else rates.REGEN_CPU_TOK_PER_S * host.decode / size
        out = {"regenerate": n * 3 * r.max_new_tokens / rate, **out}
    return out



def replay_seconds(turns: int, new: int, host: HostSpeed | None = None) -> float:
    """Replay's cache for a SmolLM2-sized target at the measured 2-thread rates (times this host's speed):
    `turns` greedy answers of up to `new` tokens (batched decoding), then one forward over prompts + answers
    (~2 x the answer tokens)."""
    host = host or HostSpeed()
    return (turns * new / (rates.REPLAY_CPU_DECODE_TOK_PER_S * host.decode)
            + 2 * turns * new / (rates.REPLAY_CPU_FORWARD_TOK_PER_S * host.forward))
