"""The training loop: read it top to bottom.

One optimizer step = `grad_accum` packed rows on each of `world` ranks. Each row runs k unrolled
TTT steps of the draft (`Eagle3Draft.ttt_states`) against targets computed on the fly from
the stored final hidden states through the verifier's norm + lm_head (`TargetHead`). The loss
of a row is the step-weighted mean forward KL (`ttt_loss_fused`); the step loss is the mean over the
step's rows, so 1 process x 2 rows and 2 processes x 1 row give the same gradients.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3.config import TrainConfig
from eagle3.decoding.chains import ReplaySet, replay_counts
from eagle3.model.draft import DraftConfig, Eagle3Draft
from eagle3.model.formats import export
from eagle3.runtime import heap
from eagle3.storage.atomic import append_text, atomic_write_text
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import HiddenStates, TrainedDraft, VerifierWeights
from eagle3.storage.store import open_store
from eagle3.train import checkpoint as ckpt
from eagle3.train import distributed as dist
from eagle3.train.data import collate, epoch_packs, micro_packs, steps_per_epoch
from eagle3.train.loss import TargetHead, TTTLossOutput, step_weights, ttt_loss_fused
from eagle3.train.metrics import Meter, TensorBoard, chain_acceptance, plot_curves

log = logging.getLogger("eagle3.train")
METRICS = "metrics.jsonl"
FINAL = "final"


class TTT(nn.Module):
    """The k unrolled steps and their loss as one module forward, so DDP/FSDP hooks see the whole
    training pass (the fused loss applies the draft's lm_head itself)."""

    def __init__(self, draft: Eagle3Draft, steps: int, block: int, weights: list[float], **loss_kw):
        super().__init__()  # loss_kw: ttt_loss_fused's loss, eta, topk, topk_weight (its defaults when absent)
        self.draft, self.steps, self.block, self.weights, self.loss_kw = draft, steps, block, weights, loss_kw

    def forward(self, input_ids, aux, position_ids, doc, loss_mask, target_logits, target_top) -> TTTLossOutput:
        states = self.draft.ttt_states(input_ids, aux, position_ids, self.steps, doc=doc, block=self.block)
        return ttt_loss_fused(states, self.draft.lm_head.weight, target_logits, target_top, loss_mask, doc,
                              self.weights, **self.loss_kw)


@dataclass
class Pos:
    """Where the run is: optimizer steps done overall, and the epoch / step within it."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0


def build_draft(cfg: TrainConfig, hidden: HiddenStates, verifier_dir: Path) -> Eagle3Draft:
    ver = VerifierWeights.read(verifier_dir)
    if ver.hidden_size != hidden.hidden_size:
        raise ValueError(f"verifier hidden size {ver.hidden_size} != stored hidden states' {hidden.hidden_size}: "
                         "the verifier and the extract stage come from different targets")
    dcfg = DraftConfig.from_target(
        hidden.model_dir, draft_vocab_size=ver.draft_vocab_size, aux_layer_ids=hidden.aux_layer_ids,
        norm_before_fc=cfg.norm_before_fc, norm_output=cfg.norm_output, norm_before_residual=cfg.norm_before_residual,
    )
    torch.manual_seed(cfg.seed)  # same init on every rank and every rerun
    draft = Eagle3Draft.from_verifier(dcfg, verifier_dir)
    if cfg.init_from:
        warm_start(draft, Path(cfg.init_from))
    return draft


def warm_start(draft: Eagle3Draft, src: Path) -> None:
    """Initialize from an exported draft (final/). The vocab map is never rebuilt: the source's d2t
    must equal the one this run trains with (prepare with `vocab_from` the promoted run)."""
    from safetensors.torch import load_file

    path = src / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"init_from: {path} does not exist (expected an exported draft dir, e.g. <train>/final)")
    w = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
         for k, v in load_file(str(path)).items()}
    if "d2t" not in w or not torch.equal(w["d2t"], draft.d2t):
        raise ValueError(f"init_from: {src} was trained with another draft vocab (d2t differs); a warm start keeps "
                         "the vocab map fixed: prepare with vocab_from=<the promoted run's prepare dir>")
    own = draft.state_dict()
    bad = [k for k, v in w.items() if k in own and own[k].shape != v.shape]
    if bad:
        raise ValueError(f"init_from: {src} has other shapes for {bad[:4]}: a draft of another config")
    missing = [k for k in own if k not in w and k not in ("embed_tokens.weight", "t2d")]
    if missing:
        raise ValueError(f"init_from: {src} lacks {missing[:4]} (norm_before_fc / norm_output settings differ?)")
    draft.load_state_dict({k: v for k, v in w.items() if k in own}, strict=False)


def lr_lambda(cfg: TrainConfig, total: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        t = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


class TopCache:
    """The target's full-vocab argmax per sample, computed once (it costs V/Vd times the draft-vocab
    logits): later epochs and repeated validations only compute the draft-vocab logits."""

    def __init__(self) -> None:
        self.top: dict[tuple[str, int], torch.Tensor] = {}

    def __call__(self, head: TargetHead, batch: dict[str, torch.Tensor], split: str, idx: list[int]):
        keys = [(split, i) for i in idx]
        if all(k in self.top for k in keys):
            logits, _ = head(batch["final"], top=False)
            return logits, torch.cat([self.top[k] for k in keys]).to(logits.device)[None]
        logits, top = head(batch["final"])
        lengths = torch.bincount(batch["doc"][0], minlength=len(idx)).tolist()
        for k, t in zip(keys, top[0].split(lengths), strict=True):
            self.top[k] = t.to("cpu", torch.int32)
        return logits, top


def row_pass(model: nn.Module, targets: tuple[torch.Tensor, torch.Tensor], batch: dict[str, torch.Tensor],
             amp) -> TTTLossOutput:
    """One packed row: k TTT steps and their loss.
    targets: (target logits [1, L, Vd] fp32, draft id of the target argmax [1, L]) from `TopCache`."""
    with amp:
        return model(batch["input_ids"], batch["aux"], batch["position_ids"], batch["doc"], batch["loss_mask"],
                     targets[0], targets[1].long())


def optimizer_step(params: list[nn.Parameter], opt: torch.optim.Optimizer, clip: float, sched=None) -> torch.Tensor:
    """Clip, step and zero the grads; returns the pre-clip gradient norm.

    The step's freed activations stay in the process heap for the next step (`eagle3.runtime.heap`, set up
    by `train`): handing them back to the OS each step and faulting them in again cost ~190k page
    faults per 2048-token step on CPU. Under EAGLE3_HEAP=release they are handed back here."""
    gnorm = torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad(set_to_none=True)
    if params and params[0].device.type == "cpu":
        heap.release()
    return gnorm


@torch.no_grad()
def validate(model, head, store, cfg: TrainConfig, world: dist.Dist, amp, cache: TopCache) -> dict[str, Any]:
    """Loss, per-step top-1 and simulated tau over the validation split (all ranks, summed)."""
    if store is None or len(store) == 0:
        return {}
    lengths = store.lengths
    packs = epoch_packs(lengths, cfg.seed, -1, cfg.pack_tokens)[: cfg.val_max_packs]
    m = Meter(cfg.ttt_steps)
    model.eval()
    for i in range(world.rank, len(packs), world.world):
        batch = collate(store, packs[i], cfg.pack_tokens, world.device)
        out = row_pass(model, cache(head, batch, "val", packs[i]), batch, amp)
        m.add(out, chain_acceptance(out), rows=1, tokens=batch["input_ids"].numel())
    model.train()
    return m.reduce(world)


def inputs(hidden_dir: str | Path, verifier_dir: str | Path, cfg: TrainConfig,
           replay: ReplaySet | None = None) -> dict[str, Any]:
    """What a trained draft depends on: the hidden states' and verifier's manifests, a warm start's weights,
    the config, and the replay set validation chose the best checkpoint by. The stage's "already done" check
    (and checkpoints' resume check) and the Prefect task's cache key are all this dict; the task keys without
    the replay set, which it builds from what the key holds (the target and the prepared data, both behind
    the hidden states, and cfg's replay fields)."""
    return {
        "hidden_states": HiddenStates.read(hidden_dir).fingerprint,
        "verifier": VerifierWeights.read(verifier_dir).fingerprint,
        "init_from": sha256_file(Path(cfg.init_from) / "model.safetensors") if cfg.init_from else None,
        "config": cfg.model_dump(mode="json"),
        **({"replay": replay.fingerprint} if replay is not None else {}),
    }


def replay_validate(draft: Eagle3Draft, rs: ReplaySet, k: int, d: dist.Dist, amp, gather) -> dict[str, Any]:
    """Replay tau of the draft on a replay set (eagle3/decoding/chains.py): every rank replays its share of the
    turns, the counts are summed. `gather`: a context giving the draft its full parameters (FSDP)."""
    mine = range(d.rank, len(rs.turns), d.world)
    was = draft.training
    draft.eval()
    with torch.no_grad(), amp, gather:
        c = replay_counts(draft, [rs.turns[i] for i in mine], [rs.aux[i] for i in mine], k, rs.max_new, rs.stop_ids)
    draft.train(was)
    c = dist.all_sum(c, d)
    n = max(c[1], 1.0)
    return {"replay_tau": 1.0 + c[0] / n, "replay_per_position_acceptance": [x / n for x in c[2:]],
            "replay_rounds": int(c[1])}


def train(cfg: TrainConfig, hidden_dir: str | Path, verifier_dir: str | Path, out: str | Path,
          verifier_name: str = "", progress: bool = True, restart_on_mismatch: bool = False,
          replay: str | Path | None = None) -> TrainedDraft | None:
    """Train (or resume) a draft; rank 0 returns the manifest of `out`, other ranks None.

    Checkpoints in `out` from another config or other inputs are an error, or, with
    `restart_on_mismatch` (the pipeline's choice: its stage dir follows its inputs), are cleared.
    `replay`: a replay set dir (`eagle3 replay-set`); with `cfg.replay_prompts` > 0
    each validation reports its replay tau, and the best checkpoint is chosen by it.
    """
    hidden_dir, verifier_dir, out = Path(hidden_dir), Path(verifier_dir), Path(out)
    world = dist.init()
    heap.retain_freed_memory()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.fsdp and world.device.type != "cuda":
        raise ValueError("--fsdp needs CUDA; on CPU the trainer uses DDP")
    hidden = HiddenStates.read(hidden_dir)
    ver = VerifierWeights.read(verifier_dir)
    rs = None
    if replay is not None and cfg.replay_prompts:
        rs = ReplaySet.load(replay, hidden.aux_layer_ids)
        if rs.model_fingerprint != hidden.model_fingerprint:
            raise ValueError(f"replay set {replay} was built from another target than the hidden states in "
                             f"{hidden_dir}")
    elif cfg.replay_prompts and world.main:
        log.info("train: no replay set given (--replay): validation reports simulated tau only")
    fp = inputs(hidden_dir, verifier_dir, cfg, rs)
    config = cfg.model_dump(mode="json")
    if world.main and TrainedDraft.exists(out):
        done = TrainedDraft.read(out)
        if done.inputs == fp and (out / FINAL / "config.json").is_file():
            log.info("train: %s already holds this exact result; nothing to do", out)
            dist.shutdown()
            return done

    draft = build_draft(cfg, hidden, verifier_dir).to(world.device)
    # A tied target (SmolLM2, Llama-3.2-1B, ...): the head's lm_head *is* the draft's frozen
    # embedding, one [V, H] fp32 copy instead of two (113 MB for SmolLM2). FSDP shards the
    # embedding, so there the head keeps its own.
    shared = draft.embed_tokens.weight.detach() if ver.tied_embeddings and not cfg.fsdp else None
    head = TargetHead.from_verifier(verifier_dir, lm_head=shared).to(world.device)
    train_store = open_store(hidden_dir, "train")
    val_store = open_store(hidden_dir, "val") if hidden.splits.get("val", {}).get("num_samples") else None
    lengths = train_store.lengths
    n_packs = len(epoch_packs(lengths, cfg.seed, 0, cfg.pack_tokens))
    spe = steps_per_epoch(n_packs, world.world, cfg.grad_accum)
    total = cfg.max_steps or cfg.epochs * spe
    weights = step_weights(cfg.ttt_steps, cfg.step_decay)

    pos, best = Pos(), {"tau": -1.0, "step": -1}
    last_val = -1  # step of the latest validation: a checkpoint is saved before its step's epoch-end validation

    # ---- resume: model, optimizer, scheduler, data position, RNG
    last = ckpt.latest(out)
    if last is not None:
        state_dict, state, meta = ckpt.load(last)
        if meta.get("config") != config or meta.get("inputs") != fp:
            if not restart_on_mismatch:
                raise ValueError(f"{last}: checkpoint of a different config or different inputs; "
                                 f"use a new --out dir (or delete {out / ckpt.CKPT_DIR})")
            dist.barrier()
            if world.main:
                log.warning("train: %s holds a run of another config or other inputs; starting over", out)
                ckpt.clear(out, [METRICS, FINAL, "manifest.json", "curves.png"])
            dist.barrier()
            last = None
    if last is not None:
        draft.load_state_dict(state_dict)  # before wrapping: FSDP2 then shards the loaded weights
    model = dist.wrap(TTT(draft, cfg.ttt_steps, cfg.attn_block, weights, loss=cfg.loss, eta=cfg.lk_eta, topk=cfg.topk,
                         topk_weight=cfg.topk_weight), world, cfg.fsdp)
    # The optimizer is built on the wrapped model's parameters (FSDP2 replaces them with shards).
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    if last is not None:
        dist.load_optimizer_state(model, opt, state["optimizer"], cfg.fsdp)
        sched.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        pos, best = Pos(**state["pos"]), state["best"]
        last_val = state.get("last_val", -1)
        if world.main:
            log.info("train: resumed from %s (step %d, epoch %d, epoch step %d)", last.name, pos.step, pos.epoch,
                     pos.epoch_step)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if world.device.type == "cuda" else nullcontext()
    metrics_path = out / METRICS
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(metrics_path, pos.step, last_val)
    tb = TensorBoard(out, world.main)

    def emit(rec: dict[str, Any]) -> None:
        _log_metrics(metrics_path, rec)
        tb.log(rec)

    def save(tag: str) -> None:
        sd = dist.full_state_dict(model if cfg.fsdp else draft)
        sd = {k.removeprefix("draft."): v for k, v in sd.items()}
        osd = dist.optimizer_state(model, opt, cfg.fsdp)  # collective under FSDP: every rank calls it
        if world.main:
            state = {"optimizer": osd, "scheduler": sched.state_dict(), "rng": ckpt.rng_state(),
                     "pos": pos.__dict__.copy(), "best": dict(best), "last_val": last_val}
            ckpt.save(out, tag, sd, state, {"config": config, "inputs": fp, "step": pos.step})
            if tag.startswith("step-"):
                ckpt.prune(out, cfg.keep_last)
        dist.barrier()

    tops = TopCache()

    def run_validation() -> None:
        nonlocal best, last_val
        last_val = pos.step
        v = validate(model, head, val_store, cfg, world, amp, tops)
        if rs is not None:
            v.update(replay_validate(draft, rs, cfg.replay_k, world, amp, dist.gathered(model, cfg.fsdp)))
        metric = "replay_tau" if "replay_tau" in v else "sim_tau"
        if metric not in v:
            return
        if world.main:
            emit({"split": "val", "step": pos.step, "epoch": pos.epoch, **v})
            log.info("val step %d: loss %.4f acc %s sim tau %.3f%s", pos.step, v.get("loss", float("nan")),
                     [round(a, 3) for a in v.get("acc", [])], v.get("sim_tau", float("nan")),
                     f" replay tau {v['replay_tau']:.3f} (k={cfg.replay_k})" if "replay_tau" in v else "")
        if v[metric] > best["tau"]:
            best = {"tau": v[metric], "step": pos.step, "metric": metric, "sim_tau": v.get("sim_tau"),
                    "replay_tau": v.get("replay_tau")}
            save(ckpt.BEST)

    from tqdm.auto import tqdm

    # A bar on a terminal; under torchrun-in-Prefect (no TTY) one log line per log step instead.
    tty = sys.stderr.isatty()
    bar = tqdm(total=total, initial=pos.step, unit="step", desc="train", disable=not (progress and world.main and tty),
               dynamic_ncols=True, mininterval=2.0)
    t_start, step_start = time.perf_counter(), pos.step
    window = Meter(cfg.ttt_steps)
    t_win = time.perf_counter()
    model.train()
    while pos.step < total:
        packs = epoch_packs(lengths, cfg.seed, pos.epoch, cfg.pack_tokens)
        while pos.epoch_step < spe and pos.step < total:
            rows = micro_packs(packs, pos.epoch_step, world.rank, world.world, cfg.grad_accum)
            for a, idx in enumerate(rows):
                batch = collate(train_store, idx, cfg.pack_tokens, world.device)
                sync = a == len(rows) - 1 or not hasattr(model, "no_sync")
                with (nullcontext() if sync else model.no_sync()):
                    out_ = row_pass(model, tops(head, batch, "train", idx), batch, amp)
                    (out_.loss / cfg.grad_accum).backward()
                window.add(out_, None, rows=1, tokens=batch["input_ids"].numel())
            gnorm = optimizer_step(params, opt, cfg.grad_clip, sched)
            pos.step += 1
            pos.epoch_step += 1
            bar.update(1)
            if pos.step % cfg.log_every == 0 or pos.step == total:
                w = window.reduce(world)
                dt = time.perf_counter() - t_win
                rec = {"split": "train", "step": pos.step, "epoch": pos.epoch, "lr": sched.get_last_lr()[0],
                       "grad_norm": float(gnorm), "tokens_per_s": w["tokens"] / max(dt, 1e-9), **w}
                if world.main:
                    emit(rec)
                    bar.set_postfix_str(f"loss {w['loss']:.3f} acc0 {w['acc'][0]:.3f} {rec['tokens_per_s']:,.0f} tok/s")
                    if not tty:
                        rate = (pos.step - step_start) / max(time.perf_counter() - t_start, 1e-9)
                        log.info("train step %d/%d  loss %.4f  acc %s  %.0f tok/s  ETA %s", pos.step, total, w["loss"],
                                 [round(x, 3) for x in w["acc"]], rec["tokens_per_s"],
                                 _eta((total - pos.step) / max(rate, 1e-9)))
                window, t_win = Meter(cfg.ttt_steps), time.perf_counter()
            if pos.step % cfg.val_every == 0:
                run_validation()
            if pos.step % cfg.ckpt_every == 0 and pos.step < total:
                save(f"step-{pos.step:08d}")
        if pos.epoch_step >= spe:  # epoch end
            if last_val != pos.step:
                run_validation()
            pos.epoch, pos.epoch_step = pos.epoch + 1, 0
    bar.close()
    if last_val != pos.step:
        run_validation()  # a run that stopped mid-epoch on max_steps, or a resumed finished run
    save(f"step-{pos.step:08d}")
    tb.close()

    result = None
    if world.main:
        src = out / ckpt.CKPT_DIR / ckpt.BEST if (out / ckpt.CKPT_DIR / ckpt.BEST).is_dir() else last_step_dir(out)
        state_dict, _, meta = ckpt.load(src)
        export(state_dict, draft.config, cfg.ttt_steps, out / FINAL, cfg.export_format,
               verifier=verifier_name or hidden.model_dir,
               extra={"best_step": best["step"], "best_metric": best.get("metric", "sim_tau"),
                      "sim_tau": best.get("sim_tau", best["tau"]), "replay_tau": best.get("replay_tau"),
                      "train_config": config})
        plot_curves(metrics_path, out / "curves.png")
        result = TrainedDraft(
            config=config, inputs=fp, final_dir=FINAL, export_format=cfg.export_format,
            steps=pos.step, best_step=best["step"], best_metric=best.get("metric", "sim_tau"),
            best_sim_tau=best["sim_tau"] if best.get("sim_tau") is not None
            else (best["tau"] if best.get("metric", "sim_tau") == "sim_tau" else 0.0),
            best_replay_tau=best.get("replay_tau"),
            val=_last_val(metrics_path), draft_config=draft.config.model_dump(mode="json"),
            weights_sha256=sha256_file(out / FINAL / "model.safetensors"),
        )
        result.write(out)
        log.info("train: done, %d steps; best %s %.3f at step %d; exported %s", pos.step,
                 best.get("metric", "sim_tau").replace("_", " "), best["tau"], best["step"], out / FINAL)
    dist.shutdown()
    return result


def _eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


def last_step_dir(out: Path) -> Path:
    d = ckpt.latest(out)
    if d is None:
        raise RuntimeError(f"{out}: no valid checkpoint to export")
    return d


def _log_metrics(path: Path, rec: dict[str, Any]) -> None:
    append_text(path, json.dumps(rec) + "\n")


def _truncate_metrics(path: Path, step: int, last_val: int) -> None:
    """On resume, drop records logged after the checkpoint: they will be logged again. That
    includes a validation at the checkpoint's own step that ran after the save (an epoch end)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if lines:
        try:
            json.loads(lines[-1])
        except ValueError:  # an append torn by a kill or a full disk: that record is logged again
            lines.pop()
    recs = [(ln, json.loads(ln)) for ln in lines]
    keep = [ln for ln, r in recs if r["step"] <= (last_val if r["split"] == "val" else step)]
    atomic_write_text(path, "".join(ln + "\n" for ln in keep))


def _last_val(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    vals = [json.loads(ln) for ln in path.read_text().splitlines() if '"split": "val"' in ln]
    return vals[-1] if vals else {}
