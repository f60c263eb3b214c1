"""The training loop: read it top to bottom.

One optimizer step = `grad_accum` packed rows on each of `world` ranks. Each row runs k unrolled
TTT steps of the draft (`Eagle3Draft.ttt_states`) against targets computed on the fly from
the stored final hidden states through the verifier's norm + lm_head (`TargetHead`). The loss
of a row is the step-weighted mean forward KL (`ttt_loss_fused`); the step loss is the mean over the
step's rows, so 1 process x 2 rows and 2 processes x 1 row give the same gradients.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3.config import SPOOL_WAIT_S, TrainConfig
from eagle3.decoding.chains import ReplaySet
from eagle3.model.draft import Eagle3Draft
from eagle3.model.formats import export
from eagle3.runtime import floats, heap
from eagle3.runtime.progress import Meter, silent
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import HiddenStates, TrainedDraft, VerifierWeights
from eagle3.train import checkpoint as ckpt
from eagle3.train import distributed as dist
from eagle3.train import optim
from eagle3.train.build import build_draft
from eagle3.train.data import collate, epoch_packs, micro_packs, steps_per_epoch
from eagle3.train.loss import TargetHead, TTTLossOutput, step_weights, ttt_loss_fused
from eagle3.train.metrics import (
    LossSums,
    TensorBoard,
    append_record,
    last_val_record,
    plot_curves,
    truncate_records,
)
from eagle3.train.source import Source, source
from eagle3.train.validate import TopCache, load_replay, replay_validate, row_pass, validate

log = logging.getLogger("eagle3.train")
METRICS = "metrics.jsonl"
FINAL = "final"


class TTT(nn.Module):
    """The k unrolled steps and their loss as one module forward, so DDP/FSDP hooks see the whole
    training pass (the fused loss applies the draft's lm_head itself)."""

    def __init__(self, draft: Eagle3Draft, steps: int, block: int, weights: list[float], **loss_kw):
        super().__init__()  # loss_kw: ttt_loss_fused's loss, eta, topk, topk_weight (its defaults when absent)
        self.draft, self.steps, self.block, self.weights, self.loss_kw = draft, steps, block, weights, loss_kw

    def forward(self, input_ids, aux, position_ids, doc, loss_mask, target_logits,
                target_top) -> tuple[torch.Tensor, TTTLossOutput]:
        """(loss, the whole output). The loss tensor travels bare beside the dataclass: FSDP2 registers its
        gradient reduction on the forward's output tensors, and torch before 2.13 looks for them with
        `tree_flatten`, which does not open a dataclass. With the loss hidden inside one, FSDP2 on torch 2.11
        never reduced a gradient and the optimizer never moved (seen on a GPU: the same loss at every step)."""
        states = self.draft.ttt_states(input_ids, aux, position_ids, self.steps, doc=doc, block=self.block)
        out = ttt_loss_fused(states, self.draft.lm_head.weight, target_logits, target_top, loss_mask, doc,
                             self.weights, **self.loss_kw)
        return out.loss, out


@dataclass
class Pos:
    """Where the run is: optimizer steps done overall, and the epoch / step within it."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0


@dataclass
class Best:
    """The best validation so far, saved in every checkpoint: its value of `metric` (replay tau with a replay
    set, else simulated tau; -1 before the first validation), its step, and both taus as it measured them."""

    tau: float = -1.0
    step: int = -1
    metric: str = "sim_tau"
    sim_tau: float | None = None
    replay_tau: float | None = None

    def sim_tau_or_tau(self) -> float:
        """Simulated tau at the best step; where it was not measured, the best value when that is simulated tau,
        else 0."""
        if self.sim_tau is not None:
            return self.sim_tau
        return self.tau if self.metric == "sim_tau" else 0.0


def inputs(data: Source, verifier_dir: str | Path, cfg: TrainConfig, replay: ReplaySet | None = None) -> dict[str, Any]:
    """What a trained draft depends on: the hidden states' and verifier's manifests, a warm start's weights,
    the config, and the replay set validation chose the best checkpoint by. The stage's "already done" check
    (and checkpoints' resume check) and the Prefect task's cache key are all this dict; the task keys without
    the replay set, which it builds from what the key holds (the target and the prepared data, both behind
    the hidden states, and cfg's replay fields). Online, the hidden states are named by the spool's source.json
    (`Spooled.fingerprint`)."""
    return {
        "hidden_states": data.fingerprint(),
        "verifier": VerifierWeights.read(verifier_dir).fingerprint,
        "init_from": sha256_file(Path(cfg.init_from) / "model.safetensors") if cfg.init_from else None,
        "config": cfg.identity(),
        **({"replay": replay.fingerprint} if replay is not None else {}),
    }


def train(cfg: TrainConfig, hidden_dir: str | Path, verifier_dir: str | Path, out: str | Path,
          verifier_name: str = "", progress: bool = True, restart_on_mismatch: bool = False,
          replay: str | Path | None = None, online: bool = False, wait_s: float = SPOOL_WAIT_S) -> TrainedDraft | None:
    """Train (or resume) a draft; rank 0 returns the manifest of `out`, other ranks None.

    Checkpoints in `out` from another config or other inputs are an error, or, with
    `restart_on_mismatch` (the pipeline's choice: its stage dir follows its inputs), are cleared.
    `replay`: a replay set dir (`eagle3 replay-set`); with `cfg.replay_prompts` > 0
    each validation reports its replay tau, and the best checkpoint is chosen by it.
    `online`: `hidden_dir` is an online producer's spool (eagle3.storage.spool), read window by window as
    it is filled; one side silent for `wait_s` seconds while the other waits on it fails the run.
    """
    data, verifier_dir, out = source(hidden_dir, online, wait_s), Path(verifier_dir), Path(out)
    world = dist.init()
    heap.retain_freed_memory()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.fsdp and world.device.type != "cuda":
        raise ValueError("--fsdp needs CUDA; on CPU the trainer uses DDP")
    # flush-to-zero before the first parallel op, so torch's worker threads start with it (runtime/floats.py);
    # online, rank 0 shows the producer that the trainer lives, or how it failed
    with floats.denormals_flushed(), data.serving(world.main):
        hidden = data.manifest()
        ver = VerifierWeights.read(verifier_dir)
        rs = load_replay(cfg, replay, hidden, data.dir, world)
        fp = inputs(data, verifier_dir, cfg, rs)
        # every rank takes rank 0's answer: a rank that went on alone would wait forever for the others'
        # collectives, and on several nodes each host's view of the shared out dir may lag another's
        if (done := dist.broadcast_object(finished(out, fp) if world.main else None, world)) is not None:
            data.done(0, world.main)  # a producer started with it may end
            dist.shutdown()
            return done if world.main else None

        run = Run(cfg, world, hidden, ver, data, verifier_dir, out, rs, fp)
        run.resume(restart_on_mismatch)
        run.open_metrics()
        run.fit(progress)
        run.finish()
        result = run.export(verifier_name) if world.main else None
        data.done(len(run.plan.train) if run.plan else 0, world.main)  # every window read: the producer may end
    dist.shutdown()
    return result


def finished(out: Path, fp: dict[str, Any]) -> TrainedDraft | None:
    """The manifest of `out` when it already holds this exact result (inputs `fp`, final/ exported), else None."""
    if TrainedDraft.exists(out):
        done = TrainedDraft.read(out)
        if done.inputs == fp and (out / FINAL / "config.json").is_file():
            log.info("train: %s already holds this exact result; nothing to do", out)
            return done
    return None


@dataclass
class Window:
    """The rows since the last train record: their loss sums, and when the window began (the record's tok/s)."""

    sums: LossSums
    t0: float = field(default_factory=time.perf_counter)


class Run:
    """One training run: the state its steps share, set up by the constructor, `resume` and `open_metrics`.

    Fixed: cfg, world, out, hidden (the hidden states' manifest), rs (the replay set or None), fp (`inputs`),
    config (cfg as JSON), draft (the bare draft), head (the target's norm + lm_head), the train / val stores,
    lengths (the train samples' token counts), spe (optimizer steps per epoch), total (optimizer steps of the
    run), weights (the TTT steps' loss weights), precision (cfg.precision resolved on this device), amp (its
    autocast), tops (`TopCache`).
    Built by `resume`: model (`TTT` wrapped for DDP / FSDP), params (its trainable parameters), opt, sched.
    Moving, and saved in every checkpoint: pos; best (the best validation so far: tau, step, metric, sim_tau,
    replay_tau); last_val (the step of the latest validation, -1 before the first).
    Set by `fit`: window (the rows since the last train record).
    """

    model: nn.Module
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    tb: TensorBoard
    window: Window

    def __init__(self, cfg: TrainConfig, world: dist.Dist, hidden: HiddenStates, ver: VerifierWeights,
                 data: Source, verifier_dir: Path, out: Path, rs: ReplaySet | None, fp: dict[str, Any]):
        """Build the draft (seeded: the same init on every rank) and the target head on the device, open the
        readers of `data` (a store, or a spool's: online) and size the run from the train split's packs."""
        self.cfg, self.world, self.hidden, self.out, self.rs, self.fp = cfg, world, hidden, out, rs, fp
        self.config = cfg.identity()
        self.draft = build_draft(cfg, hidden, verifier_dir).to(world.device)
        # A tied target (SmolLM2, Llama-3.2-1B, ...): the head's lm_head *is* the draft's frozen
        # embedding, one [V, H] fp32 copy instead of two (113 MB for SmolLM2). FSDP shards the
        # embedding, so there the head keeps its own.
        shared = self.draft.embed_tokens.weight.detach() if ver.tied_embeddings and not cfg.fsdp else None
        self.head = TargetHead.from_verifier(verifier_dir, lm_head=shared).to(world.device)
        readers = data.open(hidden, cfg.read_order(world.world), world.main, dist.barrier)
        self.train_store, self.val_store = readers.train, readers.val
        self.plan = readers.plan  # online: the spool's windows
        self.lengths = self.train_store.lengths
        n_packs = len(epoch_packs(self.lengths, cfg.seed, 0, cfg.pack_tokens))
        self.spe = steps_per_epoch(n_packs, world.world, cfg.grad_accum)
        self.total = cfg.max_steps or cfg.epochs * self.spe
        assert self.plan is None or self.plan.total_steps == self.total, "the spool plans another run length"
        self.weights = step_weights(cfg.ttt_steps, cfg.step_decay)
        self.pos, self.best = Pos(), Best()
        # step of the latest validation: a checkpoint is saved before its step's epoch-end validation
        self.last_val = -1
        self.precision = floats.resolve_precision(cfg.precision, world.device)
        self.amp = floats.autocast(self.precision, world.device)
        self.tops = TopCache()
        self.metrics_path = out / METRICS

    # ---- resume: model, optimizer, scheduler, data position, RNG
    def resume(self, restart_on_mismatch: bool) -> None:
        """Wrap the draft and build its optimizer and LR schedule; from the latest checkpoint in `out`, when
        one of this config and these inputs is there, load the weights, the optimizer and scheduler state,
        the RNG state and `pos` / `best` / `last_val`."""
        last = self.latest_checkpoint(restart_on_mismatch)
        if last is not None:
            self.draft.load_state_dict(last[1])  # before wrapping: FSDP2 then shards the loaded weights
        self.build_model()
        if last is not None:
            self.restore(last[0], last[2])

    def latest_checkpoint(self, restart_on_mismatch: bool) -> tuple[Path, dict, dict] | None:
        """(dir, draft state dict, trainer state) of the latest valid checkpoint in `out`, or None. One of
        another config or other inputs is an error, or, with `restart_on_mismatch`, is cleared on rank 0
        together with the metrics, final/, manifest and curves (every rank waits on both sides of that)."""
        # the checkpoint rank 0 finds, on every rank: each host sees the shared out dir through its own cache
        last = dist.broadcast_object(ckpt.latest(self.out) if self.world.main else None, self.world)
        if last is None:
            return None
        state_dict, state, meta = ckpt.load(last)
        if meta.get("config") != self.config or meta.get("inputs") != self.fp:
            if not restart_on_mismatch:
                raise ValueError(f"{last}: checkpoint of a different config or different inputs; "
                                 f"use a new --out dir (or delete {self.out / ckpt.CKPT_DIR})")
            dist.barrier()
            if self.world.main:
                log.warning("train: %s holds a run of another config or other inputs; starting over", self.out)
                ckpt.clear(self.out, [METRICS, FINAL, "manifest.json", "curves.png"])
            dist.barrier()
            return None
        return last, state_dict, state

    def build_model(self) -> None:
        """The TTT module wrapped for DDP / FSDP, its optimizer (eagle3.train.optim) and warmup + cosine LR
        schedule."""
        cfg = self.cfg
        self.model = dist.wrap(TTT(self.draft, cfg.ttt_steps, cfg.attn_block, self.weights, loss=cfg.loss,
                                   eta=cfg.lk_eta, topk=cfg.topk, topk_weight=cfg.topk_weight), self.world, cfg.fsdp)
        # The optimizer is built on the wrapped model's parameters (FSDP2 replaces them with shards).
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = optim.build(self.model, self.params, cfg)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, optim.lr_lambda(cfg, self.total))

    def restore(self, last: Path, state: dict[str, Any]) -> None:
        """Load checkpoint `last`'s trainer state (as `save` wrote it) into the optimizer, scheduler, RNG and
        the run's position."""
        dist.load_optimizer_state(self.model, self.opt, state["optimizer"], self.cfg.fsdp)
        self.sched.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        self.pos, self.best = Pos(**state["pos"]), Best(**state["best"])
        self.last_val = state.get("last_val", -1)
        if self.world.main:
            log.info("train: resumed from %s (step %d, epoch %d, epoch step %d)", last.name, self.pos.step,
                     self.pos.epoch, self.pos.epoch_step)

    def open_metrics(self) -> None:
        """Create `out` and drop the metrics a killed run logged after its checkpoint (rank 0); open TensorBoard."""
        if self.world.main:
            self.out.mkdir(parents=True, exist_ok=True)
            truncate_records(self.metrics_path, self.pos.step, self.last_val)
        self.tb = TensorBoard(self.out, self.world.main)

    def emit(self, rec: dict[str, Any]) -> None:
        """Append one metrics record (rank 0 only) to metrics.jsonl and TensorBoard."""
        append_record(self.metrics_path, rec)
        self.tb.log(rec)

    # ---- the step loop
    def fit(self, progress: bool) -> None:
        """Optimizer steps from `pos` to `total`, epoch by epoch; each epoch's end is validated (unless its
        last step just was) before the next epoch's packs are drawn."""
        # A bar on a terminal; under torchrun-in-Prefect (no terminal) a log line per train record, and one at
        # least every 20 s between them.
        main = self.world.main
        meter = Meter("train", self.total, "steps", say=log.info if main else silent, bar=progress and main,
                      initial=self.pos.step)
        self.window = Window(LossSums(self.cfg.ttt_steps))
        pos = self.pos
        self.model.train()
        while pos.step < self.total:
            packs = epoch_packs(self.lengths, self.cfg.seed, pos.epoch, self.cfg.pack_tokens)
            while pos.epoch_step < self.spe and pos.step < self.total:
                self.step(packs, meter)
            if pos.epoch_step >= self.spe:  # epoch end
                if self.last_val != pos.step:
                    self.run_validation()
                pos.epoch, pos.epoch_step = pos.epoch + 1, 0
        meter.close()

    def step(self, packs: list[list[int]], meter: Meter) -> None:
        """One optimizer step on this epoch's `packs` (sample indices per packed row), then what falls due at
        it: the train record (every log_every steps and at the last), a validation (every val_every) and a
        checkpoint (every ckpt_every; the last step's is `finish`'s)."""
        cfg, pos = self.cfg, self.pos
        if self.plan is not None:
            self.train_store.at(pos.step)  # online: the spool window this step reads (waits for it)
        self.backward_rows(packs, self.window.sums)
        gnorm = optim.step(self.params, self.opt, cfg.grad_clip, self.sched)
        pos.step += 1
        pos.epoch_step += 1
        if pos.step % cfg.log_every == 0 or pos.step == self.total:
            self.log_train(meter, gnorm)
        meter.update(pos.step)  # after the record, which restarted the 20 s cadence
        if pos.step % cfg.val_every == 0:
            self.run_validation()
        if pos.step % cfg.ckpt_every == 0 and pos.step < self.total:
            self.save(f"step-{pos.step:08d}")

    def backward_rows(self, packs: list[list[int]], meter: LossSums) -> None:
        """Forward and backward this rank's `grad_accum` rows of the step at `pos.epoch_step`, each row's loss
        scaled by 1/grad_accum; DDP all-reduces the gradients on the last row's backward only (`no_sync`)."""
        cfg, world = self.cfg, self.world
        rows = micro_packs(packs, self.pos.epoch_step, world.rank, world.world, cfg.grad_accum)
        for a, idx in enumerate(rows):
            batch = collate(self.train_store, idx, cfg.pack_tokens, world.device)
            sync = a == len(rows) - 1 or not hasattr(self.model, "no_sync")
            with (nullcontext() if sync else self.model.no_sync()):
                out = row_pass(self.model, self.tops(self.head, batch, "train", idx), batch, self.amp)
                (out.loss / cfg.grad_accum).backward()
            meter.add(out, None, rows=1, tokens=batch["input_ids"].numel())

    def log_train(self, meter: Meter, gnorm: torch.Tensor) -> None:
        """The train record of the rows since the last one (summed over ranks): metrics.jsonl, TensorBoard, and
        the meter (the bar's postfix on a terminal, else a log line with the ETA); then a new window."""
        pos, total = self.pos, self.total
        w = self.window.sums.reduce(self.world)
        dt = time.perf_counter() - self.window.t0
        rec = {"split": "train", "step": pos.step, "epoch": pos.epoch, "lr": self.sched.get_last_lr()[0],
               "grad_norm": float(gnorm), "tokens_per_s": w["tokens"] / max(dt, 1e-9), **w}
        if self.world.main:
            self.emit(rec)
            acc = [round(x, 3) for x in w["acc"]]
            meter.report(f"train step {pos.step}/{total}  loss {w['loss']:.4f}  acc {acc}  "
                         f"{rec['tokens_per_s']:.0f} tok/s  ETA {meter.eta()}",
                         postfix=f"loss {w['loss']:.3f} acc0 {acc[0]:.3f} {rec['tokens_per_s']:,.0f} tok/s")
        self.window = Window(LossSums(self.cfg.ttt_steps))

    def run_validation(self) -> None:
        """Validate at `pos.step` (all ranks): loss, top-1 and simulated tau, plus replay tau with a replay set;
        rank 0 logs the record. A new best by replay tau (else simulated tau) is saved as the `best` checkpoint."""
        cfg, pos = self.cfg, self.pos
        self.last_val = pos.step
        v = validate(self.model, self.head, self.val_store, cfg, self.world, self.amp, self.tops)
        if self.rs is not None:
            v.update(replay_validate(self.draft, self.rs, cfg.replay_k, self.world, self.amp,
                                     dist.gathered(self.model, cfg.fsdp)))
        metric = "replay_tau" if "replay_tau" in v else "sim_tau"
        if metric not in v:
            return
        if self.world.main:
            self.emit({"split": "val", "step": pos.step, "epoch": pos.epoch, **v})
            log.info("val step %d: loss %.4f acc %s sim tau %.3f%s", pos.step, v.get("loss", float("nan")),
                     [round(a, 3) for a in v.get("acc", [])], v.get("sim_tau", float("nan")),
                     f" replay tau {v['replay_tau']:.3f} (k={cfg.replay_k})" if "replay_tau" in v else "")
        if v[metric] > self.best.tau:
            self.best = Best(v[metric], pos.step, metric, v.get("sim_tau"), v.get("replay_tau"))
            self.save(ckpt.BEST)

    def save(self, tag: str) -> None:
        """Checkpoint `tag` (step-XXXXXXXX or best) under out/checkpoints: the full draft weights, the optimizer,
        scheduler and RNG state and pos / best / last_val; rank 0 writes it (`ckpt.save`: an atomic dir) and
        prunes old step checkpoints to keep_last. Every rank calls it (gathers under FSDP), and waits for it."""
        cfg, world = self.cfg, self.world
        sd = dist.full_state_dict(self.model if cfg.fsdp else self.draft)
        sd = {k.removeprefix("draft."): v for k, v in sd.items()}
        osd = dist.optimizer_state(self.model, self.opt, cfg.fsdp)  # collective under FSDP: every rank calls it
        if world.main:
            state = {"optimizer": osd, "scheduler": self.sched.state_dict(), "rng": ckpt.rng_state(),
                     "pos": asdict(self.pos), "best": asdict(self.best), "last_val": self.last_val}
            ckpt.save(self.out, tag, sd, state, {"config": self.config, "inputs": self.fp, "step": self.pos.step})
            if tag.startswith("step-"):
                ckpt.prune(self.out, cfg.keep_last)
        dist.barrier()

    def finish(self) -> None:
        """After the loop: validate the last step unless that just happened, save its checkpoint, close TensorBoard."""
        if self.last_val != self.pos.step:
            self.run_validation()  # a run that stopped mid-epoch on max_steps, or a resumed finished run
        self.save(f"step-{self.pos.step:08d}")
        self.tb.close()

    # ---- export and commit (rank 0)
    def export(self, verifier_name: str) -> TrainedDraft:
        """Export `cfg.export_step`'s checkpoint to out/final (best: the last step's when no validation gave one),
        plot the curves, and write the stage's manifest last: its presence marks the stage done."""
        cfg, out, best = self.cfg, self.out, self.best
        best_dir = out / ckpt.CKPT_DIR / ckpt.BEST
        src = best_dir if cfg.export_step == "best" and best_dir.is_dir() else last_step_dir(out)
        state_dict, _, meta = ckpt.load(src)
        export(state_dict, self.draft.config, cfg.ttt_steps, out / FINAL, cfg.export_format,
               verifier=verifier_name or self.hidden.model_dir,
               extra={"exported_step": meta["step"], "best_step": best.step, "best_metric": best.metric,
                      "sim_tau": best.sim_tau, "replay_tau": best.replay_tau,
                      "train_config": self.config})
        plot_curves(self.metrics_path, out / "curves.png")
        result = TrainedDraft(
            config=self.config, inputs=self.fp, final_dir=FINAL, export_format=cfg.export_format,
            steps=self.pos.step, exported_step=meta["step"], best_step=best.step, best_metric=best.metric,
            best_sim_tau=best.sim_tau_or_tau(), best_replay_tau=best.replay_tau, val=last_val_record(self.metrics_path),
            draft_config=self.draft.config.model_dump(mode="json"),
            weights_sha256=sha256_file(out / FINAL / "model.safetensors"),
        )
        result.write(out)
        log.info("train: done, %d steps (%s compute); best %s %.3f at step %d; exported step %d (%s) to %s",
                 self.pos.step, self.precision, best.metric.replace("_", " "), best.tau, best.step, meta["step"],
                 cfg.export_step, out / FINAL)
        return result


def last_step_dir(out: Path) -> Path:
    d = ckpt.latest(out)
    if d is None:
        raise RuntimeError(f"{out}: no valid checkpoint to export")
    return d
