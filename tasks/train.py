"""Prefect task for stage 4 (train): torchrun as a subprocess, its output streamed to the run log.

A non-zero exit raises, so Prefect retries; the trainer resumes from its last checkpoint.
"""
from __future__ import annotations

import base64
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from eagle3.config import SPOOL_WAIT_S, TrainConfig
from eagle3.eval.replay import replay_set_dir
from eagle3.runtime.stop import run_child
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import TrainedDraft, VerifierWeights
from eagle3.storage.spool import PRODUCER_BEAT
from eagle3.train.launch import command, finished
from eagle3.train.source import source
from tasks._cache import stage_key, stage_task
from tasks._failures import PartnerGone, UserInputError
from tasks._gpus import gpu_slots, hold_gpus
from tasks._online import OnlineSource, partner_gone, producer_inputs


def _online_key(i: dict[str, Any]) -> dict[str, Any]:
    """The trainer's key beside a producer. The library keys a trained draft on the spool's source.json, but the
    producer writes that file only once it runs, after this key is needed (the two tasks start together), and a
    source.json already there may be an earlier run's. What it will hold follows from the producer's inputs, so
    the key names those instead (the model, the prepared data, the extract settings, the read order, the
    budget), with the verifier's fingerprint, a warm start's weights and the train config."""
    cfg, o = i["cfg"], i["online"]
    o = o if isinstance(o, OnlineSource) else OnlineSource.model_validate(o)
    return {"format": TrainedDraft.format_version, "online": True,
            "producer": producer_inputs(i["model"], i["prepared"], o.extract, cfg, o.spool_bytes,
                                        i.get("trust_remote_code", False)),
            "verifier": VerifierWeights.read(i["verifier"]).fingerprint,
            "init_from": sha256_file(Path(cfg.init_from) / "model.safetensors") if cfg.init_from else None,
            "config": cfg.identity()}


def _train_key(i: dict[str, Any]) -> dict[str, Any]:
    offline = stage_key("train")
    return _online_key(i) if i.get("online") is not None else offline({k: v for k, v in i.items()
                                                                        if k not in ("online", "devices", "node_rank")})


def build_replay(model: str, prepared: str, aux_ids: list[int], cfg: TrainConfig, trust_remote_code: bool, log,
                 env: dict[str, str] | None = None) -> str:
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
        run_streamed(cmd, log, env)
        if not replay_set_dir(model, prepared, cfg.replay_prompts, cfg.replay_max_new_tokens, aux_ids,
                              trust_remote_code=trust_remote_code)[2]:
            raise RuntimeError(f"eagle3 replay-set ended without building the replay set in {d}")
    else:
        log.info("replay set %s: built before (inputs unchanged)", d)
    return str(d)


def run_streamed(cmd: list[str], log, env: dict[str, str] | None = None, writes: tuple[str, ...] = ()) -> str:
    """Run `cmd` (in `env`, default this process's), every output line to the Prefect logger; raise on a
    non-zero exit (so retries apply). Returns the last output line. A stop ends it (`run_child`; `writes`: the
    dirs it writes)."""
    log.info("$ %s", shlex.join(cmd))
    last = ""

    def line(text: str) -> None:
        nonlocal last
        text = text.rstrip().split("\r")[-1]  # progress bars: keep the latest state only
        if text:
            last = text
            log.info(text)

    rc = run_child(cmd, line, env, writes)  # a stop of this process (or of its flow's main thread) ends its tree
    if rc == 2:
        raise UserInputError(f"refused its input (status 2; see the log): {shlex.join(cmd)}")
    if rc:
        raise RuntimeError(f"exited with status {rc}: {shlex.join(cmd)}")
    return last


