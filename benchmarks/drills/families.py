"""Each supported family through `eagle3 run` on a tiny random model laid out like its real checkpoint.

Builds the Llama-3.1, Qwen3 and Kimi-K2.5 dirs of tests/helpers/families.py (offline), then runs the real
`eagle3 run --config` command on each (embedded Prefect, its own process): ShareGPT -> prepare ->
extract (hf) -> verifier -> train -> eval on MT-Bench. Prints per family: the layout facts (vocab
rows vs tokenizer length, tokenizer kind), kept conversations and tokens, extraction tok/s, the
largest difference between stored states and transformers' own forward, the validation figures,
tau, lossless, and the wall time of the whole run. The heads are trained for a few steps on random
targets: tau here shows the pipeline works on the layout, not draft quality. Last line: one JSON object.

    .venv/bin/python -m benchmarks.drills.families [--families llama-3.1,qwen3,kimi-k2.5] [--limit 48] [--steps 8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle3.config import EvalConfig, ExtractConfig, PipelineConfig, PrepareConfig, TrainConfig
from eagle3.model.target import Target
from eagle3.storage.manifests import EvalReport, HiddenStates, PreparedData, TrainedDraft
from eagle3.storage.store import open_store
from tests.helpers.families import FAMILIES, build, corpus, reference_lm

REPO = Path(__file__).resolve().parents[2]


def max_state_error(model: Path, extract_dir: str, layer_ids: list[int], n: int = 4) -> float:
    """Largest |stored - transformers' forward| over n samples: aux ids as hidden_states[k], id N through the norm."""
    lm, worst = reference_lm(model), 0.0
    store = open_store(extract_dir)
    for i in range(min(n, len(store))):
        s = store[i]
        with torch.no_grad():
            o = lm(s["input_ids"][None].long(), output_hidden_states=True)
            for j, k in enumerate(layer_ids[:-1]):
                worst = max(worst, (s["aux_hidden_states"][:, j].float() - o.hidden_states[k][0]).abs().max().item())
            normed = lm.model.norm(s["final_hidden_states"].float())
            worst = max(worst, (normed - o.hidden_states[-1][0]).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--limit", type=int, default=48, help="ShareGPT conversations per family")
    ap.add_argument("--steps", type=int, default=8, help="training steps")
    a = ap.parse_args()
    out: dict[str, dict] = {}
    texts = corpus()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for fam in a.families.split(","):
            model = build(fam, tmp / "models" / fam, texts)
            trust = fam == "kimi-k2.5"
            t = Target.open(model, trust_remote_code=trust)
            tok = t.tokenizer()
            cfg = PipelineConfig(
                model=str(model), run_dir=str(tmp / "runs" / fam), trust_remote_code=trust,
                prepare=PrepareConfig(data="sharegpt", limit=a.limit, max_len=256, draft_vocab=384),
                extract=ExtractConfig(storage="fp32"),
                train=TrainConfig(ttt_steps=3, max_steps=a.steps, pack_tokens=256, warmup_steps=1, threads=1,
                                  val_every=a.steps, ckpt_every=a.steps, lr=1e-3),
                eval=EvalConfig(prompts="mt-bench", limit=4, k=3, max_new_tokens=16, threads=1),
            )
            path = tmp / f"{fam}.json"
            path.write_text(cfg.model_dump_json())
            cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(path)]
            env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect" / fam),
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            env.pop("PREFECT_API_URL", None)
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
            wall = time.perf_counter() - t0
            if r.returncode:
                print(r.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{fam}: eagle3 run exited {r.returncode}")
            run = Path(cfg.run_dir)
            prep, hid = PreparedData.read(run / "prepare"), HiddenStates.read(run / "extract")
            tr, ev = TrainedDraft.read(run / "train"), EvalReport.read(run / "eval")
            fig = {
                "architecture": t.architecture, "tokenizer": type(tok).__name__,
                "fast_tokenizer": hasattr(tok, "backend_tokenizer"),
                "vocab_rows": t.vocab_rows, "tokenizer_length": len(tok), "layer_ids": hid.layer_ids,
                "conversations_kept": prep.records_kept, "tokens": prep.num_tokens,
                "trainable_tokens": prep.num_trainable_tokens, "extract_tok_per_s": hid.stats.get("tokens_per_second"),
                "max_state_error_vs_transformers": max_state_error(model, str(run / "extract"), hid.layer_ids),
                "train_steps": tr.steps, "val_sim_tau": tr.val.get("sim_tau"), "val_loss": tr.val.get("loss"),
                "tau": round(ev.acceptance_length, 4),
                "lossless": ev.lossless, "eval_prompts": ev.num_prompts, "wall_seconds": round(wall, 1),
            }
            out[fam] = fig
            print(f"{fam}: " + ", ".join(f"{k} {v}" for k, v in fig.items()), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
