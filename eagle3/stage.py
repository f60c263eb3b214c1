"""The face every command and stage shows, so that the CLI, the Prefect tasks and the flow iterate over one
registry (eagle3/registry.py) instead of wiring each stage again.

A `Command` is one `eagle3 <name>`: its flags (its config's fields, generated, plus `flags` and `options`)
and `main`, which takes the parsed flags. A `Stage` is a command that writes a stage dir ending in its
manifest:

    run(out, cfg, **args) -> manifest    the library call; `args` are the dests of `flags` (model, prepared, ...)
    inputs(cfg, **args)   -> dict        what the output depends on, as content fingerprints: the stage's
                                         "already done" check and the Prefect task's cache key both use it
    summary(m)            -> dict        the key figures, printed by the command as JSON
    headline(m)           -> str         the key figures in one line, for the flow's log

`run` may take keywords that no flag sets (a progress callback): the tasks pass those themselves. A stage's
command is `Stage.command` unless it sets `main`: the config from `--config` (a file of the stage's config,
or a pipeline config's section of it) with every flag overriding it, then `run`, then the summary.
"""
from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from eagle3 import flags as F

Flag = tuple[str, dict[str, Any]]  # argparse: (flag or positional name, add_argument keywords)
CONFIG: Flag = ("--config", dict(default=None, help="the stage's config as YAML/JSON, or a pipeline config (its "
                                 "section of this stage is read); flags override it"))


def dest(flag: Flag) -> str:
    """The attribute argparse stores a flag under: `--trust-remote-code` -> trust_remote_code."""
    name, kw = flag
    return kw.get("dest") or name.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    main: Callable[[argparse.Namespace], Any] | None = None  # raises UserError/ValueError/OSError on bad input
    config: type | None = None              # a pydantic config: one flag per field, its description as help
    flags: tuple[Flag, ...] = ()            # a stage's inputs besides its config: run()'s keywords
    options: tuple[Flag, ...] = ()          # flags of the command alone (printing, threads), not run()'s
    aliases: dict[str, str] = field(default_factory=dict)  # config field -> flag, where not --field-name
    locked: bool = False                    # one writer per --out: a second command on it fails at once

    def add_to(self, p: argparse.ArgumentParser) -> None:
        for flag, kw in self.flags + self.options:
            p.add_argument(flag, **kw)
        if self.config is not None:
            F.add_flags(p, self.config, self.aliases)


@dataclass(frozen=True)
class Stage(Command):
    manifest: type | None = None            # what the stage writes last, and returns
    run: Callable[..., Any] | None = None
    inputs: Callable[..., dict[str, Any]] | None = None
    summary: Callable[[Any], dict[str, Any]] | None = None
    headline: Callable[[Any], str] | None = None
    gpu: bool = False                       # hops to the GPU pool when the pipeline's stages do

    def add_to(self, p: argparse.ArgumentParser) -> None:
        super().add_to(p)
        if self.config is not None:
            flag, kw = CONFIG
            p.add_argument(flag, **kw)

    def cfg(self, a: argparse.Namespace):
        """The stage's config from parsed flags: --config's file first, the flags given over it."""
        if self.config is None:
            return None
        from eagle3.config import load_section

        return F.from_flags(self.config, a, load_section(a.config, self.name) if a.config else None)

    def args(self, a: argparse.Namespace) -> dict[str, Any]:
        """run()'s keywords from parsed flags."""
        return {dest(f): getattr(a, dest(f)) for f in self.flags if dest(f) != "out"}

    def command(self, a: argparse.Namespace):
        """`eagle3 <stage>`: run it with the parsed flags, print its summary; returns the manifest."""
        m = self.run(a.out, self.cfg(a), **self.args(a))
        print(json.dumps({"out": a.out, **self.summary(m)}, indent=1, default=str))
        return m


def lazy_exports(module: str) -> Callable[[str], Any]:
    """A stage package's `__getattr__`: its names (`prepare`, `run_extract`, ...) load `module` on first use, so
    the registry, and with it `eagle3 --help`, imports no torch or transformers."""
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(importlib.import_module(module), name)

    return __getattr__
