"""Entry point for torchrun:  torchrun --nproc-per-node N -m eagle3.train --hidden D --verifier D --out D [...]

Every TrainConfig field is a flag (`--ttt-steps 3`, `--lr 3e-4`, `--no-norm-output`, ...);
`--config FILE` loads a YAML/JSON TrainConfig first and flags override it. Multi-node: give
torchrun its own --nnodes/--node-rank/--rdzv-* flags; nothing here changes.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from pathlib import Path

from eagle3.config import TrainConfig


def add_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", required=True, help="extract stage dir (hidden states)")
    p.add_argument("--verifier", required=True, help="verifier stage dir")
    p.add_argument("--out", required=True, help="output dir: checkpoints/, final/, metrics.jsonl, manifest.json")
    p.add_argument("--config", default=None, help="TrainConfig as YAML/JSON (flags override it)")
    p.add_argument("--verifier-name", default="", help="target name recorded in a speculators export")
    p.add_argument("--restart-on-mismatch", action="store_true",
                   help="clear checkpoints of another config/inputs in --out instead of refusing to start")
    for name, f in TrainConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        ann = f.annotation
        args = typing.get_args(ann)
        if ann is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=f.description)
        elif typing.get_origin(ann) is typing.Literal:
            p.add_argument(flag, choices=list(args), default=None, help=f.description)
        elif ann in (int, float) or (args and args[0] in (int, float) and type(None) in args):
            p.add_argument(flag, type=ann if ann in (int, float) else args[0], default=None, help=f.description)
    p.add_argument("--format", dest="export_format", choices=["vllm", "speculators"], default=None,
                   help="alias of --export-format")


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m eagle3.train ARGV`, with this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "eagle3.train", *argv]


def to_argv(a: argparse.Namespace) -> list[str]:
    """Flags that reproduce `a` for `python -m eagle3.train` (used to launch torchrun)."""
    argv = ["--hidden", str(a.hidden), "--verifier", str(a.verifier), "--out", str(a.out)]
    if a.config:
        argv += ["--config", str(a.config)]
    if a.verifier_name:
        argv += ["--verifier-name", a.verifier_name]
    if a.restart_on_mismatch:
        argv.append("--restart-on-mismatch")
    for name in TrainConfig.model_fields:
        v = getattr(a, name, None)
        if v is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(v, bool):
            argv.append(flag if v else "--no-" + flag[2:])
        else:
            argv += [flag, str(v)]
    return argv


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    base = {}
    if a.config:
        import yaml

        base = yaml.safe_load(Path(a.config).read_text()) or {}
        base = base.get("train", base)  # a whole PipelineConfig file works too
    over = {k: getattr(a, k) for k in TrainConfig.model_fields if getattr(a, k, None) is not None}
    return TrainConfig.model_validate({**base, **over})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3.train", description=__doc__.splitlines()[0], allow_abbrev=False)
    add_train_flags(p)
    a = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    from eagle3.train.loop import train

    from contextlib import nullcontext

    from eagle3.lock import LockedError, RunLock

    try:
        with RunLock(a.out) if rank == 0 else nullcontext():
            train(config_from_args(a), a.hidden, a.verifier, a.out, verifier_name=a.verifier_name,
                  restart_on_mismatch=a.restart_on_mismatch)
    except (ValueError, FileNotFoundError, LockedError) as e:
        print(f"eagle3 train (rank {rank}): error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
