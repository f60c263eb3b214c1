"""Disk: what each stage not yet finished writes (offline: the whole hidden-state store; online: the spool's
cap, which must hold the validation shard plus two optimizer steps), the total with headroom against the free
space under run_dir, and the options when it does not fit (online first, where it would)."""
from __future__ import annotations

from eagle3.config import PipelineConfig, TargetPlan
from eagle3.planning.estimates import val_share
from eagle3.planning.rates import HEADROOM
from eagle3.planning.table import Plan
from eagle3.storage.space import human


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
        pl.row(stage, "disk", human(b), b)
    if "extract" in need:
        pl.store_line = f"{human(need['extract'])} offline store / {human(cfg.spool_bytes)} spool ({cfg.mode})"
        pl.row("extract", "offline store vs online spool", pl.store_line, need["extract"])
    total = sum(used.values()) * HEADROOM
    pl.row("all", f"disk (x{HEADROOM} headroom) / free", f"{human(total)} / {human(free)}", total)
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
