"""Preflight: estimate what each remaining stage will write and need, and refuse a run that cannot finish.

Estimates (bytes unless said otherwise):
- prepare: tokens x 5 (int32 ids + int8 mask; Parquet compresses this further);
- extract: tokens x bytes_per_token(3 aux + final, H, storage) -- the dominant term (offline: the store);
  online (`mode: online`): the spool's cap, `spool_bytes`, which must hold the validation shard plus two steps;
- verifier: (2 V + Vd) x H x weight bytes;
- train: draft params P x (4 weights + 8 AdamW) per checkpoint, times (keep_last + best + one
  being written), plus the fp32 export; CPU peak memory ~ k x pack x Vd x 4 x 3 (logits, their
  gradient, the softmax) + 2 V x H x 4 (target head);
- extract on GPU (vLLM): weights P_target x weight_bytes / (TP x PP) must fit gpu_memory_utilization.
Token counts come from the prepare manifest when it exists, else from the first 1,000 records of the source run
through prepare's own stream and scaled to the records it will read (else ShareGPT's measured share and mean).

Wall time per remaining stage, on CPU from SmolLM2 rates measured on a 2-core host, scaled by the
target's size and by this host's speed (`host`: a few seconds of the same kernels, eagle3/probe.py:
hosts of one kind run this code 1.2-1.8x apart), on GPU from measured rates turned into FLOP/s per GPU; a run over
`max_hours` is refused. On CPU the eval's answer build (the replay's batched greedy decoding, the run's
memory peak) must fit MemAvailable with at least 8 rows at once, else the run is refused with the options.
Extraction over `extract.workers` hosts takes the largest range's share of one host's time.
Online, extraction runs once per epoch the trainer reads, beside the trainer: the pair takes the longer of the two
plus one shard's start-up, not their sum.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from eagle3.config import DEFAULT_DRAFT_VOCAB, PipelineConfig, TargetPlan
from eagle3.model.target import MLA_DRAFT_HEAD_DIM, Target
from eagle3.probe import HostSpeed
from eagle3.runtime.heap import proc_bytes
from eagle3.runtime.progress import hms
from eagle3.storage.space import GIB, PreflightError, disk_free, human  # noqa: F401 -- re-exported

SHAREGPT_RECORDS = 17_671     # complete records of the bundled (truncated) file
SHAREGPT_KEPT = 0.95          # share that survives normalization (measured on the first 2,000)
SHAREGPT_MEAN_TOKENS = 1_360  # mean tokens of a kept conversation, SmolLM2 template, before truncation
HEADROOM = 1.10               # 10% slack on every disk estimate
# Time estimates. GPU: FLOPs / (devices x FLOP/s per GPU), the FLOP/s those of measured runs (a datasheet peak
# overstated extraction 22x: Kimi-K2.5 planned at 7m36s, measured at 2h47m).
# CPU: SmolLM2-135M rates measured on a 2-core host, scaled by the target's size; where each was
# measured, with its command: benchmarks/RESULTS.md, "Planning rates of the preflight".
# GPU extraction (vLLM), 2 x active parameters x tok/s / GPUs of a measured run: MoE from Kimi-K2.5 (INT4, 32B
# active) at TP 8 on an 8 x H200 host, ~2,280 tok/s (18.2 TFLOP/s per GPU); dense from the hf extraction stage
# on a Llama-3.2-1B-shaped model on one H200, 22,576 tok/s (`benchmarks.gpu_check`, 56 TFLOP/s per GPU).
GPU_EXTRACT_FLOPS = {"moe": 18.2e12, "dense": 56e12}
# GPU training: `benchmarks.gpu_check`'s trainer on one H200 at Llama-3.1-8B draft shapes (k=7, draft vocab 32k,
# 8192-token packs, bf16): 8,204 tok/s, i.e. this module's FLOPs per trained token x 8,204 = 138 TFLOP/s.
GPU_TRAIN_FLOPS = 138e12
PREPARE_CONV_PER_S = 490          # prepare, conversations/s (where no sample of the source was timed)
EXTRACT_CPU_TOK_PER_S = 570       # hf extraction, 2 threads, packed linears
# training, k=3, 2048-token packs, 2 threads: the first epoch (it computes the target's full-vocab argmax where a
# loss reads it) and later ones (the argmax cached per sample); plus torchrun's start and each validation's
# forward over the val split (half a training step's cost per token: 7 s for the demo's 8.3k val tokens)
TRAIN_CPU_TOK_PER_S = (550, 600)
TRAIN_CPU_START_S = 15
EVAL_CPU_TOK_PER_S = 13.5         # live eval (hf, one thread, k=3), generated tok/s counting both passes
EVAL_CPU_START_S = 16             # the eval's fixed part: the target and the draft loaded, the replay itself
REPLAY_CPU_DECODE_TOK_PER_S = 137  # replay: the target's greedy answers, batched (turns x max_new per s)
REPLAY_CPU_FORWARD_TOK_PER_S = 715  # replay: their aux states, one forward on packed linears (2 x turns x max_new)
# the trainer's small replay set (val prompts answered greedily, batched): a fixed start (a process, the weights), each
# prompt's prefill and aux states, and decoding bound by its steps (~10 rows at once in the demo)
REPLAY_SET_CPU_START_S = 10
REPLAY_SET_CPU_S_PER_PROMPT = 1.2
REPLAY_SET_CPU_STEPS_PER_S = 16
REGEN_CPU_TOK_PER_S = 33          # regenerate (hf, batch 32, 2 threads), generated tok/s with the prompts' prefill
SMOLLM2_PARAMS = 135e6
VLLM_START_S = 120                # vLLM (planning assumptions): an engine's start
VLLM_DECODE_TOK_PER_S = 2000      # batched decoding per engine
MTBENCH_QUESTIONS = 80  # two turns each
EVAL_PROMPT_TOKENS = 400  # the longest second-turn prompt of MT-Bench without its first answer (SmolLM2 template)


@dataclass
class Plan:
    tokens: int
    rows: list[dict] = field(default_factory=list)  # stage, what, bytes / gib, where
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each remaining stage
    problems: list[str] = field(default_factory=list)
    max_hours: float = 0.0  # the budget it was judged against; 0: none
    pair_s: float | None = None  # online: extract and train together (they overlap); None: they add up
    store_line: str = ""  # the offline store's size beside the online spool's
    host: HostSpeed = field(default_factory=HostSpeed)  # the CPU rates' scale

    def refuse(self) -> "Plan":
        """Raise PreflightError naming every problem (and the table) when the run cannot finish; else self."""
        if self.problems:
            raise PreflightError("preflight: this run cannot finish:\n- " + "\n- ".join(self.problems) + "\n\n"
                                 + self.table())
        return self

    def total_seconds(self) -> float:
        """Wall time of every remaining stage: their sum, with online's extract and train counted as one pair."""
        if self.pair_s is None:
            return sum(self.seconds.values())
        return sum(v for k, v in self.seconds.items() if k not in ("extract", "train")) + self.pair_s

    def table(self) -> str:
        lines = ["| stage | needs | estimate |", "|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r['stage']} | {r['what']} | {r['human']} |")
        return "\n".join(lines)

    def time_line(self) -> str:
        """Estimated wall time ~38m12s (prepare 0m05s, extract 14m24s, ...); budget 1h00m"""
        parts = ", ".join(f"{k} {hms(v)}" for k, v in self.seconds.items())
        if self.pair_s is not None:
            parts += f"; online, extract and train overlap: {hms(self.pair_s)} together"
        budget = f"budget {hms(self.max_hours * 3600)}" if self.max_hours else "no time budget"
        return f"estimated wall time ~{hms(self.total_seconds())} ({parts or 'every stage is done'}); {budget}"

    def markdown(self) -> str:
        """The preflight artifact: the time first, then the table and the verdict."""
        verdict = "\n".join(f"- **{x}**" for x in self.problems) or "Every remaining stage fits."
        return (f"# eagle3 preflight\n\n**{self.time_line()[0].upper()}{self.time_line()[1:]}.** CPU times come "
                f"from this project's measured rates, scaled by this host's speed; GPU times from rates measured on "
                f"H200 hosts.\n\n{self.host.line()}\n\n"
                f"~{self.tokens:,} tokens\n\n{self._store()}{self.table()}\n\n{verdict}\n")

    def _store(self) -> str:
        return f"Hidden states: {self.store_line}\n\n" if self.store_line else ""


