"""Stage 4: training the draft (loop.py), with its loss (loss.py), data packing (data.py), checkpoints
(checkpoint.py), metrics (metrics.py) and every torch.distributed call (distributed.py).

One process trains in the calling process; several go through torchrun (launch.py), whose entry point is
`python -m eagle3.train` (__main__.py).
"""
from __future__ import annotations

from eagle3.config import SPOOL_WAIT_S, TrainConfig
from eagle3.flags import UserError
from eagle3.runtime.stop import run_child
from eagle3.stage import Stage
from eagle3.storage.manifests import TrainedDraft
from eagle3.train.launch import check_node, command, finished, run_rank

__all__ = ["STAGE"]


def _run(out, cfg: TrainConfig, *, hidden, verifier, verifier_name: str = "", restart_on_mismatch: bool = False,
        replay: str | None = None, online: bool = False, wait_s: float = SPOOL_WAIT_S,
        node_rank: int = 0) -> TrainedDraft:
    """Train `cfg` here (one process) or under torchrun (several: on this host, or this host's part as node
    `node_rank` of cfg.nnodes, each node running this same call with its own rank)."""
    kw = dict(verifier_name=verifier_name, restart_on_mismatch=restart_on_mismatch, replay=replay, online=online,
              wait_s=wait_s)
    check_node(cfg, node_rank)
    if cfg.world == 1:
        run_rank(cfg, out, hidden=hidden, verifier=verifier, **kw)
    elif cfg.nnodes > 1 and (done := finished(hidden, verifier, out, cfg, replay, online)) is not None:
        return done  # the peers would never come to the rendezvous
    # torchrun under run_child: a stop of this command ends every rank
    elif rc := run_child(command(hidden, verifier, out, cfg, **kw, node_rank=node_rank), writes=(out,)):
        raise UserError(f"torchrun exited with status {rc}" + (f" on node {node_rank} of {cfg.nnodes} (a peer's "
                        "failure ends every node's torchrun: see the first error of each node's log)"
                        if cfg.nnodes > 1 else ""))
    return TrainedDraft.read(out)


def _inputs(cfg: TrainConfig, *, hidden, verifier, online: bool = False, **_) -> dict:
    # the replay set (when built) follows from the target and the prepared data (both behind `hidden`) and cfg
    from eagle3.train.loop import inputs
    from eagle3.train.source import source

    return inputs(source(hidden, online), verifier, cfg)


def summary(m: TrainedDraft) -> dict:
    return {"steps": m.steps, "exported_step": m.exported_step, "best_step": m.best_step, "best_metric": m.best_metric,
            "best_sim_tau": m.best_sim_tau, "best_replay_tau": m.best_replay_tau, "final": m.final_dir,
            "export_format": m.export_format}


def headline(m: TrainedDraft) -> str:
    replay = f", replay tau {m.best_replay_tau:.3f}" if m.best_replay_tau is not None else ""
    return (f"{m.steps} steps, best simulated tau {m.best_sim_tau:.3f}{replay} at step {m.best_step} "
            f"({m.best_metric}); exported step {m.exported_step}")


STAGE = Stage(
    name="train", help="stage 4: train the EAGLE-3 draft (torchrun for N > 1 processes, on one node or several)",
    config=TrainConfig, manifest=TrainedDraft, gpu=True,  # not locked here: rank 0 holds the lock
    aliases={"export_format": "--format"},
    flags=(
        ("--hidden", dict(required=True, help="extract stage dir (hidden states)")),
        ("--verifier", dict(required=True, help="verifier stage dir")),
        ("--out", dict(required=True, help="output dir: checkpoints/, final/, metrics.jsonl, manifest.json")),
        ("--verifier-name", dict(default="", help="target name recorded in a speculators export")),
        ("--restart-on-mismatch", dict(action="store_true", help="clear checkpoints of another config/inputs in "
                                       "--out instead of refusing to start")),
        ("--replay", dict(default=None, help="a replay set dir (`eagle3 replay-set`): validation reports replay tau "
                          "on it and picks the best checkpoint by it (with --replay-prompts above 0)")),
        ("--online", dict(action="store_true", help="--hidden is an online producer's spool dir, read as it is filled "
                          "(`eagle3 produce`)")),
        ("--wait-s", dict(type=float, default=SPOOL_WAIT_S, help="online: fail when the producer has shown no sign "
                          "of life for this many seconds while the trainer waits on it")),
        ("--node-rank", dict(type=int, default=0, help="nnodes above 1: this node, 0..nnodes-1 (every node runs the "
                             "same command and config with its own rank; they meet at rdzv_endpoint)")),
    ),
    run=_run, inputs=_inputs, summary=summary, headline=headline,
)
