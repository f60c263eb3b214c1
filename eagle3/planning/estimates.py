"""Estimates of a run's size before it runs: the target's shape, the tokens and samples prepare writes (its
manifest once it ran, else a timed sample of the source run through prepare's own stream, else ShareGPT's
measured share and mean), the draft's parameters, and the steps the trainer takes."""
from __future__ import annotations

import functools
from pathlib import Path

from eagle3.config import PipelineConfig, TargetPlan
from eagle3.model.target import MLA_DRAFT_HEAD_DIM, Target
from eagle3.planning.rates import (
    MTBENCH_QUESTIONS,
    SAMPLE_RECORDS,
    SHAREGPT_KEPT,
    SHAREGPT_MEAN_TOKENS,
    SHAREGPT_RECORDS,
)
from eagle3.storage.space import PreflightError

MLA_WIDTHS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


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
    """The steps the trainer takes over train.epochs' steps. As in the trainer, max_steps overrides epochs either
    way: below 1 where it ends training early, above 1 where it reads the data more often than `epochs` says."""
    tc = cfg.train
    full = tc.epochs * estimated_steps_per_epoch(cfg, tokens)
    return tc.max_steps / full if tc.max_steps else 1.0



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
