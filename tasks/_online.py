"""What the online pair (the producer tasks and the train task, side by side through a spool) shares: the
producers' inputs, the trainer's view of its producers, when the pair must run again, and how a side that
lost its partner for good fails.

The tasks (extract.workers producers and the trainer) are cached one by one, but they only work together:
a producer that returns its cached result leaves a trainer that must train waiting for shards that never
come, and the other way round. So before any starts, the flow asks `pair_done` (the spool's manifest is
written once every producer ended); when the pair is not done, it resets the spool (`reset_spool`) and runs
them all, none served from the cache.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from eagle3.config import SPOOL_WAIT_S, ExtractConfig, TrainConfig
from eagle3.storage.manifests import SpooledStates, SpoolSource, TrainedDraft


class OnlineSource(BaseModel):
    """Online mode: the trainer's `hidden` is the spool of a producer (tasks.extract.produce_task) running
    beside it with these settings."""

    extract: ExtractConfig = Field(description="the producer's extract settings")
    spool_bytes: int = Field(ge=1 << 20, description="the spool's cap on disk, in bytes")
    wait_s: float = Field(SPOOL_WAIT_S, gt=0,
                          description="how long the trainer waits on a producer with no sign of life")

    @property
    def producer_slots(self) -> int:
        """The devices one producer's engine uses: its tensor x pipeline parallel ranks (with extract.workers
        producers, each takes that many: on one host, side by side; hopped, each on its own host)."""
        return self.extract.tensor_parallel_size * self.extract.pipeline_parallel_size


def producer_inputs(model: str, prepared: str, cfg: ExtractConfig, train: TrainConfig, spool_bytes: int,
                    trust_remote_code: bool = False) -> dict[str, Any]:
    """What the producer's run depends on (eagle3.extract.online.online_inputs), for the read order of the
    trainer of `train` (its nnodes x nproc_per_node ranks)."""
    from eagle3.extract.online import online_inputs

    return online_inputs(model, prepared, cfg, train.read_order(train.world), spool_bytes, trust_remote_code)


def pair_done(spool: str | Path, train_out: str | Path, producer: dict[str, Any], verifier: str,
              cfg: TrainConfig) -> bool:
    """Whether both sides finished for these inputs: the spool's manifest records the producer's inputs
    `producer`, and the train dir's draft was trained on the states the spool's source.json names, with this
    verifier and config (the library's own check, less the replay set, which follows from the rest)."""
    from eagle3.registry import STAGES

    spool, train_out = Path(spool), Path(train_out)
    if not (SpooledStates.exists(spool) and TrainedDraft.exists(train_out) and (spool / SpoolSource.FILE).is_file()):
        return False
    if SpooledStates.read(spool).inputs != producer:
        return False
    done = TrainedDraft.read(train_out)
    if not (train_out / done.final_dir / "config.json").is_file():
        return False
    want = STAGES["train"].inputs(cfg, hidden=spool, verifier=verifier, online=True)
    return {k: v for k, v in done.inputs.items() if k != "replay"} == want


def reset_spool(spool: str | Path) -> None:
    """Start the spool over for a pair that runs again: its manifest, every producer's stats, source.json,
    plan.json and the trainer's position go. A finished spool's manifest would end the producers at once; an
    earlier run's stats would be merged into the new manifest by the last producer to end (one that starts
    late, owning no window, may end after the others); an earlier run's source.json would be read by a
    trainer that starts before the new producers write their own. The producers drop the shards of a plan
    they did not write; a trainer that resumes from a checkpoint moves the position there."""
    from eagle3.storage.spool import PLAN, POSITION

    root = Path(spool)
    for f in [*(root / n for n in ("manifest.json", SpoolSource.FILE, PLAN, POSITION)),
              *root.glob("producer*.stats.json")]:
        f.unlink(missing_ok=True)


def partner_gone(spool: str | Path, beat: str, wait_s: float, since: float) -> bool:
    """Whether the other side's beat file (eagle3.storage.spool: producer.beat or trainer.beat) has been silent
    for `wait_s` seconds or more, counting from `since` (a wall-clock time) when it was never touched."""
    from eagle3.storage.liveness import silent_for

    return silent_for(Path(spool) / beat, since) >= wait_s


