"""The `eagle3` command. Each subcommand parses its flags and calls one library function.

User errors (bad input, missing files) print one line `eagle3 <cmd>: error: ...` and exit 2;
no traceback. Set EAGLE3_DEBUG=1 to see the traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from eagle3.lock import RunLock


class UserError(Exception):
    """An error the user can fix; printed without a traceback."""


def _add_trust(p) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the target's own tokenizer code (auto_map in tokenizer_config.json), e.g. Kimi-K2.5's "
                   "tiktoken tokenizer; off by default")


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
    _add_trust(p)
    p.set_defaults(func=_cmd_prepare)


def _cmd_prepare(a) -> None:
    import logging

    from eagle3.config import PrepareConfig
    from eagle3.data.prepare import prepare

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = PrepareConfig(data=a.data, max_len=a.max_len, limit=a.limit, draft_vocab=a.draft_vocab,
                        val_fraction=a.val_fraction, seed=a.seed, same_role=a.same_role)
    m = prepare(a.model, a.out, cfg, trust_remote_code=a.trust_remote_code)
    print(json.dumps({"out": a.out, "records_read": m.records_read, "records_kept": m.records_kept,
                      "skipped": m.skipped, "num_tokens": m.num_tokens,
                      "num_trainable_tokens": m.num_trainable_tokens,
                      "draft_vocab": m.vocab_map.draft_vocab_size,
                      "vocab_coverage": round(m.vocab_map.coverage, 6),
                      "unreadable_tail_bytes": m.unreadable_tail_bytes}, indent=1))
    if a.show:
        from eagle3.data.prepare import read_split
        from eagle3.data.template import show
        from eagle3.target import Target

        tok = Target.open(a.model, a.trust_remote_code).tokenizer()
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
    p.add_argument("--dry-run", action="store_true", help="print the preflight estimate (disk, memory) and exit")
    p.set_defaults(func=_cmd_run)


def _cmd_run(a) -> None:
    from eagle3.config import PipelineConfig

    cfg = PipelineConfig.from_file(a.config)
    if a.run_dir:
        cfg = cfg.model_copy(update={"run_dir": a.run_dir})
    if a.dry_run:
        from eagle3.preflight import plan

        p = plan(cfg)
        print(f"preflight for {a.config}: {p.time_line()}\n~{p.tokens:,} tokens\n{p.table()}")
        print("\n".join(f"PROBLEM: {x}" for x in p.problems) or "OK: every remaining stage fits")
        return
    # With no PREFECT_API_URL Prefect starts a temporary local server; it needs ~18 s cold
    # here, against a 20 s default timeout (REFERENCE §3).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if os.environ.get("PREFECT_HOME"):  # the embedded server's SQLite file goes there; a missing dir times it out
        os.makedirs(os.path.expanduser(os.environ["PREFECT_HOME"]), exist_ok=True)
    from flows.pipeline import pipeline

    result = pipeline(cfg)
    print(json.dumps(result, indent=1))
    _print_summary(cfg, result)


def _print_summary(cfg, result: dict) -> None:
    """The figures a user runs the demo for, and the command that serves the draft."""
    from eagle3.artifacts import EvalReport

    r = EvalReport.read(result["eval"])
    final = os.path.abspath(result["final"])
    spec = json.dumps({"method": "eagle3", "model": final, "num_speculative_tokens": r.k})
    print(f"\ntau (acceptance length) = {r.acceptance_length:.3f} at k={r.k} on {r.num_prompts} prompts "
          f"({cfg.eval.prompts}); speedup {r.speedup_vs_target or 0:.2f}x over greedy; lossless: {r.lossless}")
    print(f"draft: {final}")
    print(f"serve it: vllm serve {os.path.abspath(cfg.model)} --speculative-config '{spec}'")


# ---------------------------------------------------------------- extract
def _add_extract(sub) -> None:
    p = sub.add_parser("extract", help="stage 2: store the target's aux + final hidden states of prepared samples")
    p.add_argument("--model", required=True, help="target HF model dir")
    p.add_argument("--prepared", required=True, help="output dir of `eagle3 prepare`")
    p.add_argument("--out", required=True, help="output dir (rerun the same command to resume)")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="hf (transformers) or vllm (GPU host)")
    p.add_argument("--aux-layers", default=None, metavar="A,B,C",
                   help="3 vLLM-convention aux ids (id k = stream entering layer k); default 2,N//2,N-3")
    p.add_argument("--storage", choices=["bf16", "fp32", "fp8", "fp8-aux"], default="bf16",
                   help="bf16 (default); fp32; fp8 e4m3 per-token scale for all states; fp8 for aux only")
    p.add_argument("--shard-bytes", type=int, default=1 << 30, help="target shard size (default 1 GiB)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="hf: token budget of one forward batch")
    p.add_argument("--splits", default="train,val", help="prepared splits to extract (default train,val)")
    p.add_argument("--reuse", action="append", default=[], metavar="DIR",
                   help="an earlier extract dir whose samples are copied instead of recomputed (repeatable)")
    p.add_argument("--tp", type=int, default=1, help="vllm: tensor parallel size")
    p.add_argument("--pp", type=int, default=1, help="vllm: pipeline parallel size")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm: gpu_memory_utilization")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="vllm: max_num_batched_tokens")
    _add_trust(p)
    p.set_defaults(func=_cmd_extract)


def _cmd_extract(a) -> None:
    from eagle3.config import ExtractConfig
    from eagle3.extract import run_extract

    try:
        aux = [int(x) for x in a.aux_layers.split(",")] if a.aux_layers else None
    except ValueError:
        raise UserError(f"--aux-layers {a.aux_layers!r}: expected three comma-separated integers") from None
    cfg = ExtractConfig(
        backend=a.backend, aux_layer_ids=aux, storage=a.storage, shard_bytes=a.shard_bytes,
        batch_tokens=a.batch_tokens, splits=[s for s in a.splits.split(",") if s],
        tensor_parallel_size=a.tp, pipeline_parallel_size=a.pp,
        gpu_memory_utilization=a.gpu_memory_utilization, max_num_batched_tokens=a.max_num_batched_tokens,
    )
    m = run_extract(a.model, a.prepared, a.out, cfg, reuse=a.reuse, trust_remote_code=a.trust_remote_code)
    print(json.dumps({"out": a.out, "layer_ids": m.layer_ids, "storage": m.storage,
                      "num_samples": m.num_samples, "num_tokens": m.num_tokens,
                      "shards": len(m.shards), **m.stats}, indent=1))


# ---------------------------------------------------------------- verifier
def _add_verifier(sub) -> None:
    p = sub.add_parser("verifier", help="stage 3a: read the target's embedding, final norm and lm_head")
    p.add_argument("--model", required=True, help="target HF model dir (safetensors, sharded or single)")
    p.add_argument("--prepared", required=True, help="output dir of `eagle3 prepare` (for the draft vocab map)")
    p.add_argument("--out", required=True, help="output dir: verifier.safetensors + manifest.json")
    p.set_defaults(func=_cmd_verifier)


def _cmd_verifier(a) -> None:
    from eagle3.verifier import extract_verifier

    m = extract_verifier(a.model, a.prepared, a.out)
    print(json.dumps({"out": a.out, "architecture": m.architecture, "tied_embeddings": m.tied_embeddings,
                      "tensors": {k: v.shape for k, v in m.tensors.items()}}, indent=1))


# ---------------------------------------------------------------- main
# ---------------------------------------------------------------- eval
def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="stage 5: acceptance length, speedup and a lossless check of a draft head")
    p.add_argument("--model", required=True, help="target HF model dir")
    p.add_argument("--draft", required=True,
                   help="draft dir: our final/, a native vLLM EAGLE-3 dir, or a speculators-format dir")
    p.add_argument("--prompts", default="mt-bench",
                   help="'mt-bench' (both turns), a JSONL with `prompt` or `messages`, or a prepared dir (val split)")
    p.add_argument("--k", type=int, default=3, help="draft tokens per verify pass (default 3)")
    p.add_argument("--out", required=True, help="output dir: report.json, acceptance.png, samples.jsonl, manifest.json")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per turn at most (default 256)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                   help="hf: chain decoding here (any machine); vllm: vLLM's own metrics (GPU host)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="vllm: per engine (the target-only and the speculative engine share the GPU)")
    p.add_argument("--threads", type=int, default=None,
                   help="hf: torch CPU threads (default torch's); 1 is fastest on a loaded shared CPU")
    p.add_argument("--mode", choices=["live", "replay"], default="live",
                   help="live (default): decode, time, check lossless; replay: exact tau from the target's cached "
                   "greedy answers and one TTT pass of the draft, with a 95%% CI (hf backend)")
    p.add_argument("--replay-cache", default=None,
                   help="replay: cache dir of greedy answers and aux states (default $EAGLE3_CACHE_DIR/replay)")
    _add_trust(p)
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(a) -> None:
    from eagle3.config import EvalConfig

    EvalConfig(prompts=a.prompts, k=a.k, max_new_tokens=a.max_new_tokens, limit=a.limit,
               backend=a.backend, gpu_memory_utilization=a.gpu_memory_utilization,
               threads=a.threads, mode=a.mode)  # bounds -> ValueError
    if a.mode == "replay" and a.backend != "hf":
        raise UserError("--mode replay runs on the hf backend (vLLM's own metrics are live by nature)")
    if a.backend == "vllm":
        from eagle3.eval_vllm import evaluate_vllm

        m = evaluate_vllm(a.model, a.draft, a.prompts, a.k, a.out, a.max_new_tokens, a.limit,
                          a.gpu_memory_utilization, trust_remote_code=a.trust_remote_code)
    else:
        from eagle3.evaluate import evaluate

        def progress(i: int, n: int) -> None:
            print(f"eval: {i}/{n} prompts", file=sys.stderr, flush=True)

        m = evaluate(a.model, a.draft, a.prompts, a.k, a.out, a.max_new_tokens, a.limit, progress=progress,
                     threads=a.threads, trust_remote_code=a.trust_remote_code, mode=a.mode,
                     replay_cache=a.replay_cache)
    print(json.dumps({"out": a.out, "mode": m.mode, "draft_format": m.draft_format, "k": m.k,
                      "num_prompts": m.num_prompts, "acceptance_length": round(m.acceptance_length, 4),
                      "acceptance_length_ci": m.acceptance_length_ci,
                      "per_position_acceptance": [round(x, 4) for x in m.per_position_acceptance],
                      "lossless": m.lossless, "tokens_per_second": m.tokens_per_second,
                      "target_tokens_per_second": m.target_tokens_per_second,
                      "speedup_vs_target": m.speedup_vs_target}, indent=1))


# ---------------------------------------------------------------- train
def _add_train(sub) -> None:
    from eagle3.train.__main__ import add_train_flags

    p = sub.add_parser("train", help="stage 4: train the EAGLE-3 draft (torchrun for N > 1 processes)")
    add_train_flags(p)  # --nproc-per-node N > 1 runs torchrun; for several nodes run `torchrun -m eagle3.train`
    p.set_defaults(func=_cmd_train)


def _cmd_train(a) -> None:
    import subprocess

    from eagle3.train.__main__ import main as train_main
    from eagle3.train.__main__ import to_argv

    from eagle3.train.__main__ import config_from_args, torchrun_command

    argv = to_argv(a)
    n = config_from_args(a).nproc_per_node
    if n > 1:
        rc = subprocess.call(torchrun_command(n, argv))
    else:
        rc = train_main(argv)
    if rc:
        raise UserError(f"training exited with status {rc}")


# ---------------------------------------------------------------- verify
def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="check every stage dir under DIR against its manifest checksums")
    p.add_argument("dir", help="a run dir (or one stage dir)")
    p.set_defaults(func=_cmd_verify)


def _cmd_verify(a) -> None:
    from eagle3.verify import verify_tree

    bad = 0
    for f in verify_tree(a.dir):
        print(f"{'OK ' if not f.bad else 'BAD'} {f.kind:<9} {f.stage_dir} ({f.checked} files checked)")
        for b in f.bad:
            print(f"    {b}")
        bad += len(f.bad)
    if bad:
        raise UserError(f"{bad} problem(s) found under {a.dir}")


# ---------------------------------------------------------------- regenerate
def _add_regenerate(sub) -> None:
    p = sub.add_parser("regenerate", help="stage 0 (optional): rewrite every assistant turn with the target itself")
    p.add_argument("--model", required=True, help="target HF model dir (its chat template and stop ids are used)")
    p.add_argument("--data", required=True, help="ShareGPT JSON, JSONL, Parquet, HF datasets dir, or 'sharegpt'")
    p.add_argument("--out", required=True, help="output dir: regenerated.jsonl + manifest.json (rerun to resume)")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="hf (transformers) or vllm (GPU host)")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="tokens per assistant turn at most (default 1024)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (each conversation turn has its own stream)")
    p.add_argument("--reasoning", choices=["keep", "drop"], default="keep",
                   help="keep or drop <think>...</think> blocks in the regenerated turns")
    p.add_argument("--max-len", type=int, default=None,
                   help="prompt + answer tokens at most (default: the model's max_position_embeddings)")
    p.add_argument("--limit", type=int, default=None, help="regenerate only the first N records")
    p.add_argument("--same-role", choices=["merge", "drop"], default="merge", help="as in prepare")
    p.add_argument("--chunk-records", type=int, default=64, help="records per committed chunk (resume unit)")
    p.add_argument("--batch-size", type=int, default=8, help="hf: sequences decoded together (default 8)")
    p.add_argument("--batch-tokens", type=int, default=32768, help="hf: padded prompt tokens per batch at most")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: fp32 on CPU, bf16 on CUDA / vLLM")
    p.add_argument("--reuse", action="append", default=[], metavar="DIR",
                   help="an earlier regenerate dir whose records (same model, settings, prompts) are copied (repeatable)")
    p.add_argument("--tp", type=int, default=1, help="vllm: tensor parallel size")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vllm: gpu_memory_utilization")
    p.add_argument("--threads", type=int, default=None, help="hf on CPU: torch threads (default: torch's)")
    _add_trust(p)
    p.set_defaults(func=_cmd_regenerate)


def _cmd_regenerate(a) -> None:
    import logging

    from eagle3.config import RegenConfig
    from eagle3.regenerate import regenerate

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    cfg = RegenConfig(backend=a.backend, max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                      seed=a.seed, reasoning=a.reasoning, max_len=a.max_len, limit=a.limit, same_role=a.same_role,
                      chunk_records=a.chunk_records, batch_size=a.batch_size, batch_tokens=a.batch_tokens, dtype=a.dtype,
                      tensor_parallel_size=a.tp, gpu_memory_utilization=a.gpu_memory_utilization)

    def progress(p: dict) -> None:
        print(f"regenerate: {p['records_read']} records read, {p['records_written']} written, "
              f"{p['tokens_generated']} tokens at {p['tokens_per_second']:.1f} tok/s", file=sys.stderr, flush=True)

    m = regenerate(a.model, a.data, a.out, cfg, reuse=a.reuse, progress=progress, trust_remote_code=a.trust_remote_code)
    print(json.dumps({"out": a.out, "file": f"{a.out}/{m.file}", "records_read": m.records_read,
                      "records_written": m.records_written, "skipped": m.skipped, "turns_written": m.turns_written,
                      "turns_cut": m.turns_cut, **m.stats}, indent=1))


# ---------------------------------------------------------------- main
_ADDERS = [_add_assets, _add_prepare, _add_extract, _add_run, _add_verifier, _add_eval, _add_train, _add_verify,
           _add_regenerate]


_LOCKED = {"prepare", "extract", "verifier", "eval", "regenerate"}  # train locks in its rank-0 process


def one_line(e: BaseException) -> str:
    """The error as one line: a pydantic ValidationError lists each field, its problem and the value
    given (its own text spans lines and ends in a URL)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        return f"invalid {e.title}: " + "; ".join(
            f"{'.'.join(map(str, x['loc'])) or 'value'}: {x['msg']} (got {x['input']!r})" for x in e.errors())
    return str(e)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: `--mode x` must never be read as `--model x`
    ap = argparse.ArgumentParser(prog="eagle3", description=__doc__.splitlines()[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in _ADDERS:
        add(sub)
    for p in sub.choices.values():
        p.allow_abbrev = False
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
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
