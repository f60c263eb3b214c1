"""Live chain speculative decoding vs plain greedy on this CPU, per linear kernel, and where a round's time goes.

For each kernel set in `--kernels` (stock: torch's F.linear; packed: `eagle3.decoding.cpu_linear`, oneDNN
prepacked weights, the eval default) and each k in `--ks`: `eagle3.eval.decode.measure` on the first
`--limit` MT-Bench questions (both turns, `--max-new-tokens`), which interleaves plain greedy and
speculative decoding per conversation on the same kernels and checks that they agree (lossless);
printed: tau, tokens/s of each, the speedup. Then the parts of one round, timed in the same process at
a mid-answer context (`--ctx` tokens of a cached prompt): a target forward of 1 token (a plain decode
step), of k+1 tokens (a verify pass), and the draft's proposal of k tokens. With t1, tv, td those
times, a round costs tv + td and yields tau tokens, so the expected speedup is tau * t1 / (tv + td)
(Python overhead between calls not included). Last line: one JSON object.

    .venv/bin/python -m benchmarks.speed.live_speed --draft runs/demo/train/final [--ks 1,2,3] [--limit 4]
        [--max-new-tokens 128] [--threads 2] [--kernels stock,packed]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from eagle3.decoding.cpu_linear import packed_linears
from eagle3.eval.decode import DraftProposer, TargetLM, measure
from eagle3.eval.prompts import load_prompts
from eagle3.eval.run import cast_draft
from eagle3.model.formats import load_draft
from eagle3.model.target import Target, prompt_ids

REPO = Path(__file__).resolve().parents[2]


def timed(fn, n: int) -> float:
    """Median seconds of n calls."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def round_parts(model, draft, tok, aux_ids, ks: list[int], ctx: int, repeats: int) -> dict[str, float]:
    """Median ms of a 1-token target step, a (k+1)-token verify pass and a k-token proposal at `ctx` tokens."""
    ids = prompt_ids(tok, [{"role": "user", "content": "Tell me a long story about a dragon. " * 40}])[:ctx]
    plain, spec = TargetLM(model), TargetLM(model, aux_ids)
    parts = {}
    with torch.inference_mode():
        plain.reset()
        plain.forward(ids)
        n0 = plain.cache.get_seq_length()

        def step() -> None:
            plain.forward([ids[-1]])
            plain.crop(n0)

        parts["t1_ms"] = round(1000 * timed(step, repeats), 2)
        spec.reset()
        _, aux = spec.forward(ids)
        for k in ks:
            def verify(k: int = k) -> None:  # timed below, in this iteration; k bound all the same
                spec.forward([ids[-1]] * (k + 1))
                spec.crop(n0)

            prop = DraftProposer(draft)
            prop.propose(ids + [ids[-1]], aux, k)  # the draft's cache of the context, as mid-answer

            # a round after the context: one new verified state, k proposals
            def propose_next(prop: DraftProposer = prop, k: int = k) -> None:
                prop.n_ctx = len(ids)  # (propose crops its cache back to the context itself)
                prop.propose(ids + [ids[-1], ids[-1]], aux[-1:], k)

            parts[f"verify_k{k}_ms"] = round(1000 * timed(verify, repeats), 2)
            parts[f"propose_k{k}_ms"] = round(1000 * timed(propose_next, repeats), 2)
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    ap.add_argument("--draft", required=True)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=400, help="context length for the per-call timings")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", default="stock,packed", help="comma list of stock, packed")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target = Target.open(a.model)
    model = target.load_model(head=True, device="cpu")
    tok, eos = target.tokenizer(), target.stop_ids()
    draft, _ = load_draft(a.draft, a.model, model.get_input_embeddings().weight)
    draft = cast_draft(draft, torch.device("cpu"), torch.float32).eval()
    aux_ids = draft.config.aux_layer_ids
    convs, _ = load_prompts("mt-bench", a.limit)
    res: dict = {"draft": a.draft, "limit": a.limit, "max_new_tokens": a.max_new_tokens, "threads": a.threads,
                 "loadavg_start": os.getloadavg()[0], "runs": [], "parts": {}}
    ks = list(map(int, a.ks.split(",")))
    for kern in a.kernels.split(","):
        if kern not in ("stock", "packed"):
            sys.exit(f"--kernels: unknown {kern!r} (stock, packed)")
        for k in ks:
            r = measure(model, tok, DraftProposer(draft), aux_ids, convs, k, a.max_new_tokens, eos,
                        cpu_linear=kern == "packed")
            row = {"kernels": kern, "k": k, "tau": round(r["acceptance_length"], 4), "lossless": r["lossless"],
                   "spec_tok_s": round(r["tokens_per_second"], 2),
                   "greedy_tok_s": round(r["target_tokens_per_second"], 2),
                   "speedup": round(r["speedup_vs_target"], 3), "cpu_linear": r["cpu_linear"]}
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
        with packed_linears(model, draft, rows=range(1, max(ks) + 2)) if kern == "packed" else contextlib.nullcontext():
            parts = res["parts"][kern] = round_parts(model, draft, tok, aux_ids, ks, a.ctx, a.repeats)
        print(json.dumps({kern: parts}), flush=True)
    for row in res["runs"]:
        p, k = res["parts"][row["kernels"]], row["k"]
        row["expected_speedup"] = round(row["tau"] * p["t1_ms"] / (p[f"verify_k{k}_ms"] + p[f"propose_k{k}_ms"]), 3)
    res["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
