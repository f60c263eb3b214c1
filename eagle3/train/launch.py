"""How training starts: in this process for one, under torchrun for several (`command`).

The config travels whole, as a file: the torchrun command carries <out>/train_config.json, which
`python -m eagle3.train` reads back (every TrainConfig field is a flag too, overriding it).

Several nodes (cfg.nnodes > 1): every node runs the same command with its own node rank, and torchrun's
c10d rendezvous at cfg.rdzv_endpoint joins them. The c10d rendezvous numbers the nodes itself (by host
name and process id; torchrun ignores --node-rank there), so global rank 0, which holds the out dir's lock
and writes every file, is on whichever node it puts first: the out dir is on storage every node shares,
and every rank reads the checkpoints there. The node rank names the node (0..nnodes-1) to eagle3 only.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from eagle3.config import SPOOL_WAIT_S, TrainConfig
from eagle3.storage.atomic import atomic_write_text

CONFIG_FILE = "train_config.json"
# How long a node's torchrun waits at the rendezvous for the others. After a failure every node task retries
# on its own (10 s apart in Prefect, plus a new flow run's start when it hops, and the replay set's check), so
# the nodes come back minutes apart at worst; a node alone for this long fails and is retried again.
JOIN_TIMEOUT_S = 900


def rdzv_id(out) -> str:
    """The rendezvous id of a run into `out`: the same on every node (the out dir is the same path on the
    shared storage) and on every retry, so the nodes of one run meet again, and runs into other dirs that
    share an endpoint keep apart."""
    return "eagle3-" + hashlib.sha256(os.path.abspath(out).encode()).hexdigest()[:16]


def torchrun_flags(cfg: TrainConfig, out) -> list[str]:
    """torchrun's flags for `cfg`: one node alone (--standalone: a rendezvous on a free local port), or this
    node of cfg.nnodes meeting at cfg.rdzv_endpoint. --max-restarts 0: a failed rank (a peer's death shows as a
    collective error) ends torchrun on every node, and their tasks retry together, from the last checkpoint."""
    if cfg.nnodes == 1:
        return ["--standalone", f"--nproc-per-node={cfg.nproc_per_node}"]
    return [f"--nnodes={cfg.nnodes}", f"--nproc-per-node={cfg.nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={cfg.rdzv_endpoint}", f"--rdzv-id={rdzv_id(out)}",
            f"--rdzv-conf=join_timeout={JOIN_TIMEOUT_S}", "--max-restarts=0"]


def check_node(cfg: TrainConfig, node_rank: int) -> None:
    if not 0 <= node_rank < cfg.nnodes:
        raise ValueError(f"node rank {node_rank} of nnodes {cfg.nnodes}: expected 0..{cfg.nnodes - 1}")


def finished(hidden, verifier, out, cfg: TrainConfig, replay: str | None = None, online: bool = False):
    """The manifest of `out` when it already holds this exact result, else None; read before torchrun starts.
    One node's torchrun waits at the rendezvous for every other: a node started again after its peers
    finished (a retried task, a rerun command) must end here instead of waiting for them alone."""
    from eagle3.decoding.chains import ReplaySet
    from eagle3.storage.manifests import HiddenStates
    from eagle3.train import loop
    from eagle3.train.source import Stored

    if online:  # the spool's source.json may be an earlier run's until the producer rewrites it
        return None
    rs = (ReplaySet.load(replay, HiddenStates.read(hidden).aux_layer_ids) if replay is not None and cfg.replay_prompts
          else None)
    return loop.finished(Path(out), loop.inputs(Stored(Path(hidden)), verifier, cfg, rs))


def command(hidden, verifier, out, cfg: TrainConfig, verifier_name: str = "", restart_on_mismatch: bool = False,
            replay: str | None = None, online: bool = False, wait_s: float = SPOOL_WAIT_S,
            node_rank: int = 0) -> list[str]:
    """The torchrun command that trains `cfg` (written whole to <out>/train_config.json) on these stage dirs
    (validating on the replay set `replay`, when given), as node `node_rank` of cfg.nnodes."""
    check_node(cfg, node_rank)
    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out) / CONFIG_FILE, cfg.model_dump_json(indent=1))  # the same bytes from every node
    argv = ["--hidden", str(hidden), "--verifier", str(verifier), "--out", str(out),
            "--config", str(Path(out) / CONFIG_FILE)]
    argv += ["--verifier-name", verifier_name] if verifier_name else []
    argv += ["--restart-on-mismatch"] if restart_on_mismatch else []
    argv += ["--replay", str(replay)] if replay else []
    argv += ["--online", "--wait-s", str(wait_s)] if online else []
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_flags(cfg, out), "-m", "eagle3.train", *argv]


def run_rank(cfg: TrainConfig, out, *, hidden, verifier, verifier_name: str = "", restart_on_mismatch: bool = False,
             replay: str | None = None, online: bool = False, wait_s: float = SPOOL_WAIT_S) -> None:
    """This process's part of training `cfg` (global rank 0 holds the out dir's lock)."""
    from eagle3.storage.lock import RunLock
    from eagle3.train.loop import train

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    with RunLock(out) if rank == 0 else nullcontext():
        train(cfg, hidden, verifier, out, verifier_name=verifier_name, restart_on_mismatch=restart_on_mismatch,
              replay=replay, online=online, wait_s=wait_s)
