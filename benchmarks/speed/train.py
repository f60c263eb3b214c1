"""Training throughput and peak memory with SmolLM2 shapes (H=576), on this machine's CPU (or GPU).

Each setting (draft vocab 8192 / 32000 x k = 3 / 7) runs in its own process and times the
trainer's own step: one optimizer step = one packed row of `--pack` tokens (4 documents)
through the trainer's `TTT` module (k unrolled steps + the fused loss), targets from the stored
final states through the verifier head (V = 49152) including the full-vocab argmax (what every
first-epoch step pays; later epochs cache it, `tokens_per_s_cached`), backward, clip and AdamW.
As in the trainer for a tied target like SmolLM2, the head's lm_head is the draft's frozen
embedding (`--untied` gives the head its own copy). Inputs are random tensors of the real
shapes (throughput does not depend on their values). After `--warmup` steps, `--steps` steps
are timed. Peak RSS is the child's ru_maxrss.

    .venv/bin/python -m benchmarks.speed.train [--pack 2048] [--steps 3] [--warmup 1] [--threads N]
Last line: one JSON object {setting: {tokens_per_s, tokens_per_s_cached, peak_rss_mb, ...}}.
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

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, vocab_size=49152,
               rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, max_position_embeddings=8192)


def child(vd: int, k: int, pack: int, steps: int, warmup: int, untied: bool, bf16: bool = False) -> dict:
    import torch

    from eagle3.model.draft import DraftConfig, Eagle3Draft
    from eagle3.runtime.heap import retain_freed_memory
    from eagle3.train.loop import TTT
    from eagle3.train.loss import TargetHead, step_weights
    from eagle3.train.optim import step as optimizer_step
    from eagle3.train.validate import row_pass

    retain_freed_memory()  # as the trainer does
    torch.manual_seed(0)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = DraftConfig.from_target(SMOLLM2, draft_vocab_size=vd)
    draft = Eagle3Draft(c).to(dev)
    V, H = 49152, 576
    d2t = (torch.randperm(V)[:vd].sort().values - torch.arange(vd))
    head = TargetHead(torch.ones(H), 1e-5, draft.embed_tokens.weight.detach(), d2t).to(dev)
    if untied:
        head.lm_head = head.lm_head.clone()
    model = TTT(draft, k, 512, step_weights(k))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    # 4 documents per pack, as packed ShareGPT rows are
    batch = {"input_ids": torch.randint(0, V, (1, pack), device=dev), "aux": torch.randn(1, pack, 3, H, device=dev),
             "position_ids": torch.arange(pack, device=dev).remainder(pack // 4)[None],
             "doc": (torch.arange(pack, device=dev) // (pack // 4))[None],
             "loss_mask": torch.ones(1, pack, dtype=torch.long, device=dev)}
    fin = torch.randn(1, pack, H, device=dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda" or bf16)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    cached_top = None
    times: dict[bool, list[float]] = {False: [], True: []}
    for cached in (False, True):
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            if cached:  # a later epoch: the argmax comes from the trainer's per-sample cache
                targets = (head(fin, top=False)[0], cached_top)
            else:
                targets = head(fin)
                cached_top = targets[1]
            out = row_pass(model, targets, batch, amp)
            del targets
            out.loss.backward()
            optimizer_step(params, opt, 0.5)
            sync()
            if i >= warmup:
                times[cached].append(time.perf_counter() - t0)
    dt, dt_cached = (sum(times[c]) / steps for c in (False, True))
    r = {"tokens_per_s": round(pack / dt, 1), "tokens_per_s_cached": round(pack / dt_cached, 1),
         "step_s": round(dt, 3), "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
         "device": dev.type, "threads": torch.get_num_threads(), "tied": not untied, "bf16": bf16 or dev.type == "cuda"}
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
    ap.add_argument("--untied", action="store_true", help="give the verifier head its own lm_head copy")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on a CPU too (as on CUDA)")
    ap.add_argument("--child", nargs=2, type=int, metavar=("VD", "K"))
    a = ap.parse_args()
    if a.child:
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        print(json.dumps(child(a.child[0], a.child[1], a.pack, a.steps, a.warmup, a.untied, a.bf16)))
        return
    results = {}
    for vd in a.vocab:
        for k in a.k:
            cmd = [sys.executable, "-m", __spec__.name, "--child", str(vd), str(k), "--pack", str(a.pack),
                   "--steps", str(a.steps), "--warmup", str(a.warmup)] + ["--untied"] * a.untied + (
                       ["--bf16"] * a.bf16) + (["--threads", str(a.threads)] if a.threads else [])
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=dict(os.environ))
            if p.returncode:
                results[f"vd{vd}_k{k}"] = {"error": p.stderr.strip().splitlines()[-1:]}
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            results[f"vd{vd}_k{k}"] = r
            print(f"draft vocab {vd:>5}, k={k}: {r['tokens_per_s']:>7.1f} tok/s "
                  f"({r['tokens_per_s_cached']:.1f} with the argmax cached), {r['step_s']:.2f} s/step "
                  f"({a.pack}-token packs, {r['threads']} threads), peak RSS {r['peak_rss_mb']:.0f} MB", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
