"""The hop: one stage run as a flow run of its deployment on the `gpu` pool, followed from the calling flow.

When EAGLE3_GPU_DEPLOYMENT names a suffix (deployments/prefect.yaml sets `gpu` for the flows on the `cpu` pool),
the GPU stages hop to the deployment `eagle3-<stage>/<stage>-<suffix>`; both pools must see the same run dirs.
A hop is a task of the calling flow, named after the stage, that starts the stage's flow run (`extract · <run
name>`, linked as a subflow), copies its log lines into the caller's log and waits for it. It carries the
stage task's retry policy: a failed attempt is retried by a new flow run, which resumes from what the last one
committed (this also covers a worker that died mid-stage), and the stage's run count shows on the caller's own
task run. A flow run that ended Failed with a `Final` kind (tasks/_failures.py) is raised as that type, which
the retry condition does not retry.
"""
from __future__ import annotations

import os
import time
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext
from prefect.deployments import run_deployment
from pydantic import BaseModel

from eagle3.runtime.stop import on_unwind
from tasks._failures import raise_for


def gpu_suffix() -> str | None:
    """The GPU deployments' suffix the stages hop to (EAGLE3_GPU_DEPLOYMENT), or None: every stage runs here."""
    return os.environ.get("EAGLE3_GPU_DEPLOYMENT") or None


def deployment(stage: str, suffix: str) -> str:
    """The deployment of `stage` on the gpu pool, as deployments/prefect.yaml names it."""
    return f"eagle3-{stage}/{stage}-{suffix}"


def as_params(inputs: dict[str, Any]) -> dict[str, Any]:
    """Deployment parameters are JSON: configs go as dicts, the stage flow validates them again."""
    return {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in inputs.items()}


def hop_task(policy, label: str):
    """The hop shown as `label`, with the retry policy of `policy` (the stage's own Prefect task)."""
    return hop.with_options(name=label, retries=policy.retries, retry_delay_seconds=policy.retry_delay_seconds,
                            retry_condition_fn=policy.retry_condition_fn)


@task(task_run_name="{name}", cache_policy=NO_CACHE)
def hop(name: str, deployment: str, params: dict, job_variables: dict | None = None) -> None:
    """Run one stage as a flow run of its deployment (with these job variables), its log copied here; raise if
    it did not complete."""
    log = get_run_logger()
    attempt = TaskRunContext.get().task_run.run_count
    parent = FlowRunContext.get().flow_run
    run_name = f"{name} · {parent.name}" + (f" (try {attempt})" if attempt > 1 else "")
    run = run_deployment(deployment, parameters=params, flow_run_name=run_name, timeout=0,
                         job_variables=job_variables)
    log.info("%s: flow run %r of %s", name, run_name, deployment)
    run = follow(run.id, name, log)
    if not run.state.is_completed():
        # a Final kind (the state's name) is raised as its type, which the hop's retry condition does not retry:
        # a new flow run would fail the same way
        raise_for(run.state, f"stage {name}: flow run {run_name!r} of {deployment} ended {run.state.name}: "
                             f"{run.state.message}")


def follow(run_id, name: str, log, poll: float = 2.0):
    """Wait for flow run `run_id` to end, copying its log lines into this run's log as they arrive."""
    from datetime import timedelta

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp
    from prefect.client.schemas.sorting import LogSort

    seen, since = set(), None
    with get_client(sync_client=True) as c:
        def copy() -> None:
            nonlocal since
            # Lines reach the server in batches, not always in order: re-read a window, skip those seen.
            flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]),
                            timestamp=LogFilterTimestamp(after_=since - timedelta(seconds=30)) if since else None)
            offset = 0
            while page := c.read_logs(flt, sort=LogSort.TIMESTAMP_ASC, limit=200, offset=offset):
                for x in page:
                    if x.id not in seen:
                        seen.add(x.id)
                        log.log(x.level, "%s | %s", name, x.message.split("\n", 1)[0])  # tracebacks stay there
                        since = max(since or x.timestamp, x.timestamp)
                offset += len(page)

        while not (run := c.read_flow_run(run_id)).state.is_final():
            copy()
            time.sleep(poll)
        time.sleep(poll)  # the stage's last lines reach the server in the next batch
        copy()
    return run


def wait_all(name: str, futures: list, labels: list[str]) -> list:
    """Wait for the tasks of one stage submitted together (the nodes of a multi-node training, the ranges of an
    extraction, the two sides of an online pair); raise the first failed one's error, after logging every
    failure. Returns their states.

    Nodes: a node that dies ends its peers' torchrun too (a collective or the rendezvous fails), so every node
    task fails and retries, and they meet again at the rendezvous (eagle3/train/launch.py), resuming from the
    last checkpoint; they share one cache key (a finished run's are all cached). Ranges: each retries alone and
    resumes; the finished ones are kept."""
    states = settle(futures)
    failed = [(lb, s) for lb, s in zip(labels, states, strict=True) if not s.is_completed()]
    if failed:
        get_run_logger().error("%s: %s", name, ", ".join(f"{lb} ended {s.name}: {s.message}" for lb, s in failed))
        failed[0][1].result()  # raises that task's own exception
    return states


def settle(futures: list) -> list:
    """Wait for every future (a stop here also stops the tasks' children on their threads); their states."""
    with on_unwind():
        for f in futures:
            f.wait()
    return [f.state for f in futures]
