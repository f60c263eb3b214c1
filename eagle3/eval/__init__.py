from __future__ import annotations

import sys

from eagle3.config import EvalConfig, ReplaySetConfig
from eagle3.flags import MODEL, OUT, TRUST
from eagle3.stage import Command, Stage, lazy_exports
from eagle3.storage.manifests import EvalReport

__getattr__ = lazy_exports("eagle3.eval.run")  # evaluate, inputs


def _console(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(out, cfg: EvalConfig, *, model, draft, trust_remote_code: bool = False, progress=None) -> EvalReport:
    """A progress callback (one line of text) replaces the console's progress lines."""
    from eagle3.eval.run import evaluate

    return evaluate(model, draft, out, cfg, trust_remote_code=trust_remote_code, progress=progress or _console)


def _inputs(cfg: EvalConfig, *, model, draft, trust_remote_code: bool = False, **_) -> dict:
    from eagle3.eval.run import inputs

    return inputs(model, draft, cfg, trust_remote_code)


def summary(m: EvalReport) -> dict:
    keys = ("mode", "draft_format", "k", "num_prompts", "acceptance_length", "acceptance_length_ci",
            "per_position_acceptance", "lossless", "tokens_per_second", "target_tokens_per_second",
            "speedup_vs_target")
    return {k: getattr(m, k) for k in keys}


def headline(m: EvalReport) -> str:
    speedup = "n/a (replay)" if m.speedup_vs_target is None else round(m.speedup_vs_target, 2)
    return (f"tau {m.acceptance_length:.3f} at k={m.k} on {m.num_prompts} prompts ({m.mode}), lossless "
            f"{m.lossless}, speedup {speedup}x")


STAGE = Stage(
    name="eval", help="stage 5: acceptance length, speedup and a lossless check of a draft head",
    config=EvalConfig, manifest=EvalReport, locked=True, gpu=True,
    flags=(MODEL, ("--draft", dict(required=True,
                                   help="draft dir: our final/, a native vLLM EAGLE-3 dir or a speculators dir")),
           OUT, TRUST),
    run=_run, inputs=_inputs, summary=summary, headline=headline,
)


def _replay_set(a) -> None:
    from eagle3.eval.replay import build_replay_set
    from eagle3.flags import from_flags

    cfg = from_flags(ReplaySetConfig, a)
    if cfg.threads:
        __import__("torch").set_num_threads(cfg.threads)
    d = build_replay_set(a.model, a.prompts, cfg.limit, cfg.max_new_tokens, cfg.aux_layer_ids, cache=cfg.cache,
                         trust_remote_code=a.trust_remote_code,
                         progress=_console)
    print(d)  # the last line names the set


REPLAY_SET = Command(
    name="replay-set", main=_replay_set, config=ReplaySetConfig, aliases={"aux_layer_ids": "--aux-layers"},
    help="held-out prompts answered greedily by the target, with their aux states: what `eagle3 train --replay` "
         "validates on (prints the dir)",
    flags=(MODEL, ("--prompts", dict(required=True, help="a prepared dir (its val split), 'mt-bench' or a JSONL "
                                     "of prompts")), TRUST),
)