def metrics_table(m: TrainedDraft) -> list[dict[str, Any]]:
    v = m.val
    rows = [{"what": "optimizer steps", "value": m.steps},
            {"what": "best simulated tau (val)", "value": round(m.best_sim_tau, 4)},
            {"what": "best replay tau (held-out prompts, on-policy)",
             "value": round(m.best_replay_tau, 4) if m.best_replay_tau is not None else "n/a (no replay set)"},
            {"what": "best step (chosen by)", "value": f"{m.best_step} ({m.best_metric})"},
            {"what": "exported step", "value": m.exported_step}]
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
            + f" at step {m.best_step} of {m.steps} (chosen by {m.best_metric}); final/ holds step {m.exported_step}."
            f"\n{img}\n"
            f"Metrics: `{Path(out) / 'metrics.jsonl'}`; curves: `{png}`.\n")


def publish(m: TrainedDraft, out: str) -> None:
    """The stage's artifacts, made by the flow that ran it (a cached task does not rerun its body)."""
    create_table_artifact(metrics_table(m), key="train-metrics", description="eagle3 train: validation metrics")
    create_markdown_artifact(summary_markdown(m, out), key="train-summary", description="eagle3 train: summary")


@stage_task("train", retries=2, delay=10, key=_train_key)
def train_task(hidden: str, verifier: str, out: str, cfg: TrainConfig, verifier_name: str = "", model: str = "",
               prepared: str = "", trust_remote_code: bool = False, online: OnlineSource | None = None,
               devices: list[str] | None = None, node_rank: int = 0) -> TrainedDraft:
    """Train the draft under torchrun; a retry resumes from the last checkpoint. Given the target and the
    prepared dir, first build the replay set (cfg.replay_prompts val prompts) its validation replays.

    `online`: `hidden` is the spool a producer fills beside this task (`eagle3 train --online`); `devices`:
    the GPUs of the trainer's processes (CUDA_VISIBLE_DEVICES), of those the producer does not use; None:
    whatever the process sees. `node_rank`: cfg.nnodes > 1, this task is that node's part, on its own host,
    beside one task per other node (the flow starts them together; each holds its own host's slots)."""
    log, since = get_run_logger(), time.time()
    env = None if devices is None else {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(devices)}
    if online is not None:
        # every producer's engine runs beside this trainer (extract.workers of them)
        beside = (online.producer_slots if devices is not None else gpu_slots()) * online.extract.workers
    else:  # the other nodes hold as many at once: a limit smaller than all together would keep one out for good
        beside = (cfg.nnodes - 1) * (len(devices) if devices is not None else gpu_slots())
    with hold_gpus(devices, beside=beside):
        try:
            replay = None
            if cfg.replay_prompts and model and prepared:
                # online: the layer ids the producer resolved, in the source.json it writes first (waited for)
                data = source(hidden, online is not None, online.wait_s if online else SPOOL_WAIT_S)
                aux = data.manifest().aux_layer_ids
                replay = build_replay(model, prepared, aux, cfg, trust_remote_code, log, env)
            if cfg.nnodes > 1 and finished(hidden, verifier, out, cfg, replay) is not None:
                # a node retried after its peers finished: its torchrun would wait for them at the rendezvous
                log.info("train: %s already holds this run's result (node %d of %d)", out, node_rank, cfg.nnodes)
            else:
                # the stage dir follows its inputs: checkpoints of other inputs are stale, not a conflict
                run_streamed(command(hidden, verifier, out, cfg, verifier_name, restart_on_mismatch=True,
                                     replay=replay, online=online is not None,
                                     wait_s=online.wait_s if online else SPOOL_WAIT_S, node_rank=node_rank), log, env,
                             writes=(out,))
        except UserInputError:
            raise
        except RuntimeError as e:
            if online is not None and partner_gone(hidden, PRODUCER_BEAT, online.wait_s, since):
                raise PartnerGone(f"train: the producer of {hidden} has shown no sign of life for "
                                  f"{online.wait_s:.0f} s; {e}") from e
            raise
    m = TrainedDraft.read(out)
    log.info("train: %s", json.dumps({"steps": m.steps, "best_sim_tau": m.best_sim_tau,
                                      "best_replay_tau": m.best_replay_tau, "best_metric": m.best_metric}))
    return m
