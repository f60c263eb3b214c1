"""`eagle3 eval`: measure an EAGLE-3 head on its target.

    evaluate(model_dir, draft_dir, out, cfg: EvalConfig) -> EvalReport (report.json, acceptance.png)

- live (default): chain speculative decoding against plain greedy decoding of the same prompts, in
  the same process (`eagle3.eval.decode`): tau, per-position acceptance, tokens/s, speedup, and a
  lossless check of every output;
- replay: the exact tau of those rounds from the target's cached greedy answers and one TTT pass of
  the draft (`eagle3.eval.replay`), with a 95% bootstrap CI; no speed, no lossless check, unless
  `live_check` N > 0 also decodes the first N prompts live (report `live`: lossless and speed from them);
- backend vllm (GPU host, live only): the same report from vLLM's own counters (`eagle3.eval.vllm`).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3.config import EvalConfig
from eagle3.eval.decode import DraftProposer, measure
from eagle3.eval.prompts import Conversation, load_prompts, prompts_fingerprint
from eagle3.eval.report import finish_report
from eagle3.model.draft import Eagle3Draft
from eagle3.model.formats import dir_fingerprint, load_draft
from eagle3.model.target import Target
from eagle3.runtime.heap import retain_freed_memory
from eagle3.storage.manifests import EvalReport

log = logging.getLogger("eagle3.eval")


def inputs(model_dir: str | Path, draft_dir: str | Path, cfg: EvalConfig,
           trust_remote_code: bool = False) -> dict[str, Any]:
    """What a report depends on: the target's, the head's and the prompts' content, and the settings.
    The stage's "already done" check and the Prefect task's cache key are both this dict."""
    return {"model": Target.open(model_dir, trust_remote_code).fingerprint(), "draft": dir_fingerprint(draft_dir),
            "prompts": prompts_fingerprint(cfg.prompts),
            # where the replay cache lives is a place, not content: moving it changes no result
            "config": cfg.model_dump(mode="json", exclude={"prompts", "replay_cache"})}


def load_target(model_dir: str | Path, device: str | torch.device | None = None,
                trust_remote_code: bool = False) -> tuple[torch.nn.Module, Any, set[int]]:
    """(causal LM in eval mode, tokenizer, stop ids); fp32 on CPU (faster there), bf16 on CUDA."""
    target = Target.open(model_dir, trust_remote_code)
    tok = target.tokenizer()  # ValueError naming the dir when it has no tokenizer
    return target.load_model(head=True, device=device), tok, target.stop_ids()


def evaluate(model_dir: str | Path, draft_dir: str | Path, out: str | Path, cfg: EvalConfig, *,
             device: str | None = None, progress: Callable[[str], None] | None = None,
             trust_remote_code: bool = False) -> EvalReport:
    """Measure a draft head as `cfg` says; write report.json, acceptance.png, samples.jsonl, manifest.json.

    `progress` gets a line at least every 20 s of long work (the replay's answers and aux states: steps or
    tokens, rate, ETA) and after each prompt decoded live; default: the `eagle3.eval` logger.

    A finished `out` with the same inputs and config is returned as is. `cfg.threads` sets torch's CPU
    threads for decoding: at batch size 1 it is latency-bound, and on a shared, loaded CPU OpenMP threads
    spin against other processes (SmolLM2 here: one MT-Bench prompt took ~35 s at 1 thread, ~4 min at 2).
    Replay's batched work (the target's answers, its aux states, the draft's pass) is compute-bound and
    runs at `cfg.build_threads` (default: torch's, all cores): the demo's 24-question cache built 1.7x
    faster at 2 threads on packed linears than at 1 on stock ones (`benchmarks/speed/replay.py --compare-build`).
    """
    fp = inputs(model_dir, draft_dir, cfg, trust_remote_code)
    if EvalReport.exists(out):
        done = EvalReport.read(out)
        if done.inputs == fp:
            return done
    if cfg.backend == "vllm":
        if cfg.mode == "replay":
            raise ValueError("mode replay runs on the hf backend (vLLM's own metrics are live by nature)")
        from eagle3.eval.vllm import evaluate_vllm

        return evaluate_vllm(model_dir, draft_dir, out, cfg, fp, trust_remote_code=trust_remote_code)
    build_threads = cfg.build_threads or torch.get_num_threads()  # read before `threads` changes it
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    retain_freed_memory()
    convs, _ = load_prompts(cfg.prompts, cfg.limit)
    model, tok, eos = load_target(model_dir, device, trust_remote_code)
    draft, fmt = load_draft(draft_dir, model_dir, model.get_input_embeddings().weight)
    p = next(model.parameters())
    draft = cast_draft(draft, p.device, p.dtype)
    say = progress or log.info
    t0 = time.perf_counter()

    def prompts_done(i: int, n: int) -> None:
        say(f"eval: {i}/{n} prompts decoded live, {time.perf_counter() - t0:.0f} s in")

    if cfg.mode == "replay":
        with num_threads(build_threads):
            report = replay_report(Target.open(model_dir, trust_remote_code), model, draft, convs, cfg.k,
                                   cfg.max_new_tokens, eos, cfg.replay_cache, say)
        if cfg.live_check:  # a few prompts decoded for real: lossless and speed, next to the exact tau of all
            t0_live = time.perf_counter()
            live = measure(model, tok, DraftProposer(draft), draft.config.aux_layer_ids, convs[: cfg.live_check],
                           cfg.k, cfg.live_max_new_tokens or cfg.max_new_tokens, eos,
                           progress=lambda i, n: say(f"eval: live check {i}/{n} prompts, "
                                                     f"{time.perf_counter() - t0_live:.0f} s in"))
            report = with_live_check(report, live)
    else:
        report = measure(model, tok, DraftProposer(draft), draft.config.aux_layer_ids, convs, cfg.k,
                         cfg.max_new_tokens, eos, progress=prompts_done)
        report["mode"] = "live"
    report.update(backend="hf", draft_format=fmt, prompts=str(cfg.prompts), wall_seconds=time.perf_counter() - t0)
    return finish_report(out, report, cfg, model_dir, draft_dir, fp)


def replay_report(target: Target, model: torch.nn.Module, draft: Eagle3Draft, convs: Sequence[Conversation], k: int,
                  max_new_tokens: int, eos: set[int], cache: str | Path | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """`--mode replay`: tau from the target's cached greedy answers and one TTT pass of the draft
    (eagle3/eval/replay.py); `progress` (default: the log) gets the builds' progress and how long each took."""
    from eagle3.eval.replay import aux_states, continuations, replay

    say = progress or log.info
    turns, d, gen_s = continuations(target, model, convs, max_new_tokens, tail=max(k, 8),
                                    cache=Path(cache) if cache else None, progress=say)
    aux, aux_s = aux_states(model.get_decoder(), turns, draft.config.aux_layer_ids, d, progress=say)
    t1 = time.perf_counter()
    report = replay(draft, turns, aux, convs, k, max_new_tokens, eos)
    report["replay_seconds"] = {"continuations": round(gen_s, 2), "aux_states": round(aux_s, 2),
                                "replay": round(time.perf_counter() - t1, 2)}
    report["replay_cache"] = str(d)
    say(f"replay: cache {d} (continuations {gen_s:.1f} s, aux states {aux_s:.1f} s; 0 = cached), "
        f"replay {time.perf_counter() - t1:.1f} s")
    return report


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's CPU thread count set to `n` inside the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def with_live_check(replay: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """A replay report with a live run of some of its prompts: lossless, speed and the samples from the live run
    (its own tau and counts under `live`), tau and the acceptance figures from the replay."""
    keys = ("lossless", "tokens_per_second", "target_tokens_per_second", "speedup_vs_target", "spec_seconds",
            "target_seconds", "cpu_linear")
    out = {**replay, **{k: live[k] for k in keys}, "items": live["items"]}
    out["live"] = {k: live[k] for k in (*keys, "acceptance_length", "per_position_acceptance", "num_prompts",
                                        "num_turns", "num_drafts", "generated_tokens", "max_new_tokens")}
    return out


def cast_draft(draft: Eagle3Draft, device, dtype) -> Eagle3Draft:
    """Move the draft to the target's device and dtype, casting parameters only.

    `module.to(dtype=bf16)` would also cast the rotary module's `inv_freq` buffer: at position
    4,000 a bf16 `inv_freq` puts the angles off by up to 3.6 rad, so the draft would read the wrong
    positions and score low on GPU. vLLM builds cos/sin in fp32 (and transformers keeps inv_freq in
    fp32 when loading in bf16), so the buffers stay as they are; int buffers (d2t, t2d) too.
    """
    draft = draft.to(device=device)
    for p in draft.parameters():
        p.data = p.data.to(dtype)
    return draft
