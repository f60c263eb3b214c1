"""Command-line flags: one per field of a config, generated (`add_flags`, `from_flags`), and the few the
commands share that are not config fields; a user error as one line (`one_line`)."""
from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

M = typing.TypeVar("M", bound=BaseModel)


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


MODEL = ("--model", dict(required=True, help="target model: an HF dir (config.json, safetensors, tokenizer)"))
OUT = ("--out", dict(required=True, help="output dir (rerun the same command to resume)"))
PREPARED = ("--prepared", dict(required=True, help="output dir of `eagle3 prepare`"))
TRUST = ("--trust-remote-code", dict(action="store_true", help="run the target's own tokenizer code (auto_map in "
                                     "tokenizer_config.json), e.g. Kimi-K2.5's tiktoken tokenizer; off by default"))
REUSE = ("--reuse", dict(action="append", default=[], metavar="DIR", help="an earlier output dir whose samples "
                         "(same content and settings) are copied instead of recomputed (repeatable)"))


def _flag_type(ann: Any) -> tuple[Any, bool]:
    """(the field's type without None, whether None is allowed)."""
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else ann), True
    return ann, False


def comma_list(elem: type):
    def parse(text: str) -> list:
        try:
            return [elem(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {elem.__name__} values, got {text!r}") from None

    return parse


def json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return v


def add_flags(p: argparse.ArgumentParser, model: type[BaseModel], aliases: dict[str, str] | None = None,
              skip: tuple[str, ...] = ()) -> None:
    """One flag per field of a config: `--field-name`, the field's description as help (the same text the
    Prefect form shows), the config's own default. Booleans get `--x` / `--no-x`, Literals their choices,
    lists comma-separated values. Unset flags stay None: `from_flags` then keeps the config's default."""
    for name, f in model.model_fields.items():
        ann, _ = _flag_type(f.annotation)
        if name in skip or (isinstance(ann, type) and issubclass(ann, BaseModel)):
            continue
        flags = ["--" + name.replace("_", "-")] + ([aliases[name]] if aliases and name in aliases else [])
        default = f.default_factory() if f.default_factory is not None else f.default
        help_text = (f.description or "").replace("%", "%%") + ("" if default is None else f" (default: {default})")
        kw: dict[str, Any] = {"dest": name, "default": None, "help": help_text}
        origin, args = typing.get_origin(ann), typing.get_args(ann)
        if ann is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin is Literal:
            kw["choices"] = list(args)
        elif origin in (list, tuple):
            kw.update(type=comma_list(args[0]), metavar="A,B,...")
        elif origin is dict:
            kw.update(type=json_object, metavar="JSON")
        elif ann in (int, float, str):
            kw["type"] = ann
        else:
            continue
        p.add_argument(*flags, **kw)


def from_flags(model: type[M], a: argparse.Namespace, base: dict[str, Any] | None = None) -> M:
    """The config `a`'s flags describe: `base` (e.g. a config file's values), overridden by every flag given."""
    given = {k: v for k, v in vars(a).items() if k in model.model_fields and v is not None}
    return model.model_validate({**(base or {}), **given})


def one_line(e: BaseException) -> str:
    """The error as one line (a pydantic ValidationError: each field, its problem and the value given)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        return f"invalid {e.title}: " + "; ".join(
            f"{'.'.join(map(str, x['loc'])) or 'value'}: {x['msg']} (got {x['input']!r})" for x in e.errors())
    return str(e)
