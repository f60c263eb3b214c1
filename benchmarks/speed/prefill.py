"""The answer build's prefill: one forward over the whole left-padded batch against rows grouped by length, each
group padded to its own longest (`HFGenerator._prefill`), on the replay answers' real prompts, side by side in one
process.

    .venv/bin/python -m benchmarks.speed.prefill --turns <replay cache dir>/turns.jsonl [--model assets/smollm2]

The prompts are each turn's (`prompt_len` tokens of each line of a replay cache's turns.jsonl: MT-Bench's 80
first turns, then the 80 second turns with the target's first answers), one batch per turn, as the eval decodes
them. Prints per turn the real and padded tokens of each way, their seconds, the ratio and whether the next-token
argmax of every row agrees; last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def prefill_seconds(gen, model, prompts: list[list[int]], grouped: bool) -> tuple[float, torch.Tensor]:
    from eagle3.decoding.batch_decode import buffer_cache, gqa_decoding
    from eagle3.decoding.generate import left_padded

    ids, mask, pos = left_padded(prompts, gen.pad)
    gen.grouped_prefill = grouped
    with torch.inference_mode(), gqa_decoding(model):
        t0 = time.perf_counter()
        logits = gen._prefill(ids, mask, pos, buffer_cache(model, ids.shape[1] + 256), [len(p) for p in prompts])
        return time.perf_counter() - t0, logits


def main() -> None:
    from eagle3.config import RegenConfig
    from eagle3.decoding.cpu_linear import packed_linears
    from eagle3.decoding.generate import HFGenerator, prefill_groups
    from eagle3.model.target import Target

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", required=True, help="a replay cache's turns.jsonl")
    ap.add_argument("--model", default="assets/smollm2")
    a = ap.parse_args()
    turns = [json.loads(x) for x in Path(a.turns).read_text().splitlines()]
    model = Target.open(a.model).load_model(head=True, device="cpu")
    gen = HFGenerator(model, {0}, RegenConfig(max_new_tokens=1, batch_size=128, batch_tokens=1 << 30), 0)
    res = {}
    with packed_linears(model):
        for w in sorted({t["turn"] for t in turns}):
            prompts = sorted((t["ids"][: t["prompt_len"]] for t in turns if t["turn"] == w), key=lambda p: -len(p))
            lens = [len(p) for p in prompts]
            padded = len(lens) * lens[0]
            grouped_tokens = sum((r1 - r0) * max(lens[r0:r1]) for r0, r1 in prefill_groups(lens))
            one_s, one = prefill_seconds(gen, model, prompts, grouped=False)
            grp_s, grp = prefill_seconds(gen, model, prompts, grouped=True)
            same = bool(torch.equal(one.argmax(-1), grp.argmax(-1)))
            res[f"turn {w + 1}"] = {"rows": len(lens), "tokens": sum(lens), "padded_one": padded,
                                    "padded_grouped": grouped_tokens, "one_s": round(one_s, 2),
                                    "grouped_s": round(grp_s, 2), "ratio": round(grp_s / one_s, 3),
                                    "argmax_equal": same, "max_abs_diff": float((one - grp).abs().max())}
            print(f"turn {w + 1}: {len(lens)} rows, {sum(lens):,} tokens; one forward {padded:,} padded in "
                  f"{one_s:.1f} s, grouped {grouped_tokens:,} in {grp_s:.1f} s (ratio {grp_s / one_s:.2f}); "
                  f"argmax equal {same}",
                  flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
