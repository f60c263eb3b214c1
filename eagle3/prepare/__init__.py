"""Stage 1: render conversations with the target's chat template, mask all but the assistant tokens,
write Parquet shards and build the draft vocabulary (run.py).

    prepare(model, out, cfg)  -> PreparedData manifest
"""
from __future__ import annotations

import sys

from eagle3.config import PrepareConfig
from eagle3.flags import MODEL, OUT, TRUST
from eagle3.stage import Stage, lazy_exports
from eagle3.storage.manifests import PreparedData

__getattr__ = lazy_exports("eagle3.prepare.run")  # VOCAB_FILE, inputs, prepare, show_samples


def summary(m: PreparedData) -> dict:
    return {"records_read": m.records_read, "records_kept": m.records_kept, "skipped": m.skipped,
            "num_tokens": m.num_tokens, "num_trainable_tokens": m.num_trainable_tokens,
            "unreadable_tail_bytes": m.unreadable_tail_bytes, "draft_vocab": m.vocab_map.draft_vocab_size,
            "vocab_coverage": round(m.vocab_map.coverage, 6)}


def headline(m: PreparedData) -> str:
    return f"kept {m.records_kept:,} of {m.records_read:,} conversations, {m.num_tokens:,} tokens"


def _run(out, cfg: PrepareConfig, *, model, trust_remote_code: bool = False, progress: bool = True) -> PreparedData:
    from eagle3.prepare.run import prepare

    return prepare(model, out, cfg, progress=progress, trust_remote_code=trust_remote_code)


def _inputs(cfg: PrepareConfig, *, model, trust_remote_code: bool = False, **_) -> dict:
    from eagle3.prepare.run import inputs

    return inputs(model, cfg, trust_remote_code)


def _main(a) -> None:
    STAGE.command(a)
    if a.show:
        from eagle3.prepare.run import show_samples

        for text in show_samples(a.model, a.out, a.show, a.trust_remote_code, color=sys.stdout.isatty()):
            print(text)


STAGE = Stage(
    name="prepare", help="stage 1: render, mask and tokenize conversations; build the draft vocab",
    config=PrepareConfig, manifest=PreparedData, locked=True, main=_main,
    flags=(MODEL, OUT, TRUST),
    options=(("--show", dict(type=int, default=0, metavar="N",
                             help="print N samples with the trainable (loss-masked) spans highlighted")),),
    run=_run, inputs=_inputs, summary=summary, headline=headline,
)
