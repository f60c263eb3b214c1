"""Create (or update) what deployments/prefect.yaml expects on the server: work pools and the `gpus` limit.

    python deployments/setup.py [--gpus 8]

Idempotent: rerunning it resets the pools' job templates and the limit's size. Uses the server that
PREFECT_API_URL names.
"""
from __future__ import annotations

import argparse

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
    p.add_argument("--gpus", type=int, default=8, help="size of the `gpus` limit: devices on the GPU host")
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


if __name__ == "__main__":
    main()
