"""The `eagle3` command. Each subcommand parses its flags and calls one library function.

User errors (bad input, missing files) print one line `eagle3 <cmd>: error: ...` and exit 2;
no traceback. Set EAGLE3_DEBUG=1 to see the traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


# ---------------------------------------------------------------- assets
def _add_assets(sub) -> None:
    p = sub.add_parser("assets", help="materialize the offline demo target model")
    p.add_argument("name", choices=["smollm2"], help="which asset")
    p.add_argument("--out", required=True, help="output HF model dir")
    p.set_defaults(func=_cmd_assets)


def _cmd_assets(a) -> None:
    from eagle3.assets import materialize_smollm2

    print(materialize_smollm2(a.out))


# ---------------------------------------------------------------- main
_ADDERS = [_add_assets]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in _ADDERS:
        add(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        a.func(a)
    except (UserError, ValueError, FileNotFoundError, RuntimeError) as e:
        if os.environ.get("EAGLE3_DEBUG"):
            raise
        print(f"eagle3 {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
