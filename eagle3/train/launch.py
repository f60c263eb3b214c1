"""How training starts: in this process for one, under torchrun for several (`command`).

The config travels whole, as a file: the torchrun command carries <out>/train_config.json, which
`python -m eagle3.train` reads back (every TrainConfig field is a flag too, overriding it). Several
nodes: give torchrun its own --nnodes/--node-rank/--rdzv-* flags; nothing here changes.
"""
from __future__ import annotations

import logging
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from eagle3.config import TrainConfig
from eagle3.storage.atomic import atomic_write_text

CONFIG_FILE = "train_config.json"


def command(hidden, verifier, out, cfg: TrainConfig, verifier_name: str = "", restart_on_mismatch: bool = False,
            replay: str | None = None, online: bool = False, wait_s: float = 900.0) -> list[str]:
    """The torchrun command that trains `cfg` (written whole to <out>/train_config.json) on these stage dirs
    (validating on the replay set `replay`, when given)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out) / CONFIG_FILE, cfg.model_dump_json(indent=1))
    argv = ["--hidden", str(hidden), "--verifier", str(verifier), "--out", str(out),
            "--config", str(Path(out) / CONFIG_FILE)]
    argv += ["--verifier-name", verifier_name] if verifier_name else []
    argv += ["--restart-on-mismatch"] if restart_on_mismatch else []
    argv += ["--replay", str(replay)] if replay else []
    argv += ["--online", "--wait-s", str(wait_s)] if online else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.nproc_per_node}",
            "-m", "eagle3.train", *argv]


def run_rank(cfg: TrainConfig, out, *, hidden, verifier, verifier_name: str = "", restart_on_mismatch: bool = False,
             replay: str | None = None, online: bool = False, wait_s: float = 900.0) -> None:
    """This process's part of training `cfg` (rank 0 holds the out dir's lock)."""
    from eagle3.storage.lock import RunLock
    from eagle3.train.loop import train

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    with RunLock(out) if rank == 0 else nullcontext():
        train(cfg, hidden, verifier, out, verifier_name=verifier_name, restart_on_mismatch=restart_on_mismatch,
              replay=replay, online=online, wait_s=wait_s)
