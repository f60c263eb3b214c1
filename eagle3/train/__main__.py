"""Entry point for torchrun:  torchrun --nproc-per-node N -m eagle3.train --hidden D --verifier D --out D --config FILE

The config travels whole, as a file: `eagle3 train` and the pipeline's train task write the
TrainConfig to <out>/train_config.json and start this module on it (`command`). Every TrainConfig
field is a flag too (`--ttt-steps 3`, `--no-norm-output`, ...) and overrides the file. Several
nodes: give torchrun its own --nnodes/--node-rank/--rdzv-* flags; nothing here changes.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import nullcontext
from pathlib import Path

from eagle3 import config as C
from eagle3 import flags as F
from eagle3.storage.atomic import atomic_write_text

CONFIG_FILE = "train_config.json"
FLAGS = [
    ("--hidden", dict(required=True, help="extract stage dir (hidden states)")),
    ("--verifier", dict(required=True, help="verifier stage dir")),
    ("--out", dict(required=True, help="output dir: checkpoints/, final/, metrics.jsonl, manifest.json")),
    ("--config", dict(default=None, help="TrainConfig (or a pipeline config's train section) as YAML/JSON; "
                                         "flags override it")),
    ("--verifier-name", dict(default="", help="target name recorded in a speculators export")),
    ("--restart-on-mismatch", dict(action="store_true", help="clear checkpoints of another config/inputs in --out "
                                   "instead of refusing to start")),
    ("--replay", dict(default=None, help="a replay set dir (`eagle3 replay-set`): validation reports replay tau on it "
                      "and picks the best checkpoint by it (with --replay-prompts above 0)")),
]
ALIASES = {"export_format": "--format"}


def command(hidden, verifier, out, cfg: C.TrainConfig, verifier_name: str = "", restart_on_mismatch: bool = False,
            replay: str | None = None) -> list[str]:
    """The torchrun command that trains `cfg` (written whole to <out>/train_config.json) on these stage dirs
    (validating on the replay set `replay`, when given)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out) / CONFIG_FILE, cfg.model_dump_json(indent=1))
    argv = ["--hidden", str(hidden), "--verifier", str(verifier), "--out", str(out),
            "--config", str(Path(out) / CONFIG_FILE)]
    argv += ["--verifier-name", verifier_name] if verifier_name else []
    argv += ["--restart-on-mismatch"] if restart_on_mismatch else []
    argv += ["--replay", str(replay)] if replay else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.nproc_per_node}",
            "-m", "eagle3.train", *argv]


def run(cfg: C.TrainConfig, hidden, verifier, out, verifier_name: str = "", restart_on_mismatch: bool = False,
        replay: str | None = None) -> None:
    """This process's part of training `cfg` (rank 0 holds the out dir's lock)."""
    from eagle3.storage.lock import RunLock
    from eagle3.train.loop import train

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    with RunLock(out) if rank == 0 else nullcontext():
        train(cfg, hidden, verifier, out, verifier_name=verifier_name, restart_on_mismatch=restart_on_mismatch,
              replay=replay)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3.train", description=__doc__.splitlines()[0], allow_abbrev=False)
    for flag, kw in FLAGS:
        p.add_argument(flag, **kw)
    F.add_flags(p, C.TrainConfig, ALIASES)
    a = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    from eagle3.storage.lock import LockedError

    try:
        cfg = F.from_flags(C.TrainConfig, a, C.load_section(a.config, "train") if a.config else None)
        run(cfg, a.hidden, a.verifier, a.out, a.verifier_name, a.restart_on_mismatch, a.replay)
    except (ValueError, FileNotFoundError, LockedError) as e:
        print(f"eagle3 train (rank {rank}): error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
