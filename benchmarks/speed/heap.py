"""What keeping freed memory in the heap (`eagle3.runtime.heap`) buys each CPU stage, and what it costs in RSS.

Two workloads, each run in child processes that alternate glibc's defaults (`EAGLE3_HEAP=release`)
and `retain` (A B A B ...; the allocator setting is process-wide, so the two cannot share a
process): the best of the repeats counts, since load from other processes only ever adds time.
- train: the trainer's own step (`TTT` k=3 + fused loss, targets through the verifier head with the
  argmax cached as in later epochs, backward, clip, AdamW) on SmolLM2 shapes, random tensors, rows of
  1536-2048 tokens (the packed rows' spread, so freed blocks do not always fit the next request).
- extract: `HFBackend` over the real SmolLM2 (`eagle3 assets smollm2`), 16384-token batches of random
  ids, 256-1024 tokens per sample.
Per run: tokens/s, kernel (system) CPU seconds, minor page faults per step, RSS at the end, peak RSS.

    .venv/bin/python -m benchmarks.speed.heap [--steps 8] [--repeats 2] [--threads 2] [--only train,extract]
Last line: one JSON object {workload: {mode: best run}, ratio}.
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
ASSETS = REPO / "assets" / "smollm2"
SMOLLM2 = dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, vocab_size=49152,
               rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, max_position_embeddings=8192)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def train_steps(steps: int, warmup: int):
    """Yields tokens per step; the caller times from the first yield after warmup."""
    import torch

    from eagle3.model.draft import DraftConfig, Eagle3Draft
    from eagle3.train.loop import TTT
    from eagle3.train.loss import TargetHead, step_weights
    from eagle3.train.optim import step as optimizer_step
    from eagle3.train.validate import row_pass

    g = torch.Generator().manual_seed(0)
    V, H, vd = 49152, 576, 8192
    draft = Eagle3Draft(DraftConfig.from_target(SMOLLM2, draft_vocab_size=vd))
    d2t = torch.randperm(V, generator=g)[:vd].sort().values - torch.arange(vd)
    head = TargetHead(torch.ones(H), 1e-5, draft.embed_tokens.weight.detach(), d2t)
    model = TTT(draft, 3, 256, step_weights(3))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    for _ in range(warmup + steps):
        L = int(torch.randint(1536, 2049, (1,), generator=g))
        batch = {"input_ids": torch.randint(0, V, (1, L), generator=g), "aux": torch.randn(1, L, 3, H, generator=g),
                 "position_ids": torch.arange(L).remainder(L // 4 + 1)[None],
                 "doc": (torch.arange(L) // (L // 4 + 1))[None], "loss_mask": torch.ones(1, L, dtype=torch.long)}
        logits, _ = head(torch.randn(1, L, H, generator=g), top=False)
        top = torch.randint(-1, vd, (1, L), generator=g)  # later epochs: the argmax comes from a cache
        out = row_pass(model, (logits, top), batch, torch.autocast("cpu", enabled=False))
        del logits
        out.loss.backward()
        optimizer_step(params, opt, 0.5)
        yield L


def extract_steps(steps: int, warmup: int):
    import torch

    from eagle3.extract.hf import HFBackend
    from eagle3.model.capture import padded_batches
    from eagle3.model.target import Target

    if not (ASSETS / "config.json").is_file():
        raise SystemExit(f"no SmolLM2 at {ASSETS}: run `.venv/bin/eagle3 assets smollm2 --out {ASSETS}` first")
    target = Target.open(ASSETS)
    be = HFBackend(target.load_model(head=False).float().eval(), [2, 15, 27, 30], 16384)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 49152, (int(torch.randint(256, 1025, (1,), generator=g)),), generator=g)
            for _ in range(40 * (warmup + steps))]
    batches = padded_batches(seqs, be.batch_tokens, 0)
    for _ in range(warmup + steps):
        _, lengths, ids = next(batches)
        be.forward(ids).cpu()
        yield sum(lengths)


def child(workload: str, steps: int, warmup: int) -> dict:
    import torch

    from eagle3.runtime.heap import retain_freed_memory

    torch.manual_seed(0)
    mode = retain_freed_memory()
    gen = {"train": train_steps, "extract": extract_steps}[workload](steps, warmup)
    for _ in range(warmup):
        next(gen)
    r0, t0, tokens = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), 0
    for n in gen:
        tokens += n
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"mode": mode, "tokens_per_s": round(tokens / dt, 1), "system_s": round(r1.ru_stime - r0.ru_stime, 2),
            "user_s": round(r1.ru_utime - r0.ru_utime, 2),
            "faults_per_step": round((r1.ru_minflt - r0.ru_minflt) / steps),
            "rss_end_mb": round(rss_mb()), "peak_rss_mb": round(r1.ru_maxrss / 1024),
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default="train,extract")
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        print(json.dumps(child(a.child, a.steps, a.warmup)))
        return
    results: dict = {}
    for w in a.only.split(","):
        runs: dict[str, list[dict]] = {"release": [], "retain": []}
        for _ in range(a.repeats):
            for mode in runs:
                cmd = [sys.executable, "-m", __spec__.name, "--child", w, "--steps", str(a.steps),
                       "--warmup", str(a.warmup)]
                cmd += ["--threads", str(a.threads)] if a.threads else []
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                                   env=dict(os.environ, EAGLE3_HEAP=mode))
                if p.returncode:
                    raise SystemExit(f"{w} {mode}: {p.stderr.strip().splitlines()[-1:]}")
                r = json.loads(p.stdout.strip().splitlines()[-1])
                runs[mode].append(r)
                print(f"{w:>7} {mode:>7}: {r['tokens_per_s']:7.1f} tok/s  system {r['system_s']:5.2f} s  "
                      f"user {r['user_s']:6.2f} s  {r['faults_per_step']:>7} faults/step  "
                      f"RSS end {r['rss_end_mb']} MB, peak {r['peak_rss_mb']} MB", flush=True)
        best = {m: max(rs, key=lambda r: r["tokens_per_s"]) for m, rs in runs.items()}
        ratio = best["retain"]["tokens_per_s"] / best["release"]["tokens_per_s"]
        print(f"{w}: retain / release throughput {ratio:.3f}x, peak RSS {best['retain']['peak_rss_mb']} vs "
              f"{best['release']['peak_rss_mb']} MB", flush=True)
        results[w] = {**best, "ratio": round(ratio, 3)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
