"""Stage 2: hidden-state extraction (transformers or vLLM backend) into a sharded, checksummed store, or,
online, into the bounded spool a trainer reads as it is filled (`eagle3 produce`).

    run_extract(model, prepared, out, cfg)  -> HiddenStates manifest
    run_range(model, prepared, out, cfg, k) -> HiddenRange   (range k of cfg.workers, on its own worker)
    commit_ranges(model, prepared, out, cfg) -> HiddenStates (the ranges' shards moved into one store)
    produce(model, prepared, spool, cfg, order, spool_bytes)  -> SpooledStates manifest

The store's format and its reader (`eagle3.storage.store.open_store`) live below the stages: training reads it.
"""
from __future__ import annotations

import json

from eagle3.config import SPOOL_WAIT_S, ExtractConfig
from eagle3.flags import MODEL, OUT, PREPARED, REUSE, TRUST, UserError
from eagle3.stage import Command, Stage, lazy_exports
from eagle3.storage.manifests import HiddenRange, HiddenStates

__getattr__ = lazy_exports("eagle3.extract.run")  # run_extract, inputs


def _run(out, cfg: ExtractConfig, *, model, prepared, reuse=(), trust_remote_code: bool = False,
         part: int | None = None, commit: bool = False, progress=None) -> HiddenStates | HiddenRange:
    """A progress callback (tokens done, total) replaces the console's bar. `part`: only that range of cfg.workers
    (HiddenRange); `commit`: only the commit of the finished ranges."""
    from eagle3.extract.ranges import commit_ranges, run_range
    from eagle3.extract.run import run_extract

    if part is not None and commit:
        raise UserError("extract: --part runs one range and --commit commits them all; give one of the two")
    if part is not None:
        return run_range(model, prepared, out, cfg, part, reuse=list(reuse or []), progress=progress,
                         show_progress=progress is None, trust_remote_code=trust_remote_code)
    if commit:
        return commit_ranges(model, prepared, out, cfg, trust_remote_code=trust_remote_code)
    return run_extract(model, prepared, out, cfg, reuse=list(reuse or []), progress=progress,
                       show_progress=progress is None, trust_remote_code=trust_remote_code)


def _inputs(cfg: ExtractConfig, *, model, prepared, trust_remote_code: bool = False, **_) -> dict:
    from eagle3.extract.resume import inputs

    return inputs(model, prepared, cfg, trust_remote_code)


def summary(m: HiddenStates | HiddenRange) -> dict:
    if isinstance(m, HiddenRange):
        return {"range": f"{m.part} of {m.parts}", "shards": len(m.shards), "num_tokens": m.num_tokens, **m.stats}
    return {"layer_ids": m.layer_ids, "storage": m.storage, "num_samples": m.num_samples, "num_tokens": m.num_tokens,
            "shards": len(m.shards), **m.stats}


def headline(m: HiddenStates) -> str:
    s = m.stats
    return (f"{m.num_samples:,} samples, {m.num_tokens:,} tokens ({s.get('tokens_computed', 0) or 0:,} computed "
            f"at {s.get('tokens_per_second')} tok/s), {len(m.shards)} shards")


STAGE = Stage(
    name="extract", help="stage 2: store the target's aux + final hidden states of prepared samples",
    config=ExtractConfig, manifest=HiddenStates, gpu=True,  # locked in the library: a range locks its own dir
    aliases={"aux_layer_ids": "--aux-layers", "tensor_parallel_size": "--tp", "pipeline_parallel_size": "--pp"},
    flags=(MODEL, PREPARED, OUT, TRUST, REUSE,
           ("--part", dict(type=int, default=None, help="several workers: extract only range K (0 to --workers - 1) of "
                           "the shard plan, into OUT/ranges/ (run one per host, at once; OUT on storage they share)")),
           ("--commit", dict(action="store_true", help="several workers: once every range is finished, move their "
                             "shards into one store in OUT (index + manifest)"))),
    run=_run, inputs=_inputs, summary=summary, headline=headline,
)


def _produce(a) -> None:
    """`eagle3 produce`: the trainer's config (its read order) and the budget come from a pipeline config's
    `train` section and `spool_bytes`, or from the flags."""
    from eagle3.config import PipelineConfig, TrainConfig, load_section
    from eagle3.extract.online import produce
    from eagle3.flags import from_flags

    cfg = from_flags(ExtractConfig, a, load_section(a.config, "extract") if a.config else None)
    pipe = PipelineConfig.from_file(a.config) if a.config and "train" in load_section(a.config, "") else None
    train = (TrainConfig.model_validate(load_section(a.train_config, "train")) if a.train_config
             else pipe.train if pipe else TrainConfig())
    from eagle3.runtime.progress import Meter

    spool_bytes = a.spool_bytes or (pipe.spool_bytes if pipe else PipelineConfig().spool_bytes)
    meter = Meter("produce", 0, "tokens", bar=True)

    def progress(done: int, total: int, held: int) -> None:
        meter.update(done, f"spool {held / 2**20:,.1f}/{spool_bytes / 2**20:,.1f} MiB", total=total)

    with meter.ticking():
        m = produce(a.model, a.prepared, a.out, cfg, train.read_order(a.world or train.world), spool_bytes,
                    part=a.part, wait_s=a.wait_s, progress=progress, trust_remote_code=a.trust_remote_code)
    meter.close()
    print(json.dumps({"out": a.out, "spool_bytes": m.spool_bytes, "windows": m.num_windows, **m.stats}, indent=1))


PRODUCE = Command(
    name="produce", help="online: fill a trainer's spool with the target's hidden states as it reads them "
    "(run `eagle3 train --online --hidden SPOOL` beside it)",
    # not one writer per --out: several producers share it (each part is locked on its own, in `produce`)
    main=_produce, config=ExtractConfig, aliases=STAGE.aliases,
    flags=(MODEL, PREPARED, ("--out", dict(required=True, help="the spool dir (the trainer's --hidden)")), TRUST,
           ("--config", dict(default=None, help="a pipeline config (its extract and train sections and spool_bytes) "
                             "or an extract config; flags override it")),
           ("--train-config", dict(default=None, help="the trainer's config file (its read order: seed, pack_tokens, "
                                   "epochs, max_steps, grad_accum, val_max_packs); default: --config's train section")),
           ("--world", dict(type=int, default=None, help="the trainer's ranks (default its nnodes x nproc_per_node)")),
           ("--spool-bytes", dict(type=int, default=None, help="the spool's cap in bytes (default: the config's "
                                  "spool_bytes, 4 GiB)")),
           ("--wait-s", dict(type=float, default=SPOOL_WAIT_S, help="fail when the trainer has shown no sign of "
                             "life for this many seconds while the producer waits on it")),
           ("--part", dict(type=int, default=None, help="several workers: this is producer K (0 to --workers - 1) of "
                           "those filling the spool at once (one per host, each its own engine; the spool on storage "
                           "they share)"))),
)
