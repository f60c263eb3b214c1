"""Prefect task for stage 4 (train): torchrun as a subprocess, its output streamed to the run log.

A non-zero exit raises, so Prefect retries; the trainer resumes from its last checkpoint.
"""
from __future__ import annotations

import base64
import json
import shlex
import subprocess
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eagle3.manifests import TrainedDraft
from eagle3.config import TrainConfig
from eagle3.train.__main__ import command
from eagle3.train.loop import inputs
from tasks._cache import stage_task
from tasks._gpus import hold_gpus


def _key(i: dict[str, Any]) -> dict[str, Any]:
    return {"format": TrainedDraft.format_version, **inputs(i["hidden"], i["verifier"], i["cfg"])}


def run_streamed(cmd: list[str], log) -> None:
    """Run `cmd`, every output line to the Prefect logger; raise on a non-zero exit (so retries apply)."""
    log.info("$ %s", shlex.join(cmd))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as p:
        for line in p.stdout:
            line = line.rstrip()
            if line and "\r" not in line:
                log.info(line)
            elif line:
                log.info(line.split("\r")[-1])  # progress bars: keep the latest state only
    if p.returncode == 2:
        raise UserInputError(f"training refused its input (status 2; see the log): {shlex.join(cmd)}")
    if p.returncode:
        raise RuntimeError(f"torchrun exited with status {p.returncode}: {shlex.join(cmd)}")


class UserInputError(RuntimeError):
    """Bad input or config: retrying cannot help."""


def _retry(task, task_run, state) -> bool:
    """Retry crashes and kills (the trainer resumes), not refused input."""
    try:
        state.result()
    except UserInputError:
        return False
    except Exception:
        return True
    return True


def metrics_table(m: TrainedDraft) -> list[dict[str, Any]]:
    v = m.val
    rows = [{"what": "optimizer steps", "value": m.steps},
            {"what": "best simulated tau (val)", "value": round(m.best_sim_tau, 4)},
            {"what": "best step", "value": m.best_step}]
    if v:
        rows.append({"what": "val loss", "value": round(v["loss"], 5)})
        rows += [{"what": f"val top-1 step {j}", "value": round(a, 4)} for j, a in enumerate(v["acc"])]
    return rows


def summary_markdown(m: TrainedDraft, out: str) -> str:
    png = Path(out) / "curves.png"
    img = ""
    if png.is_file():
        img = f"\n![training curves](data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()})\n"
    return (f"# eagle3 train\n\nDraft exported to `{Path(out) / m.final_dir}` ({m.export_format} format): "
            f"best simulated tau **{m.best_sim_tau:.3f}** at step {m.best_step} of {m.steps}.\n{img}\n"
            f"Metrics: `{Path(out) / 'metrics.jsonl'}`; curves: `{png}`.\n")


def headline(m: TrainedDraft) -> str:
    return f"{m.steps} steps, best simulated tau {m.best_sim_tau:.3f} at step {m.best_step}"


def publish(m: TrainedDraft, out: str) -> None:
    """The stage's artifacts, made by the flow that ran it (a cached task does not rerun its body)."""
    create_table_artifact(metrics_table(m), key="train-metrics", description="eagle3 train: validation metrics")
    create_markdown_artifact(summary_markdown(m, out), key="train-summary", description="eagle3 train: summary")


@stage_task("train", _key, retries=2, delay=10, retry_condition_fn=_retry)
def train_task(hidden: str, verifier: str, out: str, cfg: TrainConfig, verifier_name: str = "") -> TrainedDraft:
    """Train the draft under torchrun; a retry resumes from the last checkpoint."""
    log = get_run_logger()
    with hold_gpus():
        # the stage dir follows its inputs: checkpoints of other inputs are stale, not a conflict
        run_streamed(command(hidden, verifier, out, cfg, verifier_name, restart_on_mismatch=True), log)
    m = TrainedDraft.read(out)
    log.info("train: %s", json.dumps({"steps": m.steps, "best_sim_tau": m.best_sim_tau}))
    return m
