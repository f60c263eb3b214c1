"""The `eagle3` library commands: flags generated from each stage's config (field descriptions as help,
as in the Prefect form) plus the few that are not config fields; each calls one library function with
the config whole. A user error prints one line `eagle3 <cmd>: error: ...` and exits 2 (EAGLE3_DEBUG=1:
traceback). `eagle3 run` is added by flows/cli.py, the installed entry point: the library imports no flows.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from eagle3 import config as C
from eagle3.storage.lock import RunLock
from eagle3.train import __main__ as T


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


def _dump(out: str, m, *fields: str, **extra) -> None:
    print(json.dumps({"out": out, **{f: getattr(m, f) for f in fields}, **extra}, indent=1, default=str))


# ---------------------------------------------------------------- the commands
def _assets(a) -> None:
    from eagle3.assets import materialize_smollm2

    print(materialize_smollm2(a.out))


def _prepare(a) -> None:
    from eagle3.prepare import prepare

    m = prepare(a.model, a.out, C.from_flags(C.PrepareConfig, a), trust_remote_code=a.trust_remote_code)
    _dump(a.out, m, "records_read", "records_kept", "skipped", "num_tokens", "num_trainable_tokens",
          "unreadable_tail_bytes", draft_vocab=m.vocab_map.draft_vocab_size,
          vocab_coverage=round(m.vocab_map.coverage, 6))
    if a.show:
        from eagle3.data.template import show
        from eagle3.model.target import Target
        from eagle3.storage.shards import read_split

        tok = Target.open(a.model, a.trust_remote_code).tokenizer()
        for row in read_split(a.out, "train").slice(0, a.show).to_pylist():
            print(f"\n===== record {row['record_id']} ({len(row['input_ids'])} tokens, "
                  f"{sum(row['loss_mask'])} trainable) =====")
            print(show(tok, row["input_ids"], row["loss_mask"], color=sys.stdout.isatty()))


def _extract(a) -> None:
    from eagle3.extract import run_extract

    m = run_extract(a.model, a.prepared, a.out, C.from_flags(C.ExtractConfig, a), reuse=a.reuse,
                    trust_remote_code=a.trust_remote_code)
    _dump(a.out, m, "layer_ids", "storage", "num_samples", "num_tokens", shards=len(m.shards), **m.stats)


def _verifier(a) -> None:
    from eagle3.verifier import extract_verifier

    m = extract_verifier(a.model, a.prepared, a.out)
    _dump(a.out, m, "architecture", "tied_embeddings", tensors={k: v.shape for k, v in m.tensors.items()})


def _train(a) -> None:
    import subprocess

    cfg = C.from_flags(C.TrainConfig, a, C.load_section(a.config, "train") if a.config else None)
    if cfg.nproc_per_node == 1:  # one process trains here; more go through torchrun (several nodes: run it yourself)
        return T.run(cfg, a.hidden, a.verifier, a.out, a.verifier_name, a.restart_on_mismatch, a.replay)
    rc = subprocess.call(T.command(a.hidden, a.verifier, a.out, cfg, a.verifier_name, a.restart_on_mismatch, a.replay))
    if rc:
        raise UserError(f"torchrun exited with status {rc}")


def _eval(a) -> None:
    from eagle3.eval.run import evaluate

    m = evaluate(a.model, a.draft, a.out, C.from_flags(C.EvalConfig, a), trust_remote_code=a.trust_remote_code,
                 progress=lambda i, n: print(f"eval: {i}/{n} prompts", file=sys.stderr, flush=True))
    _dump(a.out, m, "mode", "draft_format", "k", "num_prompts", "acceptance_length", "acceptance_length_ci",
          "per_position_acceptance", "lossless", "tokens_per_second", "target_tokens_per_second", "speedup_vs_target")


def _replay_set(a) -> None:
    from eagle3.eval.replay import build_replay_set

    if a.threads:
        __import__("torch").set_num_threads(a.threads)
    d = build_replay_set(a.model, a.prompts, a.limit, a.max_new_tokens, a.aux_layers,
                         trust_remote_code=a.trust_remote_code, cache=a.cache,
                         progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(d)  # the last line names the set (the train task reads it)


def _verify(a) -> None:
    from eagle3.checksums import verify_tree

    bad = 0
    for f in verify_tree(a.dir, deep=a.deep):
        print(f"{'OK ' if not f.bad else 'BAD'} {f.kind:<9} {f.stage_dir} ({f.checked} files checked)")
        for b in f.bad:
            print(f"    {b}")
        bad += len(f.bad)
    if bad:
        raise UserError(f"{bad} problem(s) found under {a.dir}")


def _regenerate(a) -> None:
    import logging

    from eagle3.regenerate import regenerate

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.threads:
        __import__("torch").set_num_threads(a.threads)

    def progress(p: dict) -> None:
        print(f"regenerate: {p['records_read']} records read, {p['records_written']} written, "
              f"{p['tokens_generated']} tokens at {p['tokens_per_second']:.1f} tok/s", file=sys.stderr, flush=True)

    m = regenerate(a.model, a.data, a.out, C.from_flags(C.RegenConfig, a), reuse=a.reuse, progress=progress,
                   trust_remote_code=a.trust_remote_code)
    _dump(a.out, m, "records_read", "records_written", "skipped", "turns_written", "turns_cut",
          file=f"{a.out}/{m.file}", **m.stats)


# ---------------------------------------------------------------- the parser
MODEL = ("--model", dict(required=True, help="target model: an HF dir (config.json, safetensors, tokenizer)"))
OUT = ("--out", dict(required=True, help="output dir (rerun the same command to resume)"))
PREPARED = ("--prepared", dict(required=True, help="output dir of `eagle3 prepare`"))
TRUST = ("--trust-remote-code", dict(action="store_true", help="run the target's own tokenizer code (auto_map in "
                                     "tokenizer_config.json), e.g. Kimi-K2.5's tiktoken tokenizer; off by default"))
REUSE = ("--reuse", dict(action="append", default=[], metavar="DIR", help="an earlier output dir whose samples "
                         "(same content and settings) are copied instead of recomputed (repeatable)"))
# name: (help, function, config, flag aliases, extra flags)
COMMANDS = {
    "assets": ("materialize the offline demo target model", _assets, None, {},
               [("name", dict(choices=["smollm2"], help="which asset")),
                ("--out", dict(required=True, help="output HF model dir"))]),
    "prepare": ("stage 1: render, mask and tokenize conversations; build the draft vocab", _prepare, C.PrepareConfig,
                {},
                [MODEL, OUT, TRUST, ("--show", dict(type=int, default=0, metavar="N", help="print N samples with the "
                                                    "trainable (loss-masked) spans highlighted"))]),
    "extract": ("stage 2: store the target's aux + final hidden states of prepared samples", _extract, C.ExtractConfig,
                {"aux_layer_ids": "--aux-layers", "tensor_parallel_size": "--tp", "pipeline_parallel_size": "--pp"},
                [MODEL, PREPARED, OUT, TRUST, REUSE]),
    "verifier": ("stage 3: read the target's embedding, final norm and lm_head", _verifier, None, {},
                 [MODEL, PREPARED, OUT]),
    "train": ("stage 4: train the EAGLE-3 draft (torchrun for N > 1 processes)", _train, C.TrainConfig, T.ALIASES,
              T.FLAGS),
    "eval": ("stage 5: acceptance length, speedup and a lossless check of a draft head", _eval, C.EvalConfig, {},
             [MODEL,
              ("--draft", dict(required=True,
                               help="draft dir: our final/, a native vLLM EAGLE-3 dir or a speculators dir")),
              OUT, TRUST]),
    "replay-set": ("held-out prompts answered greedily by the target, with their aux states: what `eagle3 train "
                   "--replay` validates on (prints the dir)", _replay_set, None, {},
                   [MODEL, ("--prompts", dict(required=True, help="a prepared dir (its val split), 'mt-bench' or a "
                                              "JSONL of prompts")),
                    ("--limit", dict(type=int, default=32, help="prompts used (default 32)")),
                    ("--max-new-tokens", dict(type=int, default=128, help="tokens per answer at most (default 128)")),
                    ("--aux-layers", dict(type=C.comma_list(int), default=None, metavar="A,B,C",
                                          help="3 aux layer ids (default the target's, as extract uses)")),
                    ("--cache", dict(default=None, help="cache root (default $EAGLE3_CACHE_DIR/replay)")),
                    ("--threads", dict(type=int, help="torch CPU threads (default: torch's)")), TRUST]),
    "verify": ("check every stage dir under DIR against its manifest checksums", _verify, None, {},
               [("dir", dict(help="a run dir (or one stage dir)")),
                ("--deep", dict(action="store_true", help="re-read every byte, even of files this host already "
                                "hashed at their current identity (size, mtime, ctime, inode)"))]),
    "regenerate": ("stage 0 (optional): rewrite every assistant turn with the target itself", _regenerate,
                   C.RegenConfig, {"tensor_parallel_size": "--tp"},
                   [MODEL,
                    ("--data", dict(required=True,
                                    help="ShareGPT JSON, JSONL, Parquet, HF datasets dir, or 'sharegpt'")),
                    OUT, TRUST, REUSE,
                    ("--threads", dict(type=int, help="hf on CPU: torch threads (default: torch's)"))]),
}
_LOCKED = {"prepare", "extract", "verifier", "eval", "regenerate"}  # train locks in its rank-0 process


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `--mod x` must never be read as `--model x`
    ap = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, (help_text, func, cfg, aliases, extra) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        for flag, kw in extra:
            p.add_argument(flag, **kw)
        if cfg is not None:
            C.add_flags(p, cfg, aliases)
        p.set_defaults(func=func)
    return ap


def one_line(e: BaseException) -> str:
    """The error as one line (a pydantic ValidationError: each field, its problem and the value given)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        return f"invalid {e.title}: " + "; ".join(
            f"{'.'.join(map(str, x['loc'])) or 'value'}: {x['msg']} (got {x['input']!r})" for x in e.errors())
    return str(e)


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    a = (parser or build_parser()).parse_args(argv)
    try:
        # One writer per output dir: a second command on the same dir fails at once, naming the holder.
        out = getattr(a, "out", None) if a.cmd in _LOCKED else None
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
