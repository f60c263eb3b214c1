"""Validation, and the packed-row pass training and validation share: loss, per-step top-1 and simulated tau
over the validation split (eagle3/train/metrics.py), and replay tau over a replay set (eagle3/decoding/chains.py).
The target's full-vocab argmax per sample is computed once and cached (`TopCache`)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagle3.config import TrainConfig
from eagle3.decoding.chains import ReplaySet, replay_counts
from eagle3.model.draft import Eagle3Draft
from eagle3.storage.manifests import HiddenStates
from eagle3.train import distributed as dist
from eagle3.train.data import collate, val_packs
from eagle3.train.loss import TargetHead, TTTLossOutput, scored
from eagle3.train.metrics import LossSums, chain_acceptance

log = logging.getLogger("eagle3.train")


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
        logits, top = head(batch["final"], need=scored(batch["loss_mask"], batch["doc"]))
        lengths = torch.bincount(batch["doc"][0], minlength=len(idx)).tolist()
        for k, t in zip(keys, top[0].split(lengths), strict=True):
            self.top[k] = t.to("cpu", torch.int32)
        return logits, top



def row_pass(model: nn.Module, targets: tuple[torch.Tensor, torch.Tensor], batch: dict[str, torch.Tensor],
             amp) -> TTTLossOutput:
    """One packed row: k TTT steps and their loss.
    targets: (target logits [1, L, Vd] fp32, draft id of the target argmax [1, L]) from `TopCache`."""
    with amp:
        _, out = model(batch["input_ids"], batch["aux"], batch["position_ids"], batch["doc"], batch["loss_mask"],
                       targets[0], targets[1].long())
    return out



@torch.no_grad()
def validate(model, head, store, cfg: TrainConfig, world: dist.Dist, amp, cache: TopCache) -> dict[str, Any]:
    """Loss, per-step top-1 and simulated tau over the validation split (all ranks, summed)."""
    if store is None or len(store) == 0:
        return {}
    lengths = store.lengths
    packs = val_packs(lengths, cfg.seed, cfg.pack_tokens, cfg.val_max_packs)
    m = LossSums(cfg.ttt_steps)
    model.eval()
    # Every rank runs as many passes (a DDP forward broadcasts buffers, an FSDP one gathers shards: both are
    # collectives): with fewer packs than ranks, or a remainder, a rank repeats a pack and does not count it.
    n = -(-len(packs) // world.world) * world.world
    for i in range(world.rank, n, world.world):
        idx = packs[i % len(packs)]
        batch = collate(store, idx, cfg.pack_tokens, world.device)
        out = row_pass(model, cache(head, batch, "val", idx), batch, amp)
        if i < len(packs):
            m.add(out, chain_acceptance(out), rows=1, tokens=batch["input_ids"].numel())
    model.train()
    return m.reduce(world)



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


def load_replay(cfg: TrainConfig, replay: str | Path | None, hidden: HiddenStates, hidden_dir: Path,
                world: dist.Dist) -> ReplaySet | None:
    """The replay set validation replays, when one is given and `cfg.replay_prompts` asks for it; it must come
    from the target the hidden states were extracted from."""
    rs = None
    if replay is not None and cfg.replay_prompts:
        rs = ReplaySet.load(replay, hidden.aux_layer_ids)
        if rs.model_fingerprint != hidden.model_fingerprint:
            raise ValueError(f"replay set {replay} was built from another target than the hidden states in "
                             f"{hidden_dir}")
    elif cfg.replay_prompts and world.main:
        log.info("train: no replay set given (--replay): validation reports simulated tau only")
    return rs
