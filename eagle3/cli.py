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


# ---------------------------------------------------------------- prepare
def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="stage 1: render, mask and tokenize conversations; build the draft vocab")
    p.add_argument("--model", required=True, help="target HF model dir (its tokenizer and chat template are used)")
    p.add_argument("--data", required=True, help="ShareGPT JSON, JSONL, Parquet, HF datasets dir, or 'sharegpt'")
    p.add_argument("--out", required=True, help="output dir")
    p.add_argument("--max-len", type=int, default=2048, help="truncate samples to N tokens (default 2048)")
    p.add_argument("--limit", type=int, default=None, help="read only the first N conversations")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft vocab size (default min(32000, vocab))")
    p.add_argument("--val-fraction", type=float, default=0.02, help="held-out share (default 0.02)")
    p.add_argument("--seed", type=int, default=0, help="split seed")
    p.add_argument("--same-role", choices=["merge", "drop"], default="merge",
                   help="consecutive same-role turns: merge them (default) or drop the conversation")
    p.add_argument("--show", type=int, default=0, metavar="N",
                   help="print N samples with the trainable (loss-masked) spans highlighted")
    p.set_defaults(func=_cmd_prepare)


def _cmd_prepare(a) -> None:
    import logging

    from eagle3.config import PrepareConfig
    from eagle3.data.prepare import prepare

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = PrepareConfig(data=a.data, max_len=a.max_len, limit=a.limit, draft_vocab=a.draft_vocab,
                        val_fraction=a.val_fraction, seed=a.seed, same_role=a.same_role)
    m = prepare(a.model, a.out, cfg)
    print(json.dumps({"out": a.out, "records_read": m.records_read, "records_kept": m.records_kept,
                      "skipped": m.skipped, "num_tokens": m.num_tokens,
                      "num_trainable_tokens": m.num_trainable_tokens,
                      "draft_vocab": m.vocab_map.draft_vocab_size,
                      "vocab_coverage": round(m.vocab_map.coverage, 6),
                      "unreadable_tail_bytes": m.unreadable_tail_bytes}, indent=1))
    if a.show:
        from eagle3.data.prepare import load_tokenizer, read_split
        from eagle3.data.template import show

        tok = load_tokenizer(a.model)
        t = read_split(a.out, "train").slice(0, a.show).to_pylist()
        for row in t:
            print(f"\n===== record {row['record_id']} ({len(row['input_ids'])} tokens, "
                  f"{sum(row['loss_mask'])} trainable) =====")
            print(show(tok, row["input_ids"], row["loss_mask"], color=sys.stdout.isatty()))


# ---------------------------------------------------------------- run
def _add_run(sub) -> None:
    p = sub.add_parser("run", help="run the whole pipeline as a Prefect flow (embedded Prefect, no server needed)")
    p.add_argument("--config", required=True, help="PipelineConfig as YAML or JSON")
    p.add_argument("--run-dir", default=None, help="override the config's run_dir")
    p.set_defaults(func=_cmd_run)


def _cmd_run(a) -> None:
    from eagle3.config import PipelineConfig

    cfg = PipelineConfig.from_file(a.config)
    if a.run_dir:
        cfg = cfg.model_copy(update={"run_dir": a.run_dir})
    # With no PREFECT_API_URL Prefect starts a temporary local server; it needs ~18 s cold
    # here, against a 20 s default timeout (REFERENCE §3).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.pipeline import pipeline

    result = pipeline(cfg)
    print(json.dumps(result, indent=1))


# ---------------------------------------------------------------- main
_ADDERS = [_add_assets, _add_prepare, _add_run]


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
