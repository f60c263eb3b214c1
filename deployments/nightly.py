"""Turn the nightly retrain on (with its conversations) or off, on the server PREFECT_API_URL names.

    python deployments/nightly.py --conversations /data/chats [--root runs/nightly] [--seed-run runs/demo]
    python deployments/nightly.py --pause

`prefect deploy` leaves eagle3-nightly paused and without conversations (a redeploy does so
again). Turning it on checks the source first (it must hold conversation files with data),
stores it in the deployment's parameters (the form and every scheduled run read them) and
activates the schedule; it prints when the next night starts, in the schedule's time zone.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: flows/ is beside this dir

DEPLOYMENT = "eagle3-nightly/eagle3-nightly"


def main(argv: list[str] | None = None) -> None:
    """Set the nightly deployment's source and resume its schedule, or pause it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    on = p.add_mutually_exclusive_group(required=True)
    on.add_argument("--conversations", help="directory (or glob) of conversation files each night reads")
    on.add_argument("--pause", action="store_true", help="pause the schedule (parameters stay as they are)")
    p.add_argument("--root", default=None, help="where nights and promoted.json live (default: as deployed)")
    p.add_argument("--seed-run", default=None, help="a pipeline run dir whose draft counts as promoted at first")
    a = p.parse_args(argv)

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.server.schemas.schedules import CronSchedule

    from flows.nightly import NightlyConfig, check_source

    with get_client(sync_client=True) as c:
        dep = c.read_deployment_by_name(DEPLOYMENT)
        if not a.pause:
            try:
                check_source(a.conversations)
            except ValueError as e:
                sys.exit(f"deployments/nightly.py: {e}")
            config = {**dep.parameters.get("config", {}), "conversations": a.conversations}
            config.update({k: v for k, v in (("root", a.root), ("seed_run", a.seed_run)) if v is not None})
            # Validated here, not at 2 a.m.; stored whole, as the run form expects every key it requires.
            config = NightlyConfig.model_validate(config).model_dump(mode="json")
            c.update_deployment(dep.id, DeploymentUpdate(parameters={**dep.parameters, "config": config}))
            print(f"{DEPLOYMENT}: conversations {a.conversations}, root {config['root']}")
        for s in c.read_deployment_schedules(dep.id):
            c.update_deployment_schedule(dep.id, s.id, active=not a.pause)
            sched = s.schedule
            if a.pause:
                print(f"schedule {s.slug or s.id}: paused")
            elif getattr(sched, "cron", None):
                (nxt,) = asyncio.run(CronSchedule(cron=sched.cron, timezone=sched.timezone).get_dates(n=1))
                print(f"schedule {s.slug or s.id}: active, cron {sched.cron!r} in {sched.timezone}; "
                      f"next night starts {nxt.strftime('%Y-%m-%d %H:%M')} {sched.timezone}")
            else:
                print(f"schedule {s.slug or s.id}: active")


if __name__ == "__main__":
    main()
