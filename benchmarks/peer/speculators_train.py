"""Train speculators' EAGLE-3 head on the data eagle3 trains on: the peer row of the draft-quality table.

Runs in the peer venv (benchmarks/peer/setup.sh makes it, outside the work tree: speculators from the registry,
never a dependency of eagle3), on
the dir benchmarks/peer/speculators_data.py wrote. speculators' own trainer, loss and defaults (optimizer, lr and
schedule, loss decay, bf16 autocast) with these set to the run being compared: the epochs, the tokens per step
(`--total-seq-len`, eagle3's pack_tokens), the unroll (`--ttt-steps`), the draft vocab (eagle3's d2t/t2d), the aux
layers (the store's), the seed, and the train/val boundary (eagle3's split).

speculators 0.9.0 trains on an accelerator only: it moves batches to the device index of its local rank and
autocasts for the accelerator's type. On a CPU-only torch the runner points those at the CPU (three attributes,
set before the trainer is built); the model, loss, optimizer and schedule are speculators' own code, unchanged.

The exported head (the last epoch's checkpoint, speculators' layout) is scored like any eagle3 head:
    .venv/bin/eagle3 eval --draft runs/peer/train/checkpoints/2 --mode replay ...
(benchmarks/experiments/levers.py `--score peer=DIR` does this and pairs it against the other rows).

    ~/.cache/eagle3-peer/venv/bin/python benchmarks/peer/speculators_train.py --data runs/peer/data \\
        --verifier assets/smollm2 --out runs/peer/train --epochs 3 --total-seq-len 2048 --ttt-steps 3 --threads 2
"""
from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import time
from pathlib import Path


def dataset(data: Path) -> Path:
    """speculators' Arrow dataset (input_ids, loss_mask, seq_len as torch tensors) beside the hidden-state files,
    built once from samples.parquet."""
    from datasets import Dataset

    out = data / "arrow"
    if (out / "state.json").is_file():
        return out
    ds = Dataset.from_parquet(str(data / "samples.parquet")).select_columns(["input_ids", "loss_mask", "seq_len"])
    ds.set_format("torch")
    tmp = data / "arrow.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    tmp.rename(out)
    (out / "hidden_states").symlink_to(data.resolve() / "hidden_states")  # speculators reads <data>/hidden_states
    return out


def on_cpu() -> None:
    """Point speculators' trainer at the CPU (see the module docstring)."""
    import torch
    from speculators.train import trainer

    trainer.get_local_rank = lambda: "cpu"  # tensors go .to(local_rank)
    torch.accelerator.synchronize = lambda *a, **k: None  # its step timer syncs the accelerator
    init = trainer.Trainer.__init__

    def cpu_init(self, *a, **k):
        init(self, *a, **k)
        self.device_type = "cpu"  # autocast's device type

    trainer.Trainer.__init__ = cpu_init


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="the dir speculators_data.py wrote")
    ap.add_argument("--verifier", required=True, help="the target model dir")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--total-seq-len", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attn", default="sdpa", help="speculators' draft_attn_impl (its flex attention is for GPUs)")
    ap.add_argument("extra", nargs="*", help="more speculators train flags, as --key=value")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    meta = json.loads((a.data / "meta.json").read_text())
    arrow = dataset(a.data)
    # int() of samples x ratio is the boundary: half a sample over it keeps float rounding off the edge
    ratio = (meta["train_samples"] + 0.5) / meta["samples"]
    argv = [f"--verifier-name-or-path={a.verifier}", f"--data-path={arrow}", "--speculator-type=eagle3",
            f"--d2t-path={a.data / 'd2t.npy'}", f"--t2d-path={a.data / 't2d.npy'}",
            f"--draft-vocab-size={meta['draft_vocab']}",
            "--target-layer-ids", *[str(i) for i in meta["aux_layer_ids"]],
            f"--epochs={a.epochs}", f"--total-seq-len={a.total_seq_len}", f"--ttt-steps={a.ttt_steps}",
            f"--train-data-ratio={ratio}", f"--seed={a.seed}", f"--save-path={a.out / 'checkpoints'}",
            f"--log-dir={a.out / 'logs'}", f"--draft-attn-impl={a.attn}", "--num-workers=0", "--on-missing=raise",
            # its fused losses are Triton kernels (GPU only); eager computes the same losses in torch
            "--loss-implementation=eager",
            *a.extra]
    on_cpu()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    t0, c0 = time.time(), time.process_time()
    train(TrainConfig.resolve(argv))
    ru = resource.getrusage(resource.RUSAGE_SELF)
    summary = {"wall_s": round(time.time() - t0, 1), "cpu_s": round(time.process_time() - c0, 1),
               "max_rss_mb": round(ru.ru_maxrss / 1024), "argv": argv, "train_tokens": meta["train_tokens"]}
    (a.out / "run.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
