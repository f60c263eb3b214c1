"""Stage 2: hidden-state extraction (transformers or vLLM backend) into a sharded, checksummed store.

    run_extract(model, prepared, out, cfg)  -> HiddenStates manifest

The store's format and its reader (`eagle3.storage.store.open_store`) live below the stages: training reads it.
"""
from __future__ import annotations

from eagle3.config import ExtractConfig
from eagle3.flags import MODEL, OUT, PREPARED, REUSE, TRUST
from eagle3.stage import Stage, lazy_exports
from eagle3.storage.manifests import HiddenStates

__getattr__ = lazy_exports("eagle3.extract.run")  # run_extract, inputs


def _run(out, cfg: ExtractConfig, *, model, prepared, reuse=(), trust_remote_code: bool = False,
        progress=None) -> HiddenStates:
    """A progress callback (tokens done, total) replaces the console's bar."""
    from eagle3.extract.run import run_extract

    return run_extract(model, prepared, out, cfg, reuse=list(reuse or []), progress=progress,
                       show_progress=progress is None, trust_remote_code=trust_remote_code)


def _inputs(cfg: ExtractConfig, *, model, prepared, trust_remote_code: bool = False, **_) -> dict:
    from eagle3.extract.run import inputs

    return inputs(model, prepared, cfg, trust_remote_code)


def summary(m: HiddenStates) -> dict:
    return {"layer_ids": m.layer_ids, "storage": m.storage, "num_samples": m.num_samples, "num_tokens": m.num_tokens,
            "shards": len(m.shards), **m.stats}


def headline(m: HiddenStates) -> str:
    s = m.stats
    return (f"{m.num_samples:,} samples, {m.num_tokens:,} tokens ({s.get('tokens_computed', 0) or 0:,} computed "
            f"at {s.get('tokens_per_second')} tok/s), {len(m.shards)} shards")


STAGE = Stage(
    name="extract", help="stage 2: store the target's aux + final hidden states of prepared samples",
    config=ExtractConfig, manifest=HiddenStates, locked=True, gpu=True,
    aliases={"aux_layer_ids": "--aux-layers", "tensor_parallel_size": "--tp", "pipeline_parallel_size": "--pp"},
    flags=(MODEL, PREPARED, OUT, TRUST, REUSE),
    run=_run, inputs=_inputs, summary=summary, headline=headline,
)
