"""The trainer's tests' shared setup: the tiny Llama's prepared data, hidden states, verifier and replay set (a
module fixture), and torchrun started the way the tests run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
AUX = [1, 3, 4]  # the 6-layer tiny Llama: (2, N//2, N-3) would repeat 3



FLAGS = ["--ttt-steps", "2", "--pack-tokens", "192", "--log-every", "1", "--val-every", "1000",
         "--ckpt-every", "2", "--warmup-steps", "1", "--threads", "1", "--lr", "1e-3"]



def run_train(stages: Path, out: Path, *extra: str, nproc: int = 1, wait: bool = True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "eagle3.train", "--hidden", str(stages / "hid"), "--verifier", str(stages / "ver"),
           "--out", str(out), *FLAGS, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    if wait:
        text = p.communicate(timeout=600)[0]
        assert p.returncode == 0, text[-3000:]
    return p



def losses(out: Path) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r["split"] == "train"}
