"""Regenerate (hf backend) on real data: ShareGPT conversations through SmolLM2 on this CPU.

For each batch size the whole stage runs on the same records into its own dir (same model loaded
once). Prints, per batch size: generated tokens, generation seconds, tokens/s (generated tokens /
time inside the backend), CPU seconds of the process (on a shared machine wall time mostly measures
the neighbours; CPU time measures the work), and whether its file is byte-identical to the first
run's (batch size 1 is single-sequence greedy, exact by construction) -- the honest measure of
near-tie flips caused by padded batching. `--stock` also runs each batch size through transformers'
stock decoding (DynamicCache growing by torch.cat, SDPA with repeat_kv, F.linear), the path before
eagle3/decoding/batch_decode.py and eagle3/decoding/cpu_linear.py, and through eagle3's cache and attention on stock
F.linear (path `eagle3-flinear`: the share of the packed linear layers), side by side. Also prints the
load average. Last line: one JSON object.

    .venv/bin/python -m benchmarks.speed.regenerate [--data sharegpt|mt-bench|FILE] [--limit 6] [--max-new-tokens 64]
                                              [--batch-sizes 1,4,8] [--threads 2] [--stock]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from eagle3.assets import materialize_smollm2
from eagle3.config import RegenConfig
from eagle3.decoding.generate import HFGenerator
from eagle3.model.target import Target
from eagle3.regenerate.hf import load_hf
from eagle3.regenerate.resume import OUT_FILE
from eagle3.regenerate.run import regenerate

REPO = Path(__file__).resolve().parents[2]


class FLinearGenerator(HFGenerator):
    """eagle3's cache and attention, on torch's stock F.linear (no oneDNN prepacking)."""

    cpu_linear = False


class StockGenerator(FLinearGenerator):
    """The same batching and picking, decoded with transformers' stock cache, attention and linear layers."""

    @torch.inference_mode()
    def _batch(self, prompts, seeds):
        from transformers import DynamicCache

        return self._decode(prompts, seeds, DynamicCache(config=self.model.config))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,4,8")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stock", action="store_true", help="also run transformers' stock decoding per batch size")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = materialize_smollm2(a.model) if a.model == str(REPO / "assets" / "smollm2") else Path(a.model)
    gen, _ = load_hf(Target.open(model), RegenConfig())
    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        data = a.data
        if data == "mt-bench":  # short prompts: MT-Bench's two user turns, with placeholder answers to replace
            from eagle3.eval.prompts import mtbench_path

            data = str(Path(tmp) / "mt_bench.jsonl")
            with open(mtbench_path()) as f, open(data, "w") as g:
                for line in f:
                    q = json.loads(line)
                    msgs = [m for t in q["turns"] for m in ({"role": "user", "content": t},
                                                             {"role": "assistant", "content": "-"})]
                    g.write(json.dumps({"id": str(q["question_id"]), "messages": msgs}) + "\n")
        stock = StockGenerator(gen.model, gen.eos, gen.cfg, gen.pad)
        flinear = FLinearGenerator(gen.model, gen.eos, gen.cfg, gen.pad)
        paths = (("stock", stock), ("eagle3-flinear", flinear), ("eagle3", gen)) if a.stock else (("eagle3", gen),)
        for bs, (path, g) in [(bs, p) for bs in map(int, a.batch_sizes.split(",")) for p in paths]:
            cfg = RegenConfig(max_new_tokens=a.max_new_tokens, limit=a.limit, batch_size=bs, chunk_records=a.limit)
            g.cfg = cfg
            out = Path(tmp) / f"bs{bs}-{path}"
            c0 = time.process_time()
            m = regenerate(model, data, out, cfg, generator=g)
            cpu = time.process_time() - c0
            blob = (out / OUT_FILE).read_bytes()
            first = first if first is not None else blob
            row = {"batch_size": bs, "path": path, "records": m.records_written, "turns": m.turns_written,
                   "tokens": m.stats["tokens_generated"], "prompt_tokens": m.stats["prompt_tokens"],
                   "seconds": m.stats["generate_seconds"], "cpu_seconds": round(cpu, 1),
                   "tokens_per_second": m.stats["tokens_per_second"],
                   "tokens_per_cpu_second": round(m.stats["tokens_generated"] / max(cpu, 1e-9), 1),
                   "loadavg": os.getloadavg()[0], "same_file_as_first": blob == first}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({"model": str(model), "data": a.data, "limit": a.limit, "max_new_tokens": a.max_new_tokens,
                      "threads": torch.get_num_threads(), "loadavg": os.getloadavg(), "runs": rows}))


if __name__ == "__main__":
    main()
