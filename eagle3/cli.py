"""The `eagle3` library commands: one per entry of eagle3/registry.py.

Flags are generated from each command's config (field descriptions as help, as in the Prefect form), plus
the few that are not config fields (eagle3/stage.py). An error prints one line `eagle3 <cmd>: error: ...`
and exits 2: bad input names the file and the reason; anything else also names the file that holds its
traceback (`--debug` or EAGLE3_DEBUG=1 prints the traceback instead). SIGINT and SIGTERM stop the command
cleanly (eagle3/runtime/stop.py): one line naming the signal, exit 130 or 143. `eagle3 run` is added by
flows/cli.py, the installed entry point: the library imports no flows.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from eagle3.flags import UserError, one_line
from eagle3.registry import COMMANDS
from eagle3.runtime import stop
from eagle3.storage.lock import RunLock

DEBUG: tuple[str, dict] = ("--debug", dict(action="store_true", help="on an error, print its traceback instead of "
                                           "one line (also EAGLE3_DEBUG=1)"))
# Errors about the user's input or the host: their message is the whole story (a file and a reason).
EXPECTED = (UserError, ValueError, OSError, RuntimeError)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `--mod x` must never be read as `--model x`
    ap = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for c in COMMANDS.values():
        p = sub.add_parser(c.name, help=c.help, description=c.help, allow_abbrev=False)
        c.add_to(p)
        p.add_argument(DEBUG[0], **DEBUG[1])
        p.set_defaults(func=c.main or c.command)  # a stage without its own main: run, then its summary
    return ap


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    a = (parser or build_parser()).parse_args(argv)
    debug = getattr(a, "debug", False) or bool(os.environ.get("EAGLE3_DEBUG"))
    try:
        # One writer per output dir: a second command on the same dir fails at once, naming the holder.
        out = getattr(a, "out", None) if getattr(COMMANDS.get(a.cmd), "locked", False) else None
        with stop.handled(), stop.on_unwind(), RunLock(out) if out else contextlib.nullcontext():
            a.func(a)
    except (stop.Stopped, KeyboardInterrupt) as e:
        print(f"eagle3 {a.cmd}: {stop.message(e)}", file=sys.stderr)
        return stop.exit_code(e)
    except Exception as e:
        if debug:
            raise
        where = "" if isinstance(e, EXPECTED) else f" (traceback: {save_traceback(a.cmd, e)})"
        print(f"eagle3 {a.cmd}: error: {one_line(e)}{where}", file=sys.stderr)
        return 2
    return 0


def save_traceback(cmd: str, e: BaseException) -> Path:
    """Write `e`'s traceback to a file of its own under eagle3's cache dir (the temp dir if that cannot be
    written) and return its path."""
    from eagle3.storage.hashing import cache_dir

    text = "".join(traceback.format_exception(e))
    for d in (cache_dir() / "errors", Path(tempfile.gettempdir())):
        with contextlib.suppress(OSError):
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"eagle3-{cmd}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
            path.write_text(text)
            return path
    return Path("(unwritable)")


if __name__ == "__main__":
    sys.exit(main())
