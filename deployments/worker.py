"""A Prefect process worker for one pool that stops within seconds on SIGTERM or SIGINT.

    python deployments/worker.py --pool cpu [--name NAME] [--limit N]

The same worker as `prefect worker start --pool cpu --type process`, minus its signal handling:
Prefect 3.9's CLI turns a SIGTERM into a SIGINT to itself, and the worker then keeps polling
(measured here: still running 30 s after one SIGTERM; a second SIGTERM SIGKILLs it). Here
either signal cancels the worker: it stops polling, terminates the flow runs it started (they
end Crashed; a rerun resumes from what their stage committed) and exits. Uses the server that
PREFECT_API_URL names.
"""
from __future__ import annotations

import argparse
import asyncio
import signal


async def serve(pool: str, name: str | None, limit: int | None) -> None:
    """Run the worker until SIGTERM or SIGINT cancels it."""
    from prefect.workers.process import ProcessWorker

    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, task.cancel)
    async with ProcessWorker(work_pool_name=pool, name=name, limit=limit) as worker:
        try:
            await worker.start()
        except asyncio.CancelledError:
            print(f"worker {worker.name!r} stopped", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Start a process worker on `--pool`."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--pool", required=True, help="work pool to poll (cpu or gpu)")
    p.add_argument("--name", default=None, help="worker name shown in the UI (default: a generated one)")
    p.add_argument("--limit", type=int, default=None, help="flow runs at once at most (default: no limit)")
    a = p.parse_args(argv)
    asyncio.run(serve(a.pool, a.name, a.limit))


if __name__ == "__main__":
    main()
