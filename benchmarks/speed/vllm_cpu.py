"""The vLLM engine on this CPU against the hf backend: engine start, extraction rate, speculative decoding speed.

Prints, then one JSON object as the last line:
- start_s: seconds to build `vllm.LLM(...)` for the target, eager and with vLLM's default torch.compile
  warm-up (a fresh compile cache, so the cold cost a first run pays);
- extract: tokens/s of `eagle3 extract` with --backend vllm (compiled, or eager with --eager) and --backend hf
  on the same prepared samples, run one after the other in this process; the vLLM rate is given with
  and without its engine start, and the ratio vllm / hf on the steady rate;
- decode (with --draft): vLLM's greedy decoding of MT-Bench questions (or --eval-prompts) with the head (k drafts) and
  without it, from `eagle3 eval --backend vllm` (the two engines decode the same prompts in turn):
  tokens/s each, the speedup, tau and whether the output was lossless.

    .venv/bin/python -m benchmarks.speed.vllm_cpu [--limit 40] [--draft runs/demo/train/final] [--prompts 4]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from eagle3.assets import materialize_smollm2
from eagle3.config import EvalConfig, ExtractConfig, PrepareConfig
from eagle3.extract import run_extract
from eagle3.prepare import prepare
from eagle3.runtime.vllm_engine import import_vllm, shutdown, start_engine

REPO = Path(__file__).resolve().parents[2]
FEATURE = "benchmarks.speed.vllm_cpu"  # named in the error when vLLM is not installed


def start_seconds(model: str, eager: bool) -> float:
    import_vllm(FEATURE)  # the import is not part of an engine's start
    t0 = time.perf_counter()
    llm = start_engine(FEATURE, model=model, dtype="float32", max_model_len=2048, enforce_eager=eager)
    s = time.perf_counter() - t0
    shutdown(llm)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    ap.add_argument("--limit", type=int, default=40, help="ShareGPT conversations to extract")
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--draft", default=None, help="an EAGLE-3 head for the decoding part (skipped without one)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="prompts decoded (MT-Bench: both turns of each question)")
    ap.add_argument("--eval-prompts", default="mt-bench",
                    help="comma-separated prompt sources, each decoded in turn "
                    "(what eval --prompts takes: mt-bench, a JSONL file)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip-start", action="store_true", help="leave out the engine start timings")
    ap.add_argument("--eager", action="store_true", help="extraction and decoding on eager engines (enforce_eager)")
    a = ap.parse_args()
    if a.model == str(REPO / "assets" / "smollm2"):
        materialize_smollm2(a.model)
    res: dict = {"model": a.model, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not a.skip_start:
            os.environ["VLLM_CACHE_ROOT"] = str(tmp / "vllm-cache")  # a cold compile, as a first run pays
            res["start_s"] = {"eager": start_seconds(a.model, True), "compiled": start_seconds(a.model, False)}
            print(f"engine start: eager {res['start_s']['eager']:.1f} s, compiled {res['start_s']['compiled']:.1f} s")

        prep = prepare(a.model, tmp / "prep", PrepareConfig(limit=a.limit, max_len=a.max_len, val_fraction=0.0,
                                                            min_val=0, draft_vocab=8192))
        ext = {}
        engine = {"enforce_eager": True} if a.eager else {}
        res["eager"] = a.eager
        for name, cfg in (("vllm", ExtractConfig(backend="vllm", splits=["train"], engine_args=engine)),
                          ("hf", ExtractConfig(splits=["train"]))):
            t0 = time.perf_counter()
            m = run_extract(a.model, tmp / "prep", tmp / name, cfg, show_progress=False)
            wall = time.perf_counter() - t0
            ext[name] = {"tokens": m.num_tokens, "wall_s": wall, "tok_s_wall": m.num_tokens / wall}
        v = ext["vllm"]
        # the engine's start, measured above on the same model, is not extraction work
        start = res.get("start_s", {}).get("eager" if a.eager else "compiled", 0.0)
        v["tok_s_steady"] = v["tokens"] / max(v["wall_s"] - start, 1e-9)
        ext["ratio_vllm_over_hf"] = v["tok_s_steady"] / ext["hf"]["tok_s_wall"]
        res["extract"] = ext
        print(f"extract {prep.num_tokens:,} tokens: vllm {v['tok_s_wall']:.0f} tok/s with its start, "
              f"{v['tok_s_steady']:.0f} without; hf {ext['hf']['tok_s_wall']:.0f} tok/s; "
              f"ratio {ext['ratio_vllm_over_hf']:.2f}")

        if a.draft:
            from eagle3.eval.run import evaluate

            res["decode"] = []
            for i, src in enumerate(a.eval_prompts.split(",")):
                r = evaluate(a.model, a.draft, tmp / f"eval{i}", EvalConfig(
                    backend="vllm", k=a.k, limit=a.prompts, prompts=src, max_new_tokens=a.max_new_tokens,
                    engine_args=engine))
                res["decode"].append({"prompts": src, "k": a.k, "spec_tok_s": r.tokens_per_second,
                                      "plain_tok_s": r.target_tokens_per_second, "speedup": r.speedup_vs_target,
                                      "tau": r.acceptance_length, "lossless": r.lossless,
                                      "per_position": r.per_position_acceptance})
                print(f"decode k={a.k} on {src}: spec {r.tokens_per_second:.1f} tok/s, plain "
                      f"{r.target_tokens_per_second:.1f} tok/s, speedup {r.speedup_vs_target:.2f}x, "
                      f"tau {r.acceptance_length:.3f}, lossless {r.lossless}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
