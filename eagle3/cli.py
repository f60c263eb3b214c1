"""The `eagle3` library commands: one per entry of eagle3/registry.py.

Flags are generated from each command's config (field descriptions as help, as in the Prefect form), plus
the few that are not config fields (eagle3/stage.py). A user error prints one line `eagle3 <cmd>: error: ...`
and exits 2 (EAGLE3_DEBUG=1: traceback). `eagle3 run` is added by flows/cli.py, the installed entry point:
the library imports no flows.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

from eagle3.flags import UserError, one_line
from eagle3.registry import COMMANDS
from eagle3.storage.lock import RunLock


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `--mod x` must never be read as `--model x`
    ap = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in COMMANDS.values():
        p = sub.add_parser(c.name, help=c.help, description=c.help, allow_abbrev=False)
        c.add_to(p)
        p.set_defaults(func=c.main or c.command)  # a stage without its own main: run, then its summary
    return ap


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    a = (parser or build_parser()).parse_args(argv)
    try:
        # One writer per output dir: a second command on the same dir fails at once, naming the holder.
        out = getattr(a, "out", None) if getattr(COMMANDS.get(a.cmd), "locked", False) else None
        with RunLock(out) if out else contextlib.nullcontext():
            a.func(a)
    except (UserError, ValueError, OSError, RuntimeError) as e:  # OSError: unreadable paths, a full disk
        if os.environ.get("EAGLE3_DEBUG"):
            raise
        print(f"eagle3 {a.cmd}: error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
