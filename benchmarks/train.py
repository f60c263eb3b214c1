"""Training throughput and peak memory with SmolLM2 shapes (H=576), on this machine's CPU (or GPU).

Each setting (draft vocab 8192 / 32000 x k = 3 / 7) runs in its own process: one optimizer step
= one packed row of `--pack` tokens through k TTT steps, the loss against targets computed
from final states by the verifier head (V = 49152), backward, clip and AdamW. Inputs are
random tensors of the real shapes (throughput does not depend on their values). After
`--warmup` steps, `--steps` steps are timed. Peak RSS is the child's ru_maxrss.

    .venv/bin/python benchmarks/train.py [--pack 2048] [--steps 3] [--warmup 1]
Last line: one JSON object {setting: {tokens_per_s, peak_rss_mb, ...}}.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, vocab_size=49152,
               rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, max_position_embeddings=8192)


def child(vd: int, k: int, pack: int, steps: int, warmup: int) -> dict:
    import torch

    sys.path.insert(0, str(REPO))
    from eagle3.model import DraftConfig, Eagle3Draft
    from eagle3.train.loss import TargetHead, step_weights, ttt_loss

    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = DraftConfig.from_target(SMOLLM2, draft_vocab_size=vd)
    model = Eagle3Draft(c).to(dev)
    V, H = 49152, 576
    d2t = (torch.randperm(V)[:vd].sort().values - torch.arange(vd))
    head = TargetHead(torch.ones(H), 1e-5, torch.randn(V, H) * 0.05, d2t).to(dev)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, V, (1, pack), device=dev)
    aux = torch.randn(1, pack, 3, H, device=dev)
    fin = torch.randn(1, pack, H, device=dev)
    mask = torch.ones(1, pack, dtype=torch.long, device=dev)
    # 4 documents per pack, as packed ShareGPT rows are
    pos = torch.arange(pack, device=dev).remainder(pack // 4)[None]
    doc = (torch.arange(pack, device=dev) // (pack // 4))[None]
    w = step_weights(k)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    times = []
    for i in range(warmup + steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tl, top = head(fin)
        with amp:
            logits = model.ttt_forward(ids, aux, pos, k, doc=doc)
        out = ttt_loss(logits, tl, top, mask, doc, w)
        del logits, tl  # as the trainer does: only the loss lives through backward
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = sum(times[warmup:]) / steps
    r = {"tokens_per_s": round(pack / dt, 1), "step_s": round(dt, 3),
         "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
         "device": dev.type, "threads": torch.get_num_threads()}
    if dev.type == "cuda":
        r["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--vocab", type=int, nargs="*", default=[8192, 32000])
    ap.add_argument("--k", type=int, nargs="*", default=[3, 7])
    ap.add_argument("--child", nargs=2, type=int, metavar=("VD", "K"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.pack, a.steps, a.warmup)))
        return
    results = {}
    for vd in a.vocab:
        for k in a.k:
            cmd = [sys.executable, __file__, "--child", str(vd), str(k), "--pack", str(a.pack),
                   "--steps", str(a.steps), "--warmup", str(a.warmup)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            if p.returncode:
                results[f"vd{vd}_k{k}"] = {"error": p.stderr.strip().splitlines()[-1:]}
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            results[f"vd{vd}_k{k}"] = r
            print(f"draft vocab {vd:>5}, k={k}: {r['tokens_per_s']:>7.1f} tok/s, {r['step_s']:.2f} s/step "
                  f"({a.pack}-token packs), peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
