"""Does regenerating the answers with the target raise acceptance? Same size, same budget, A vs B.

A: the first exchange (user turn + original assistant answer) of N ShareGPT conversations.
B: the same user turns, answers regenerated greedily by the target (`eagle3 regenerate`).
Each is prepared, extracted, trained (identical TrainConfig, same number of optimizer steps)
and evaluated on MT-Bench with the HF chain decoder. Prints simulated tau (val) and measured tau
for both. Stage dirs are cached in --work, so a rerun only redoes what is missing.
Last line: one JSON object.

    .venv/bin/python -m benchmarks.experiments.regen_vs_original [--n 160] [--max-new 160] [--steps 60]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def first_exchanges(n: int, out: Path) -> Path:
    """JSONL of the first user turn + answer of the first n usable ShareGPT records."""
    from eagle3.data.normalize import conversations
    from eagle3.data.readers import ReadStats, iter_source, resolve_source

    rows = []
    for rid, msgs in conversations(iter_source(resolve_source("sharegpt"), ReadStats())):
        msgs = [m for m in msgs or [] if m["role"] != "system"][:2]
        if len(msgs) == 2 and len(msgs[0]["content"]) < 2000:  # prompts short enough to answer within max_len
            rows.append({"id": rid, "messages": msgs})
        if len(rows) == n:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/eagle3-regen-ab")
    ap.add_argument("--n", type=int, default=160)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--max-len", type=int, default=768)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from eagle3.assets import materialize_smollm2
    from eagle3.config import EvalConfig, ExtractConfig, PrepareConfig, RegenConfig, TrainConfig
    from eagle3.eval.run import evaluate
    from eagle3.extract import run_extract
    from eagle3.prepare import prepare
    from eagle3.regenerate.run import regenerate
    from eagle3.train.loop import train
    from eagle3.verifier import extract_verifier

    w = Path(a.work)
    model = materialize_smollm2(REPO / "assets" / "smollm2")
    src = first_exchanges(a.n, w / "original.jsonl")
    t0 = time.perf_counter()
    r = regenerate(model, str(src), w / "regen", RegenConfig(max_new_tokens=a.max_new, max_len=a.max_len, batch_size=8))
    regen_s = time.perf_counter() - t0
    sources = {"original": str(src), "regenerated": str(w / "regen" / "regenerated.jsonl")}
    results = {"regenerate": {"seconds": round(regen_s),
                              **{k: v for k, v in r.stats.items() if isinstance(v, (int, float))}}}
    vocab_from = None
    for name, data in sources.items():
        d = w / name
        t0 = time.perf_counter()
        # the same draft vocab for both (built on A) keeps the comparison about the data only
        prepare(model, d / "prepare", PrepareConfig(data=data, max_len=a.max_len, draft_vocab=8192,
                                                    val_fraction=0.1, vocab_from=vocab_from), progress=False)
        vocab_from = vocab_from or str(d / "prepare")
        run_extract(model, d / "prepare", d / "extract", ExtractConfig(), show_progress=False)
        extract_verifier(model, d / "prepare", d / "verifier")
        cfg = TrainConfig(ttt_steps=3, max_steps=a.steps, epochs=100, pack_tokens=2048, lr=1e-3, warmup_steps=5,
                          val_every=a.steps, ckpt_every=10_000, threads=a.threads)
        m = train(cfg, d / "extract", d / "verifier", d / "train", progress=False)
        rep = evaluate(model, d / "train" / "final", d / "eval",
                       EvalConfig(k=3, max_new_tokens=64, limit=a.eval_prompts, threads=a.threads))
        results[name] = {"sim_tau_val": round(m.best_sim_tau, 4), "val_acc": [round(x, 4) for x in m.val["acc"]],
                         "mtbench_tau_k3": round(rep.acceptance_length, 4), "lossless": rep.lossless,
                         "speedup": round(rep.speedup_vs_target, 3), "steps": m.steps,
                         "seconds": round(time.perf_counter() - t0)}
        print(f"{name}: sim tau {m.best_sim_tau:.3f}, MT-Bench tau {rep.acceptance_length:.3f} (k=3), "
              f"speedup {rep.speedup_vs_target:.2f}x, lossless {rep.lossless}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
