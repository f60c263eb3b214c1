"""Denormal floats and the trainer on CPU.

1. The kernel: torch's exp_ over the ranges a softmax meets (scores minus their max; -inf masks), against
   eagle3's `exp_` (eagle3/runtime/floats.py: clamp, exp, flush), in millions of elements per second.
2. The trainer's own step (`Run.backward_rows` + `optimizer_step`, the demo preset's train section) on a real
   store, on the draft's step-0 weights and on a trained checkpoint's, with each fix on and off: the flushing
   exp_ (off: torch's exp_) and flush-to-zero (eagle3/runtime/floats.py). Each setting is a fresh process,
   since the flush mode is fixed when torch's worker threads start. The packs' target argmax is computed by one
   untimed pass first, so both weights are timed as a later epoch's steps are.

    .venv/bin/python -m benchmarks.speed.denormals --hidden runs/demo/extract --verifier runs/demo/verifier \
        --checkpoint runs/demo/train/checkpoints/step-00000400 [--config examples/smollm2-sharegpt.yaml] [--steps 6]

Last line: one JSON object {"exp": {range: {stock, eagle3}}, "train": {setting: {weights: tok/s}}}.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {  # name -> (eagle3's exp_, flush-to-zero)
    "before (torch exp_, IEEE denormals)": (False, False),
    "flushing exp_ only": (True, False),
    "flush-to-zero only": (False, True),
    "both (the trainer now)": (True, True),
}


def exp_rates(n: int = 8_000_000) -> dict[str, dict[str, float]]:
    import torch

    from eagle3.runtime.floats import exp_

    g = torch.Generator().manual_seed(0)
    u = torch.rand(n, generator=g)
    near = torch.rand(n, generator=g) * -10
    ranges = {
        "[-10, 0]": near,
        "[-100, -88]": u * -12 - 88,
        "half [-10, 0], half -inf": torch.where(u < 0.5, near, float("-inf")),
        "half [-10, 0], half [-200, -88]": torch.where(u < 0.5, near, u * -112 - 88),
    }

    def rate(fn, x) -> float:
        best = float("inf")
        for _ in range(5):
            y = x.clone()
            t0 = time.perf_counter()
            fn(y)
            best = min(best, time.perf_counter() - t0)
        return round(n / best / 1e6, 1)

    return {k: {"stock": rate(torch.Tensor.exp_, x), "eagle3": rate(exp_, x)} for k, x in ranges.items()}


def child(a: argparse.Namespace) -> dict[str, float]:
    import torch

    torch.set_flush_denormal(a.flush)  # first: torch's worker threads inherit it when they start
    from eagle3.config import PipelineConfig
    from eagle3.model import attention
    from eagle3.runtime import heap
    from eagle3.storage.manifests import HiddenStates, VerifierWeights
    from eagle3.train import checkpoint as ckpt
    from eagle3.train import distributed as dist
    from eagle3.train import loop, loss, optim

    if not a.eagle3_exp:
        attention.exp_ = loss.exp_ = torch.Tensor.exp_
    heap.retain_freed_memory()
    cfg = PipelineConfig.from_file(a.config).train
    hidden, ver = HiddenStates.read(a.hidden), VerifierWeights.read(a.verifier)
    with tempfile.TemporaryDirectory() as out:
        run = loop.Run(cfg, dist.init(), hidden, ver, Path(a.hidden), Path(a.verifier), Path(out), None, {})
    weights = {"step 0": {k: v.clone() for k, v in run.draft.state_dict().items()},
               Path(a.checkpoint).name: ckpt.load(Path(a.checkpoint))[0]}
    run.build_model()
    packs = loop.epoch_packs(run.lengths, cfg.seed, 0, cfg.pack_tokens)

    def steps(n: int) -> float:
        run.pos = loop.Pos()
        meter, dt = loop.LossSums(cfg.ttt_steps), 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            run.backward_rows(packs, meter)
            optim.step(run.params, run.opt, cfg.grad_clip, None)
            dt += time.perf_counter() - t0
            run.pos.epoch_step += 1
        return round(n * cfg.pack_tokens / dt, 1)

    run.draft.load_state_dict(weights["step 0"])
    steps(a.steps)  # fills the per-sample target argmax of these packs (a later epoch's steps read it cached)
    res = {}
    for name, sd in weights.items():
        run.draft.load_state_dict(sd)
        res[name] = steps(a.steps)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", required=True)
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--checkpoint", required=True, help="a train checkpoint dir of a run on this store")
    ap.add_argument("--config", default=str(REPO / "examples/smollm2-sharegpt.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--child", nargs=2, type=int, metavar=("EAGLE3_EXP", "FLUSH"))
    a = ap.parse_args()
    if a.child:
        a.eagle3_exp, a.flush = map(bool, a.child)
        print(json.dumps(child(a)))
        return
    res: dict = {"exp": exp_rates(), "train": {}}
    for k, v in res["exp"].items():
        print(f"exp_ over {k:32s} torch {v['stock']:8.1f} M/s   eagle3 {v['eagle3']:8.1f} M/s")
    for name, (e, f) in SETTINGS.items():
        cmd = [sys.executable, "-m", __spec__.name, "--hidden", a.hidden, "--verifier", a.verifier, "--checkpoint",
               a.checkpoint, "--config", a.config, "--steps", str(a.steps), "--child", str(int(e)), str(int(f))]
        p = subprocess.run(cmd, capture_output=True, text=True)  # this cwd: the manifests name paths from it
        if p.returncode:
            raise SystemExit(f"{name}: {p.stderr.strip().splitlines()[-1:]}")
        r = res["train"][name] = json.loads(p.stdout.strip().splitlines()[-1])
        print(f"train, {name:36s} " + "   ".join(f"{w}: {t:7.1f} tok/s" for w, t in r.items()), flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
