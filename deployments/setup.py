"""Create (or update) what deployments/prefect.yaml expects on the server: work pools, the `gpus` limit, and
the automation that marks a flow run Crashed when its host stopped beating.

    python deployments/setup.py [--gpus 8] [--silent-s 90]

A flow run whose worker or host dies (power, kernel, a SIGKILL) never reports an end: it would stay Running,
and the pipeline's hop waiting for it with it. Its heartbeat (every PREFECT_FLOWS_HEARTBEAT_FREQUENCY = 30 s,
set by prefect.yaml) stops, so the automation `eagle3: crash silent flow runs` marks it Crashed after
`--silent-s` seconds without one; the hop then retries the stage with a new flow run on a live worker, which
resumes from what the dead one committed.

Idempotent: rerunning it resets the pools' job templates and the limit's size. Uses the server that
PREFECT_API_URL names.
"""
from __future__ import annotations

import argparse
from datetime import timedelta

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate, WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists
from prefect.workers.process import ProcessWorker

POOLS = {
    "cpu": "eagle3 flows and the CPU stages (prepare, verifier): any host",
    "gpu": "eagle3 GPU stages (extract, train, eval): the 8-GPU host only",
}


def main(argv: list[str] | None = None) -> None:
    """Create the `cpu` and `gpu` process pools and the `gpus` global concurrency limit."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=8, help="size of the `gpus` limit: devices on the GPU hosts together")
    p.add_argument("--silent-s", type=int, default=90, help="seconds without a heartbeat after which a flow run is "
                   "marked Crashed (above the 30 s heartbeat, with room for a late one)")
    a = p.parse_args(argv)
    template = ProcessWorker.get_default_base_job_template()
    with get_client(sync_client=True) as c:
        for name, description in POOLS.items():
            c.create_work_pool(WorkPoolCreate(name=name, type="process", description=description,
                                              base_job_template=template), overwrite=True)
            print(f"work pool {name!r}: process")
        try:
            c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="gpus", limit=a.gpus))
        except ObjectAlreadyExists:
            c.update_global_concurrency_limit("gpus", GlobalConcurrencyLimitUpdate(limit=a.gpus))
        print(f"global concurrency limit 'gpus': {a.gpus} slots")
        for old in c.read_automations_by_name(ZOMBIES):
            c.delete_automation(old.id)
        c.create_automation(silent_runs(a.silent_s))
        print(f"automation {ZOMBIES!r}: a flow run silent for {a.silent_s} s is marked Crashed")


ZOMBIES = "eagle3: crash silent flow runs"


def silent_runs(silent_s: int):
    """A flow run that sent a heartbeat and then, within `silent_s`, neither another one nor an end: Crashed."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    ends = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    return AutomationCore(
        name=ZOMBIES, description="a flow run whose host stopped beating is marked Crashed (its hop then retries it)",
        trigger=EventTrigger(after={"prefect.flow-run.heartbeat"}, expect={"prefect.flow-run.heartbeat", *ends},
                             match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                             for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
                             within=timedelta(seconds=silent_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {silent_s} s: its worker or host is gone")])


if __name__ == "__main__":
    main()
