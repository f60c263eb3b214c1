"""Prefect task for stage 4 (train): torchrun as a subprocess, its output streamed to the run log.

A non-zero exit raises, so Prefect retries; the trainer resumes from its last checkpoint.
"""
from __future__ import annotations

import base64
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eagle3.config import TrainConfig
from eagle3.eval.replay import replay_set_dir
from eagle3.storage.manifests import HiddenStates, TrainedDraft
from eagle3.train.launch import command
from tasks._cache import stage_task
from tasks._gpus import hold_gpus


def build_replay(model: str, prepared: str, aux_ids: list[int], cfg: TrainConfig, trust_remote_code: bool, log) -> str:
    """The replay set's dir, from the library (content-cached: a set built before is found without loading
    the model); one not built yet is built by `eagle3 replay-set` in a subprocess, so the target's memory,
    GPU included, is freed before training."""
    d, _, built = replay_set_dir(model, prepared, cfg.replay_prompts, cfg.replay_max_new_tokens, aux_ids,
                                 trust_remote_code=trust_remote_code)
    if not built:
        cmd = [sys.executable, "-m", "eagle3.cli", "replay-set", "--model", model, "--prompts", prepared,
               "--limit", str(cfg.replay_prompts), "--max-new-tokens", str(cfg.replay_max_new_tokens),
               "--aux-layers", ",".join(map(str, aux_ids))]
        cmd += ["--threads", str(cfg.threads)] if cfg.threads else []
        cmd += ["--trust-remote-code"] if trust_remote_code else []
        run_streamed(cmd, log)
        if not replay_set_dir(model, prepared, cfg.replay_prompts, cfg.replay_max_new_tokens, aux_ids,
                              trust_remote_code=trust_remote_code)[2]:
            raise RuntimeError(f"eagle3 replay-set ended without building the replay set in {d}")
    else:
        log.info("replay set %s: built before (inputs unchanged)", d)
    return str(d)


def run_streamed(cmd: list[str], log) -> str:
    """Run `cmd`, every output line to the Prefect logger; raise on a non-zero exit (so retries apply).
    Returns the last output line."""
    log.info("$ %s", shlex.join(cmd))
    last = ""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as p:
        for line in p.stdout:
            line = line.rstrip()
            last = line or last
            if line and "\r" not in line:
                log.info(line)
            elif line:
                log.info(line.split("\r")[-1])  # progress bars: keep the latest state only
    if p.returncode == 2:
        raise UserInputError(f"refused its input (status 2; see the log): {shlex.join(cmd)}")
    if p.returncode:
        raise RuntimeError(f"exited with status {p.returncode}: {shlex.join(cmd)}")
    return last


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
            {"what": "best replay tau (held-out prompts, on-policy)",
             "value": round(m.best_replay_tau, 4) if m.best_replay_tau is not None else "n/a (no replay set)"},
            {"what": "best step (chosen by)", "value": f"{m.best_step} ({m.best_metric})"}]
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
            f"best simulated tau **{m.best_sim_tau:.3f}**"
            + (f", replay tau **{m.best_replay_tau:.3f}**" if m.best_replay_tau is not None else "")
            + f" at step {m.best_step} of {m.steps} (chosen by {m.best_metric}).\n{img}\n"
            f"Metrics: `{Path(out) / 'metrics.jsonl'}`; curves: `{png}`.\n")


def publish(m: TrainedDraft, out: str) -> None:
    """The stage's artifacts, made by the flow that ran it (a cached task does not rerun its body)."""
    create_table_artifact(metrics_table(m), key="train-metrics", description="eagle3 train: validation metrics")
    create_markdown_artifact(summary_markdown(m, out), key="train-summary", description="eagle3 train: summary")


@stage_task("train", retries=2, delay=10, retry_condition_fn=_retry)
def train_task(hidden: str, verifier: str, out: str, cfg: TrainConfig, verifier_name: str = "", model: str = "",
               prepared: str = "", trust_remote_code: bool = False) -> TrainedDraft:
    """Train the draft under torchrun; a retry resumes from the last checkpoint. Given the target and the
    prepared dir, first build the replay set (cfg.replay_prompts val prompts) its validation replays."""
    log = get_run_logger()
    with hold_gpus():
        replay = None
        if cfg.replay_prompts and model and prepared:
            replay = build_replay(model, prepared, HiddenStates.read(hidden).aux_layer_ids, cfg, trust_remote_code, log)
        # the stage dir follows its inputs: checkpoints of other inputs are stale, not a conflict
        run_streamed(command(hidden, verifier, out, cfg, verifier_name, restart_on_mismatch=True, replay=replay), log)
    m = TrainedDraft.read(out)
    log.info("train: %s", json.dumps({"steps": m.steps, "best_sim_tau": m.best_sim_tau,
                                      "best_replay_tau": m.best_replay_tau, "best_metric": m.best_metric}))
    return m
