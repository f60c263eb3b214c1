"""The optimizer step alone on the demo draft's matrices (SmolLM2 widths: fc, q/k/v/o, gate/up/down): AdamW, torch's
Muon (Newton-Schulz in bf16) and Muon with the iteration in fp32 (what the trainer runs on a CPU without bf16 units),
side by side in one process, ms per step after a warm-up step. Prints one line each, then one JSON object.

    .venv/bin/python -m benchmarks.speed.muon [--steps 3]
"""
from __future__ import annotations

import argparse
import json
import time

SHAPES = [(576, 1728), (576, 1152), (192, 1152), (192, 1152), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def main() -> None:
    import torch

    from eagle3.runtime.floats import cpu_bf16
    from eagle3.train.optim import MuonAdamW

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in SHAPES]
    spare = torch.nn.Parameter(torch.zeros(4))  # MuonAdamW's AdamW side needs a parameter
    opts = {"adamw": torch.optim.AdamW(ps, lr=1e-3),
            "muon_bf16_iteration": torch.optim.Muon(ps, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
            "muon_fp32_iteration": MuonAdamW(torch.optim.Muon(ps, lr=1e-3, adjust_lr_fn="match_rms_adamw"),
                                             torch.optim.AdamW([spare]), ns_fp32=True)}
    out = {"cpu_bf16_units": cpu_bf16(), "threads": torch.get_num_threads()}
    for name, opt in opts.items():
        for p in [*ps, spare]:
            p.grad = torch.randn_like(p)
        opt.step()  # warm-up: state allocated
        t = time.perf_counter()
        for _ in range(a.steps):
            opt.step()
        out[name] = round((time.perf_counter() - t) / a.steps * 1000, 1)
        print(f"{name:22s} {out[name]:9.1f} ms/step", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
