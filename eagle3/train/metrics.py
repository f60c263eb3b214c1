"""Training metrics: aggregation across rows and ranks, simulated acceptance, curves.

Simulated acceptance (chain, greedy): at position t, step j's proposal is accepted when the
draft's top-1 equals the target's top-1 at the position it predicts, and a chain stops at
its first miss. The accepted length at t is the number of leading hits, and
    sim_tau = 1 + mean_t accepted(t),
over positions where step 0 is scored. `per_position_acceptance[j]` is the share of those
positions whose chain reaches step j (what vLLM reports per draft position).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from eagle3.storage.atomic import append_text, atomic_write_text


@torch.no_grad()
def chain_acceptance(out) -> tuple[float, float, list[float]]:
    """(sum of accepted lengths, scored positions, positions reaching each step) for one batch.

    out: a `TTTLossOutput`; its per-step hits [B, L] are aligned by position t (step j at t
    proposes token t + j + 2), so a chain at t accepts while every step so far hit.
    """
    chain = torch.stack(out.hits).long().cumprod(0)  # [k, B, L]: 1 while every step so far hit
    return float(chain.sum()), float(out.count[0]), [float(c) for c in chain.sum((1, 2))]


class LossSums:
    """Sums of per-row loss outputs; `reduce` sums them over ranks and forms the means."""

    def __init__(self, k: int):
        self.k = k
        self.v = [0.0] * (3 + 2 * k + 2 + k)  # loss, rows, tokens | correct, count | chain len, scored, reach[k]

    def add(self, out, chain, rows: int, tokens: int) -> None:
        k, v = self.k, self.v
        v[0] += float(out.loss.detach())
        v[1] += rows
        v[2] += tokens
        for j in range(k):
            v[3 + j] += out.correct[j]
            v[3 + k + j] += out.count[j]
        if chain is not None:
            s, n, reach = chain
            v[3 + 2 * k] += s
            v[4 + 2 * k] += n
            for j in range(k):
                v[5 + 2 * k + j] += reach[j]

    def reduce(self, d) -> dict[str, Any]:
        from eagle3.train.distributed import all_sum

        k = self.k
        v = all_sum(self.v, d)
        r = {
            "loss": v[0] / max(v[1], 1),
            "rows": int(v[1]),
            "tokens": int(v[2]),
            "acc": [v[3 + j] / v[3 + k + j] if v[3 + k + j] else 0.0 for j in range(k)],
        }
        if v[4 + 2 * k]:
            n = v[4 + 2 * k]
            r["sim_tau"] = 1.0 + v[3 + 2 * k] / n
            r["per_position_acceptance"] = [v[5 + 2 * k + j] / n for j in range(k)]
        return r


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, in order; a last line torn by a kill or a full disk is left out (the
    resumed run logs that record again)."""
    if not path.is_file():
        return []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    recs = []
    for i, ln in enumerate(lines):
        try:
            recs.append(json.loads(ln))
        except ValueError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not a JSON record") from None
    return recs


def append_record(path: Path, rec: dict[str, Any]) -> None:
    """Append one record (one JSON line)."""
    append_text(path, json.dumps(rec) + "\n")


def truncate_records(path: Path, step: int, last_val: int) -> None:
    """On resume, drop records logged after the checkpoint (train after `step`, val after `last_val`): they will
    be logged again. That includes a validation at the checkpoint's own step that ran after the save (an epoch
    end)."""
    if path.is_file():
        keep = [r for r in read_records(path) if r["step"] <= (last_val if r["split"] == "val" else step)]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def last_val_record(path: Path) -> dict[str, Any]:
    """The last validation record, or {} before the first."""
    vals = [r for r in read_records(path) if r["split"] == "val"]
    return vals[-1] if vals else {}


def plot_curves(metrics: Path, png: Path) -> Path | None:
    """Loss, step-0 accuracy and simulated tau against steps, as a PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    if not metrics.is_file():
        return None
    recs = read_records(metrics)
    tr = [r for r in recs if r["split"] == "train"]
    va = [r for r in recs if r["split"] == "val"]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train")
    ax[0].plot([r["step"] for r in va], [r["loss"] for r in va], "o-", label="val")
    ax[0].set_title("loss (weighted KL)")
    k = len(tr[0]["acc"]) if tr else (len(va[0]["acc"]) if va else 0)
    for j in range(k):
        ax[1].plot([r["step"] for r in va], [r["acc"][j] for r in va], "o-", label=f"val step {j}")
    if tr:
        ax[1].plot([r["step"] for r in tr], [r["acc"][0] for r in tr], alpha=0.4, label="train step 0")
    ax[1].set_title("top-1 agreement with the target")
    ax[2].plot([r["step"] for r in va if "sim_tau" in r], [r["sim_tau"] for r in va if "sim_tau" in r], "o-")
    ax[2].set_title("simulated acceptance length (val)")
    for a in ax:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    ax[0].legend()
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


class TensorBoard:
    """TensorBoard event files under <out>/tb when `tensorboard` is installed; a no-op otherwise."""

    def __init__(self, out: Path, enabled: bool):
        self.w = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional: metrics.jsonl and curves.png always exist
                return
            self.w = SummaryWriter(str(out / "tb"))

    def log(self, rec: dict[str, Any]) -> None:
        if self.w is None:
            return
        split, step = rec["split"], rec["step"]
        for key, v in rec.items():
            if isinstance(v, (int, float)) and key not in ("step", "epoch"):
                self.w.add_scalar(f"{split}/{key}", v, step)
            elif isinstance(v, list):
                for j, x in enumerate(v):
                    self.w.add_scalar(f"{split}/{key}_{j}", x, step)
        self.w.flush()

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
