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
from eagle3 import flags as F
from eagle3.flags import MODEL, OUT, PREPARED, REUSE, TRUST, UserError
from eagle3.storage.lock import RunLock
from eagle3.train import __main__ as T


def _dump(out: str, m, *fields: str, **extra) -> None:
    print(json.dumps({"out": out, **{f: getattr(m, f) for f in fields}, **extra}, indent=1, default=str))


# ---------------------------------------------------------------- the commands
def _assets(a) -> None:
    from eagle3.assets import materialize_smollm2

    print(materialize_smollm2(a.out))


def _prepare(a) -> None:
    from eagle3.prepare import prepare

    m = prepare(a.model, a.out, F.from_flags(C.PrepareConfig, a), trust_remote_code=a.trust_remote_code)
    _dump(a.out, m, "records_read", "records_kept", "skipped", "num_tokens", "num_trainable_tokens",
          "unreadable_tail_bytes", draft_vocab=m.vocab_map.draft_vocab_size,
          vocab_coverage=round(m.vocab_map.coverage, 6))
    if a.show:
        from eagle3.prepare import show_samples

        for text in show_samples(a.model, a.out, a.show, a.trust_remote_code, color=sys.stdout.isatty()):
            print(text)


def _extract(a) -> None:
    from eagle3.extract import run_extract

    m = run_extract(a.model, a.prepared, a.out, F.from_flags(C.ExtractConfig, a), reuse=a.reuse,
                    trust_remote_code=a.trust_remote_code)
    _dump(a.out, m, "layer_ids", "storage", "num_samples", "num_tokens", shards=len(m.shards), **m.stats)


def _verifier(a) -> None:
    from eagle3.verifier import extract_verifier

    m = extract_verifier(a.model, a.prepared, a.out)
    _dump(a.out, m, "architecture", "tied_embeddings", tensors={k: v.shape for k, v in m.tensors.items()})


def _train(a) -> None:
    import subprocess

    cfg = F.from_flags(C.TrainConfig, a, C.load_section(a.config, "train") if a.config else None)
    if cfg.nproc_per_node == 1:  # one process trains here; more go through torchrun (several nodes: run it yourself)
        return T.run(cfg, a.hidden, a.verifier, a.out, a.verifier_name, a.restart_on_mismatch, a.replay)
    rc = subprocess.call(T.command(a.hidden, a.verifier, a.out, cfg, a.verifier_name, a.restart_on_mismatch, a.replay))
    if rc:
        raise UserError(f"torchrun exited with status {rc}")


def _eval(a) -> None:
    from eagle3.eval.run import evaluate

    m = evaluate(a.model, a.draft, a.out, F.from_flags(C.EvalConfig, a), trust_remote_code=a.trust_remote_code,
                 progress=lambda i, n: print(f"eval: {i}/{n} prompts", file=sys.stderr, flush=True))
    _dump(a.out, m, "mode", "draft_format", "k", "num_prompts", "acceptance_length", "acceptance_length_ci",
          "per_position_acceptance", "lossless", "tokens_per_second", "target_tokens_per_second", "speedup_vs_target")


def _replay_set(a) -> None:
    from eagle3.eval.replay import build_replay_set

    cfg = F.from_flags(C.ReplaySetConfig, a)
    if cfg.threads:
        __import__("torch").set_num_threads(cfg.threads)
    d = build_replay_set(a.model, a.prompts, cfg.limit, cfg.max_new_tokens, cfg.aux_layer_ids, cache=cfg.cache,
                         trust_remote_code=a.trust_remote_code,
                         progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(d)  # the last line names the set


def _verify(a) -> None:
    from eagle3.checksums import report

    if bad := report(a.dir, a.deep, print):
        raise UserError(f"{bad} problem(s) found under {a.dir}")


def _regenerate(a) -> None:
    import logging

    from eagle3.regenerate import progress_line, regenerate

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.threads:
        __import__("torch").set_num_threads(a.threads)
    m = regenerate(a.model, a.data, a.out, F.from_flags(C.RegenConfig, a), reuse=a.reuse,
                   trust_remote_code=a.trust_remote_code,
                   progress=lambda p: print(progress_line(p), file=sys.stderr, flush=True))
    _dump(a.out, m, "records_read", "records_written", "skipped", "turns_written", "turns_cut",
          file=f"{a.out}/{m.file}", **m.stats)


# ---------------------------------------------------------------- the parser
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
                   "--replay` validates on (prints the dir)", _replay_set, C.ReplaySetConfig,
                   {"aux_layer_ids": "--aux-layers"},
                   [MODEL, ("--prompts", dict(required=True, help="a prepared dir (its val split), 'mt-bench' or a "
                                              "JSONL of prompts")), TRUST]),
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
            F.add_flags(p, cfg, aliases)
        p.set_defaults(func=func)
    return ap


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
        print(f"eagle3 {a.cmd}: error: {F.one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
