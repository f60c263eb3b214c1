"""Every stage as its own flow, so that a deployment can place it on another work pool.

`run_stage` is how the pipeline and the nightly flow call a stage: in their own process by
default (`eagle3 run`), or, when EAGLE3_GPU_DEPLOYMENT names a deployment (deployments/prefect.yaml
sets it for the flows on the `cpu` pool), the GPU stages hop to `eagle3-<stage>/<that name>` on
the `gpu` pool through `run_deployment`, as subflows. Both pools must see the same run dirs.
"""
from __future__ import annotations

import os

from prefect import flow
from prefect.deployments import run_deployment
from pydantic import BaseModel

from eagle3.artifacts import EvalReport, HiddenStates, PreparedData, TrainedDraft, VerifierWeights
from eagle3.config import EvalConfig, ExtractConfig, PrepareConfig, TrainConfig
from tasks.evaluate import eval_task
from tasks.extract import extract_task
from tasks.prepare import prepare_task
from tasks.train import train_task
from tasks.verifier import verifier_task

STAGES = {"prepare": (prepare_task, PreparedData), "extract": (extract_task, HiddenStates),
          "verifier": (verifier_task, VerifierWeights), "train": (train_task, TrainedDraft),
          "eval": (eval_task, EvalReport)}
GPU_STAGES = ("extract", "train", "eval")


def fresh(task, manifest_cls, out):
    """A cached result whose output dir is gone must rerun, not return a dangling manifest."""
    return task if manifest_cls.exists(out) else task.with_options(refresh_cache=True)


def run_stage(name: str, out: str, wait_for=None, **inputs):
    """Run stage `name` into `out` and return its manifest: here, or on the gpu pool when one is configured."""
    task, manifest_cls = STAGES[name]
    deployment = os.environ.get("EAGLE3_GPU_DEPLOYMENT")
    if not deployment or name not in GPU_STAGES:
        return fresh(task, manifest_cls, out)(out=out, wait_for=wait_for, **inputs)
    # Deployment parameters are JSON: configs go as dicts, the stage flow validates them again.
    params = {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in inputs.items()}
    params["out"] = out
    run = run_deployment(f"eagle3-{name}/{deployment}", parameters=params, poll_interval=2)
    if run.state is None or not run.state.is_completed():
        raise RuntimeError(f"stage {name}: flow run {run.name} of eagle3-{name}/{deployment} ended "
                           f"{run.state.name if run.state else 'without a state'}")
    return manifest_cls.read(out)  # the stage dir is on storage both pools share


@flow(name="eagle3-prepare")
def prepare(model: str, out: str, cfg: PrepareConfig, trust_remote_code: bool = False) -> PreparedData:
    """Stage 1 alone: tokenize and mask conversations, build the draft vocab map."""
    return fresh(prepare_task, PreparedData, out)(model, out, cfg, trust_remote_code)


@flow(name="eagle3-extract")
def extract(model: str, prepared: str, out: str, cfg: ExtractConfig, reuse: list[str] | None = None,
            trust_remote_code: bool = False) -> HiddenStates:
    """Stage 2 alone: store the target's hidden states of a prepared dir, reusing earlier extract dirs."""
    return fresh(extract_task, HiddenStates, out)(model, prepared, out, cfg, reuse, trust_remote_code)


@flow(name="eagle3-verifier")
def verifier(model: str, prepared: str, out: str) -> VerifierWeights:
    """Stage 3 alone: read the target's embedding, final norm and lm_head."""
    return fresh(verifier_task, VerifierWeights, out)(model, prepared, out)


@flow(name="eagle3-train")
def train(hidden: str, verifier: str, out: str, cfg: TrainConfig, verifier_name: str = "") -> TrainedDraft:
    """Stage 4 alone: train the draft under torchrun (a retry resumes from its last checkpoint)."""
    return fresh(train_task, TrainedDraft, out)(hidden, verifier, out, cfg, verifier_name)


@flow(name="eagle3-eval")
def evaluate(model: str, draft: str, out: str, cfg: EvalConfig, trust_remote_code: bool = False) -> EvalReport:
    """Stage 5 alone: acceptance length, speedup and the lossless check of a draft."""
    return fresh(eval_task, EvalReport, out)(model, draft, out, cfg, trust_remote_code)