def target_plan(cfg: PipelineConfig) -> TargetPlan:
    """The target's shape: from its config.json when the dir is here, else the config's `target:` plan."""
    if (Path(cfg.model) / "config.json").is_file():
        t = Target.open(cfg.model)
        c = t.text
        H, heads = t.hidden_size, int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        total, active = t.parameter_counts()
        return TargetPlan(hidden_size=H, num_hidden_layers=t.num_layers, vocab_size=t.vocab_rows,
                          intermediate_size=int(c["intermediate_size"]), num_attention_heads=heads,
                          num_key_value_heads=kv,
                          head_dim=MLA_DRAFT_HEAD_DIM if t.is_mla else int(c.get("head_dim") or H // heads),
                          num_parameters=total, active_parameters=active if active < total else None,
                          **{k: c.get(k) for k in MLA_WIDTHS if t.is_mla},
                          weight_bytes=4.0 if c.get("dtype", c.get("torch_dtype")) == "float32" else 2.0)
    if cfg.target is None:
        raise PreflightError(f"{cfg.model} is not on this machine; add a `target:` shape to the config to plan the run")
    return cfg.target


def prepared(cfg: PipelineConfig):
    """The prepare stage's manifest (PreparedData) once it ran, else None: its counts replace every estimate."""
    from eagle3.storage.manifests import PreparedData

    done = cfg.stage_dir("prepare")
    return PreparedData.read(done) if PreparedData.exists(done) else None


def expected_tokens(cfg: PipelineConfig) -> int:
    """Tokens the prepare stage writes: from its manifest if it ran, else scaled from a sample of the source run
    through prepare's own stream (`sampled`), else from ShareGPT's measured share and mean."""
    if (m := prepared(cfg)) is not None:
        return m.num_tokens
    if (s := sampled(cfg)) is not None:
        read, _, tokens, _ = s
        return int(expected_conversations(cfg) * tokens / read)
    p = cfg.prepare
    return int(expected_conversations(cfg) * SHAREGPT_KEPT * min(p.max_len, SHAREGPT_MEAN_TOKENS))


def kept_share(cfg: PipelineConfig) -> float:
    """The share of read records prepare keeps: its manifest's once it ran, the sample's, else ShareGPT's measured
    share."""
    if (m := prepared(cfg)) is not None:
        return m.records_kept / max(m.records_read, 1)
    s = sampled(cfg)
    return s[1] / s[0] if s is not None else SHAREGPT_KEPT


SAMPLE_RECORDS = 1000  # prepare's stream on a 2-core host: ~7 s for 1,000 ShareGPT records, ~2 s for the demo's 400


def sampled(cfg: PipelineConfig) -> tuple[int, int, int, float] | None:
    """(read, kept, tokens, seconds) of the first SAMPLE_RECORDS records prepare would read (eagle3.prepare.run.sample);
    None where the target or the source is not on this machine, or prepare would fail (prepare itself then
    says why), or where prepare has run (its manifest has the counts). Measured once per process and config."""
    if not (Path(cfg.model) / "config.json").is_file() or prepared(cfg) is not None:
        return None
    return _sample(str(cfg.model), cfg.prepare.model_dump_json(), cfg.trust_remote_code)


@functools.lru_cache(maxsize=8)
def _sample(model: str, prepare_json: str, trust_remote_code: bool) -> tuple[int, int, int, float] | None:
    from eagle3.config import PrepareConfig
    from eagle3.prepare.run import sample

    try:
        read, kept, tokens, seconds = sample(model, PrepareConfig.model_validate_json(prepare_json), SAMPLE_RECORDS,
                                             trust_remote_code)
    except Exception:  # noqa: BLE001 -- an estimate only: the prepare stage raises the same error, with its context
        return None
    return (read, kept, tokens, seconds) if read and kept else None


def expected_conversations(cfg: PipelineConfig) -> int:
    """Conversations prepare reads: the source's record count (JSONL lines), else ~4 KB each."""
    p = cfg.prepare
    if p.data == "sharegpt":
        n = SHAREGPT_RECORDS
    else:
        src = Path(p.data)
        if src.is_file() and src.suffix == ".jsonl":
            with open(src, "rb") as f:
                n = sum(1 for line in f if line.strip())
        else:  # JSON arrays, Parquet, datasets dirs: ~4 KB per ShareGPT conversation
            size = sum(f.stat().st_size for f in ([src] if src.is_file() else src.rglob("*") if src.exists() else []))
            n = max(1, size // 4_000)
    return min(n, p.limit) if p.limit else n


def val_samples(cfg: PipelineConfig) -> int:
    """Samples prepare will put in the validation split (or put there, once it ran)."""
    if (m := prepared(cfg)) is not None:
        return sum(x.num_samples for x in m.splits["val"])
    return max(cfg.prepare.min_val, int(expected_conversations(cfg) * kept_share(cfg) * cfg.prepare.val_fraction))


def val_share(cfg: PipelineConfig) -> float:
    """The validation split's share of the prepared samples."""
    return min(1.0, val_samples(cfg) / max(1.0, expected_conversations(cfg) * kept_share(cfg)))


def eval_turns(cfg: PipelineConfig) -> int:
    """Turns eval generates: MT-Bench's two per question, a JSONL file's lines, or the val split's samples."""
    e = cfg.eval
    if e.prompts == "mt-bench":
        return 2 * min(MTBENCH_QUESTIONS, e.limit or MTBENCH_QUESTIONS)
    src = Path(e.prompts)
    if src.is_file():
        with open(src, "rb") as f:
            n = sum(1 for line in f if line.strip())
    else:  # a prepared dir: its validation split
        n = val_samples(cfg)
    return min(n, e.limit) if e.limit else n


MLA_WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def draft_params(t: TargetPlan, draft_vocab: int, layer: str = "llama") -> int:
    """The draft's trained parameters: fc, the layer (Llama attention or MLA over the 2H input), MLP, lm_head, norms."""
    H, Hi, n = t.hidden_size, t.intermediate_size, t.num_attention_heads
    if layer == "mla":
        if t.kv_lora_rank is None or t.qk_nope_head_dim is None or t.qk_rope_head_dim is None or t.v_head_dim is None:
            raise PreflightError("train.draft_layer mla needs an MLA target (DeepSeek-V3, Kimi-K2.5) and its widths: "
                                 f"its config.json, or {', '.join(MLA_WIDTHS)} in the config's `target:` plan; use "
                                 "draft_layer llama for this target")
        qk = t.qk_nope_head_dim + t.qk_rope_head_dim
        q = 2 * H * t.q_lora_rank + t.q_lora_rank * n * qk if t.q_lora_rank else 2 * H * n * qk
        attn = (q + 2 * H * (t.kv_lora_rank + t.qk_rope_head_dim)
                + t.kv_lora_rank * n * (t.qk_nope_head_dim + t.v_head_dim) + n * t.v_head_dim * H)
    else:
        q, kv = n * t.head_dim, t.num_key_value_heads * t.head_dim
        attn = 2 * H * (q + 2 * kv) + q * H
    return 3 * H * H + attn + 3 * H * Hi + draft_vocab * H + 3 * H + 3 * H


def plan(cfg: PipelineConfig, free_bytes: int | None = None, free_mem: int | None = None,
         max_hours: float = 0.0, host: HostSpeed | None = None) -> Plan:
    """Estimate every stage not yet finished; list the problems (does not raise). `host`: this host's speed
    (`measure_host`); default: the reference host's rates."""
    t = target_plan(cfg)
    tokens = expected_tokens(cfg)
    vd = cfg.prepare.draft_vocab or min(32000, t.vocab_size)
    P = draft_params(t, vd, cfg.train.draft_layer)
    tc = cfg.train
    host = host or HostSpeed()
    pl = Plan(tokens=tokens, max_hours=max_hours, host=host)
    need = stage_disk(cfg, t, tokens, vd, P)
    free = disk_free(Path(cfg.run_dir)) if free_bytes is None else free_bytes
    pl.problems += disk_plan(pl, cfg, t, need, free)
    # CPU training memory (GPU memory is the trainer's, checked by torch at start)
    # saved for backward per token and TTT step: ~3 MLP-wide + ~14 H-wide fp32 rows (measured:
    # 308 MB for SmolLM2 at k=3, 2048 tokens); the loss keeps no [L, Vd] tensor, only the
    # targets' [L, Vd] and one chunk; two [V, H] fp32 copies (embedding, target head; one
    # when tied); params + grads + AdamW; ~0.35 GB of torch runtime. SmolLM2 k=3 Vd=8192 at
    # 2048 tokens: 1.2 GB estimated, 1.39 GB peak RSS measured (benchmarks/speed/train.py).
    act = (tc.ttt_steps * tc.pack_tokens * 4 * (3 * t.intermediate_size + 14 * t.hidden_size)
           + 2 * tc.pack_tokens * vd * 4 + 2 * t.vocab_size * t.hidden_size * 4 + P * 16 + int(0.35 * GIB))
    pl.rows.append({"stage": "train", "what": "activation memory per rank (estimate)", "bytes": act,
                    "human": human(act)})
    mem = free_mem if free_mem is not None else proc_bytes("/proc/meminfo", "MemAvailable")
    if mem and act * tc.nproc_per_node > mem and not _has_cuda():
        pl.problems.append(f"memory: training needs about {human(act * tc.nproc_per_node)} "
                           f"({tc.nproc_per_node} process(es)), {human(mem)} is available; lower train.pack_tokens, "
                           f"train.ttt_steps or the draft vocab")
    if cfg.eval.backend == "hf" and cfg.eval.mode == "replay" and not _has_cuda():
        pl.problems += eval_memory(pl, cfg, t, mem)
    if cfg.eval.backend == "vllm" and t.kv_lora_rank and tc.draft_layer == "llama" and not _has_cuda():
        pl.problems.append("eval: vLLM's CPU engine cannot serve a Llama-layer draft beside this MLA target (their KV "
                           "blocks have no common size there); set train.draft_layer: mla, or eval.backend: hf")
    gpus = cfg.extract.tensor_parallel_size * cfg.extract.pipeline_parallel_size
    active = t.active_parameters or t.num_parameters
    if cfg.extract.backend == "vllm":
        ex_s = 2 * active * tokens / (gpus * GPU_EXTRACT_FLOPS["moe" if t.active_parameters else "dense"])
    else:
        ex_s = tokens / EXTRACT_CPU_TOK_PER_S * (active / SMOLLM2_PARAMS) / host.forward
    pd = P - vd * t.hidden_size - 3 * t.hidden_size * t.hidden_size  # one TTT step's layer weights
    tr_flops = (6 * (pd + vd * t.hidden_size) * tc.ttt_steps * tokens * tc.epochs
                + 2 * t.vocab_size * t.hidden_size * tokens * tc.epochs)
    # CPU: measured SmolLM2 rates, scaled by the draft's size and the unroll
    r1, r2 = TRAIN_CPU_TOK_PER_S
    vals = tc.epochs + tc.epochs * estimated_steps_per_epoch(cfg, tokens) // tc.val_every
    cpu_s = ((tokens / r1 + tokens * (tc.epochs - 1) / r2 + vals * tokens * val_share(cfg) * 0.5 / r2)
             * (P / 10e6) * (tc.ttt_steps / 3) + TRAIN_CPU_START_S)
    tr_s = tr_flops / (tc.world * GPU_TRAIN_FLOPS) if cfg.extract.backend == "vllm" else cpu_s / host.train
    tr_s *= steps_share(cfg, tokens)  # max_steps may end training before train.epochs
    epochs = epochs_read(cfg, tokens) if cfg.mode == "online" else 1  # online: extraction runs once per epoch
    ex_s *= worker_share(cfg, t, tokens)
    pl.seconds = stage_seconds(cfg, t, tokens, ex_s * epochs, tr_s, host)
    if cfg.extract.workers > 1:
        pl.rows.append({"stage": "extract", "what": f"over {cfg.extract.workers} workers: the largest range's share of "
                        "the tokens", "bytes": 0, "human": f"{worker_share(cfg, t, tokens):.3f}"})
    pl.rows += [{"stage": k, "what": "wall time (estimate)", "bytes": 0, "human": hms(v)}
                for k, v in pl.seconds.items()]
    if cfg.mode == "online" and {"extract", "train"} <= pl.seconds.keys():
        pl.pair_s = online_pair_seconds(cfg, pl.seconds, offline_store_bytes(cfg, t, tokens),
                                        spool_val_bytes(cfg, t, tokens), epochs)
        pl.rows.append({"stage": "extract + train", "what": f"wall time together (online, {epochs} epoch(s) "
                        "of extraction beside the trainer)", "bytes": 0, "human": hms(pl.pair_s)})
    total = pl.total_seconds()
    if max_hours and total > max_hours * 3600:
        big = ", ".join(f"{k} {hms(v)}" for k, v in sorted(pl.seconds.items(), key=lambda kv: -kv[1])[:2])
        pl.problems.append(
            f"time: about {hms(total)} ({big}) is over max_hours = {max_hours:g} ({hms(max_hours * 3600)}). "
            f"Options: raise max_hours in the run form (0: no limit), or fewer tokens (prepare.limit, "
            f"prepare.max_len) or fewer epochs (train.epochs, train.max_steps)")
    if cfg.extract.backend == "vllm":
        per_gpu = (t.num_parameters * t.weight_bytes
                   / (cfg.extract.tensor_parallel_size * cfg.extract.pipeline_parallel_size))
        budget = cfg.gpu_memory_gib * GIB * cfg.extract.gpu_memory_utilization
        pl.rows.append({"stage": "extract", "what": "GPU weights per device / budget", "bytes": per_gpu,
                        "human": f"{human(per_gpu)} / {human(budget)}"})
        if per_gpu > 0.9 * budget:
            pl.problems.append(f"GPU memory: {human(per_gpu)} of weights per GPU leaves no KV cache within "
                               f"{human(budget)}; raise tensor_parallel_size or pipeline_parallel_size")
    return pl


def worker_share(cfg: PipelineConfig, t: TargetPlan, tokens: int) -> float:
    """The share of one host's extraction time that `extract.workers` hosts take together: the largest range's
    share of the tokens. Ranges are cut at shard boundaries (offline: a range is at most one shard over an even
    cut); online, producers take whole windows in turn. Each range runs at the one-host rate, on its own host."""
    from eagle3.storage.store import bytes_per_token

    n = cfg.extract.workers
    if n == 1 or not tokens:
        return 1.0
    if cfg.mode == "online":
        return 1.0 / n
    shard = cfg.extract.shard_bytes / bytes_per_token(3, t.hidden_size, cfg.extract.storage)  # tokens per shard
    return min(1.0, 1.0 / n + shard / tokens)


def offline_store_bytes(cfg: PipelineConfig, t: TargetPlan, tokens: int) -> float:
    """The full hidden-state store offline extraction writes."""
    from eagle3.storage.store import bytes_per_token

    return tokens * bytes_per_token(3, t.hidden_size, cfg.extract.storage)


def spool_val_bytes(cfg: PipelineConfig, t: TargetPlan, tokens: int) -> float:
    """The validation shard a spool keeps for the whole run: the val split, capped at train.val_max_packs packs."""
    val = tokens * val_share(cfg)
    if cfg.train.val_max_packs:
        val = min(val, cfg.train.val_max_packs * cfg.train.pack_tokens)
    return offline_store_bytes(cfg, t, int(val))


def spool_floor(cfg: PipelineConfig, t: TargetPlan, tokens: int) -> float:
    """The smallest spool in which the producer can write one optimizer step's samples while the trainer reads
    the step before: the validation shard plus two steps. A step reads nproc x grad_accum packs, each of at
    most max(pack_tokens, max_len) stored tokens (samples are stored whole; the trainer cuts them)."""
    tc = cfg.train
    step = tc.world * tc.grad_accum * max(tc.pack_tokens, cfg.prepare.max_len)
    return spool_val_bytes(cfg, t, tokens) + 2 * offline_store_bytes(cfg, t, step)


def stage_disk(cfg: PipelineConfig, t: TargetPlan, tokens: int, vd: int, P: int) -> dict[str, float]:
    """Bytes each stage not yet finished writes, offline (extract: the whole store)."""
    from eagle3.storage.manifests import HiddenStates, PreparedData, TrainedDraft, VerifierWeights

    tc = cfg.train
    need: dict[str, float] = {}
    if not PreparedData.exists(cfg.stage_dir("prepare")):
        need["prepare"] = tokens * 5
    if not HiddenStates.exists(cfg.stage_dir("extract")):
        need["extract"] = offline_store_bytes(cfg, t, tokens)
    if not VerifierWeights.exists(cfg.stage_dir("verifier")):
        need["verifier"] = (2 * t.vocab_size + vd) * t.hidden_size * t.weight_bytes
    if not TrainedDraft.exists(cfg.stage_dir("train")):
        need["train"] = P * 12 * (tc.keep_last + 2) + P * 4
    return need


def disk_plan(pl: Plan, cfg: PipelineConfig, t: TargetPlan, need: dict[str, float], free: int) -> list[str]:
    """Add the disk rows of the mode in use (online: extract needs the spool's cap, not the store), the offline
    store beside the spool, the total against `free`; return the disk problems."""
    # the spool online needs: the cap, or the floor rounded up to whole MiB where the cap is below it
    spool = max(cfg.spool_bytes, -(-spool_floor(cfg, t, pl.tokens) // (1 << 20)) * (1 << 20))
    online = {**need, "extract": cfg.spool_bytes} if "extract" in need else need
    used = online if cfg.mode == "online" else need
    for stage, b in used.items():
        pl.rows.append({"stage": stage, "what": "disk", "bytes": b, "human": human(b)})
    if "extract" in need:
        pl.store_line = f"{human(need['extract'])} offline store / {human(cfg.spool_bytes)} spool ({cfg.mode})"
        pl.rows.append({"stage": "extract", "what": "offline store vs online spool", "bytes": need["extract"],
                        "human": pl.store_line})
    total = sum(used.values()) * HEADROOM
    pl.rows.append({"stage": "all", "what": f"disk (x{HEADROOM} headroom) / free", "bytes": total,
                    "human": f"{human(total)} / {human(free)}"})
    problems = [] if total <= free else [disk_problem(cfg, t, total, free, spool, need)]
    if cfg.mode == "online" and "extract" in need and cfg.spool_bytes < spool:
        problems.append(f"spool: spool_bytes = {human(cfg.spool_bytes)} cannot hold the validation shard plus two "
                        f"optimizer steps' samples ({human(spool)}); raise spool_bytes, or lower train.val_max_packs, "
                        f"train.pack_tokens or train.grad_accum")
    return problems


def disk_problem(cfg: PipelineConfig, t: TargetPlan, total: float, free: int, spool: float,
                 need: dict[str, float]) -> str:
    """Why the remaining stages do not fit `free`, and the options: online first when it would fit."""
    from eagle3.storage.store import bytes_per_token

    head = (f"disk: the remaining stages need about {human(total)} under {cfg.run_dir}, but only {human(free)} is "
            f"free. Options: ")
    if cfg.mode == "online":
        return head + (f"lower spool_bytes (now {human(cfg.spool_bytes)}; the producer waits while the spool is "
                       f"full), fewer checkpoints (train.keep_last), or another run_dir")
    online = (sum(need.values()) - need["extract"] + spool) * HEADROOM if "extract" in need else total
    first = (f"mode: online with spool_bytes: {int(spool)} ({human(spool)}; about {human(online)} in all: "
             f"no {human(need['extract'])} store is written, extraction runs again each epoch), "
             if online <= free else "")
    ratio = bytes_per_token(3, t.hidden_size, "fp8") / bytes_per_token(3, t.hidden_size, cfg.extract.storage)
    return head + first + (f"storage 'fp8' (~{ratio:.0%} of '{cfg.extract.storage}') or 'fp8-aux', fewer samples "
                           f"(prepare.limit / max_len), or another run_dir")


def estimated_steps_per_epoch(cfg: PipelineConfig, tokens: int) -> int:
    """Optimizer steps of one epoch. Packs are counted as train tokens / pack_tokens; greedy packing leaves gaps,
    so there are more and this errs low."""
    tc = cfg.train
    packs = max(1, -(-int(tokens * (1 - val_share(cfg))) // tc.pack_tokens))
    return -(-packs // (tc.world * tc.grad_accum))


def epochs_read(cfg: PipelineConfig, tokens: int) -> int:
    """Epochs of train data the trainer reads: train.epochs, or max_steps over the steps of one epoch."""
    tc = cfg.train
    return -(-tc.max_steps // estimated_steps_per_epoch(cfg, tokens)) if tc.max_steps else tc.epochs


def steps_share(cfg: PipelineConfig, tokens: int) -> float:
    """The share of train.epochs' steps the trainer takes: below 1 where max_steps ends it earlier."""
    tc = cfg.train
    full = tc.epochs * estimated_steps_per_epoch(cfg, tokens)
    return min(1.0, tc.max_steps / full) if tc.max_steps else 1.0


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
    size = (t.active_parameters or t.num_parameters) / SMOLLM2_PARAMS  # CPU rates scale with the target's size
    vd = cfg.prepare.draft_vocab or min(DEFAULT_DRAFT_VOCAB, t.vocab_size)
    turns, new = eval_turns(cfg), cfg.eval.max_new_tokens
    if cfg.eval.backend == "vllm":  # two engines (target alone, speculative), each starts and decodes
        ev_s = 2 * VLLM_START_S + 2 * turns * new / VLLM_DECODE_TOK_PER_S
    elif cfg.eval.mode == "replay":  # cached greedy answers (batched), one forward for the aux states, a live check
        ev_s = EVAL_CPU_START_S / host.decode + replay_seconds(turns, new, host) * size
        ev_s += 2 * min(cfg.eval.live_check, turns // 2 or 1) * (cfg.eval.live_max_new_tokens or new) * 2 \
            / (EVAL_CPU_TOK_PER_S * host.decode) * size if cfg.eval.live_check else 0
    else:  # speculative and plain greedy decoding of every turn, one sequence at a time
        ev_s = turns * new * 2 / (EVAL_CPU_TOK_PER_S * host.decode) * size
    if cfg.extract.backend != "vllm" and cfg.train.replay_prompts:  # the replay set, built before training
        n = min(cfg.train.replay_prompts, val_samples(cfg))
        tr_s += (REPLAY_SET_CPU_START_S + n * REPLAY_SET_CPU_S_PER_PROMPT
                 + cfg.train.replay_max_new_tokens / REPLAY_SET_CPU_STEPS_PER_S) / host.decode * size
    done = {"prepare": PreparedData, "extract": HiddenStates, "verifier": VerifierWeights, "train": TrainedDraft,
            "eval": EvalReport}
    s = sampled(cfg)  # prepare's own stream timed on a sample of the source, where there is one
    prep = s[3] * expected_conversations(cfg) / s[0] if s else 5 + expected_conversations(cfg) / PREPARE_CONV_PER_S
    est = {"prepare": prep, "extract": ex_s,
           "verifier": 0.7 + (2 * t.vocab_size + vd) * t.hidden_size * t.weight_bytes / 500e6, "train": tr_s,
           "eval": ev_s}
    out = {k: v for k, v in est.items() if not done[k].exists(cfg.stage_dir(k))}
    r = cfg.regenerate
    if r is not None:  # an upper bound: every assistant turn (~3 per conversation) at max_new_tokens
        n = min(expected_conversations(cfg), r.limit) if r.limit else expected_conversations(cfg)
        rate = VLLM_DECODE_TOK_PER_S if r.backend == "vllm" else REGEN_CPU_TOK_PER_S * host.decode / size
        out = {"regenerate": n * 3 * r.max_new_tokens / rate, **out}
    return out


def replay_seconds(turns: int, new: int, host: HostSpeed | None = None) -> float:
    """Replay's cache for a SmolLM2-sized target at the measured 2-thread rates (times this host's speed):
    `turns` greedy answers of up to `new` tokens (batched decoding), then one forward over prompts + answers
    (~2 x the answer tokens)."""
    host = host or HostSpeed()
    return (turns * new / (REPLAY_CPU_DECODE_TOK_PER_S * host.decode)
            + 2 * turns * new / (REPLAY_CPU_FORWARD_TOK_PER_S * host.forward))


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
    pl.rows.append({"stage": "eval", "what": f"memory of the replay answers, {rows} rows at once (estimate)",
                    "bytes": need, "human": human(need)})
    if not mem or need <= mem:
        return []
    fit = int((0.9 * mem - weights - 0.5 * GIB) // row)
    if fit >= min(ANSWER_FLOOR_ROWS, rows):
        pl.rows.append({"stage": "eval", "what": "the answers decode in smaller batches to fit MemAvailable",
                        "bytes": 0, "human": f"{fit} rows at once"})
        return []
    return [f"memory: the eval's replay answers need about {human(weights + ANSWER_FLOOR_ROWS * row)} for "
            f"{ANSWER_FLOOR_ROWS} rows at once, {human(mem)} is available; lower eval.max_new_tokens or eval.limit, "
            f"use eval.mode live, or free memory"]


PROBE_OVER_S = 120  # runs estimated shorter than this at the reference rates are not worth a probe's seconds


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


def check(cfg: PipelineConfig, **kw) -> Plan:
    """`plan`, raising PreflightError with every problem when the run cannot finish."""
    return plan(cfg, **kw).refuse()


def _has_cuda() -> bool:
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
