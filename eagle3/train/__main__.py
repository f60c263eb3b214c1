"""Entry point for torchrun:  torchrun --nproc-per-node N -m eagle3.train --hidden D --verifier D --out D --config FILE

This process's part of training (eagle3/train/launch.py): the flags are `eagle3 train`'s, which starts
this module under torchrun for more than one process.
"""
from __future__ import annotations

import argparse
import os
import sys

from eagle3.runtime import stop
from eagle3.storage.lock import LockedError
from eagle3.train import STAGE
from eagle3.train.launch import run_rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3.train", description=__doc__.splitlines()[0], allow_abbrev=False)
    STAGE.add_to(p)
    a = p.parse_args(argv)
    try:
        args = STAGE.args(a)
        args.pop("node_rank")  # `eagle3 train`'s: torchrun gives this process its RANK
        with stop.handled():  # torchrun passes a stop on as SIGTERM: unwind, no temp file left, the lock released
            run_rank(STAGE.cfg(a), a.out, **args)
    except (ValueError, FileNotFoundError, LockedError) as e:
        print(f"eagle3 train (rank {int(os.environ.get('RANK', '0'))}): error: {e}", file=sys.stderr)
        return 2
    except (stop.Stopped, KeyboardInterrupt) as e:
        print(f"eagle3 train (rank {int(os.environ.get('RANK', '0'))}): {stop.message(e)}", file=sys.stderr)
        return stop.exit_code(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
