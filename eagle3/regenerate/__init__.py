"""Stage 0 (optional): the target rewrites every assistant turn of a chat dataset.

    regenerate(model, data, out, cfg) -> RegeneratedData (regenerated.jsonl, read by `eagle3 prepare`)

Backends: hf.py (transformers, batched) and vllm.py (GPU host); the driver is run.py.
"""
from __future__ import annotations

import logging
import sys

from eagle3.config import RegenConfig
from eagle3.flags import MODEL, OUT, REUSE, TRUST
from eagle3.stage import Stage, lazy_exports
from eagle3.storage.manifests import RegeneratedData

__getattr__ = lazy_exports("eagle3.regenerate.run")  # OUT_FILE, progress_line, read_records, regenerate


def _console(p: dict) -> None:
    from eagle3.regenerate.run import progress_line

    print(progress_line(p), file=sys.stderr, flush=True)


def _run(out, cfg: RegenConfig, *, model, data, reuse=(), trust_remote_code: bool = False,
        progress=None) -> RegeneratedData:
    """A progress callback (the counts so far) replaces the console's line per chunk."""
    from eagle3.regenerate.run import regenerate

    return regenerate(model, data, out, cfg, reuse=reuse or (), trust_remote_code=trust_remote_code,
                      progress=progress or _console)


def _inputs(cfg: RegenConfig, *, model, data, trust_remote_code: bool = False, **_) -> dict:
    # the output's format is part of the key: a new file layout must not hit an old cache entry
    from eagle3.regenerate.resume import FORMAT
    from eagle3.regenerate.run import inputs

    return {"format": [RegeneratedData.format_version, FORMAT], **inputs(model, data, cfg, trust_remote_code)}


def summary(m: RegeneratedData) -> dict:
    return {"records_read": m.records_read, "records_written": m.records_written, "skipped": m.skipped,
            "turns_written": m.turns_written, "turns_cut": m.turns_cut, "file": m.file, **m.stats}


def headline(m: RegeneratedData) -> str:
    return (f"{m.records_written:,} of {m.records_read:,} records written, {m.turns_written:,} turns, "
            f"{m.stats.get('tokens_per_second')} tok/s")


def _main(a) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.threads:
        __import__("torch").set_num_threads(a.threads)
    STAGE.command(a)


STAGE = Stage(
    name="regenerate", help="stage 0 (optional): rewrite every assistant turn with the target itself",
    config=RegenConfig, manifest=RegeneratedData, locked=True, main=_main,
    aliases={"tensor_parallel_size": "--tp"},
    flags=(MODEL, ("--data", dict(required=True, help="ShareGPT JSON, JSONL, Parquet, HF datasets dir, or 'sharegpt'")),
           OUT, TRUST, REUSE),
    options=(("--threads", dict(type=int, help="hf on CPU: torch threads (default: torch's)")),),
    run=_run, inputs=_inputs, summary=summary, headline=headline,
)
