"""The `gpus` global concurrency limit, held by the stages that use the GPU host's devices."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

from prefect.client.orchestration import ServerType, get_client
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound

LIMIT = "gpus"


def gpu_slots() -> int:
    """One slot per device the stage can see (CUDA_VISIBLE_DEVICES, set by the gpu pool), else 1.

    Processes do not pick distinct devices among the visible ones, so a stage holds all of them:
    two stages can never share the 8-GPU host's devices.
    """
    return len([d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]) or 1


def _logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect import get_run_logger

    try:
        return get_run_logger()
    except Exception:  # outside a flow or task run
        return logging.getLogger("eagle3")


@contextlib.contextmanager
def hold_gpus() -> Iterator[None]:
    """Wait for, then hold, `gpu_slots()` slots of the `gpus` limit while the block runs.

    Without such a limit nothing is held. Embedded (`eagle3 run`: a temporary server only this
    process uses) that is expected and logged at DEBUG. On a real server it means concurrent runs
    may share the devices: a WARNING that says how to create the limit. Anything else -- the
    server unreachable or refusing our credentials, more slots asked than the limit has, the
    limit deleted between the check and the acquisition (`strict`) -- raises.
    """
    n = gpu_slots()
    with get_client(sync_client=True) as c:
        try:
            c.read_global_concurrency_limit_by_name(LIMIT)
            exists = True
        except ObjectNotFound:
            exists = False
        embedded, url = c.server_type == ServerType.EPHEMERAL, str(c.api_url)
    if not exists:
        if embedded:
            _logger().debug("no %r concurrency limit on the embedded Prefect server: this run's GPU stages run "
                            "without one (nothing else uses this server)", LIMIT)
        else:
            _logger().warning("no %r concurrency limit on the Prefect server at %s: GPU stages of concurrent runs "
                              "are not kept apart; create it with `python deployments/setup.py --gpus N` "
                              "(N = devices on the GPU host)", LIMIT, url)
        with _in_use(n, held=False):
            yield
        return
    with concurrency(LIMIT, occupy=n, strict=True), _in_use(n, held=True):
        yield


@contextlib.contextmanager
def _in_use(slots: int, held: bool) -> Iterator[None]:
    """Events `eagle3.gpus.start` / `eagle3.gpus.end` around the GPU work itself (Prefect adds the task and
    flow run): the intervals the server's event log can show never overlap, unlike the limit's own
    acquired/released events, which are sent after the server call and so may straddle a hand-over."""
    from prefect.events import emit_event

    resource = {"prefect.resource.id": f"eagle3.gpus.{socket.gethostname()}", "prefect.resource.name": LIMIT,
                "slots": str(slots), "limit-held": str(held).lower(),
                "devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}
    start = emit_event("eagle3.gpus.start", resource=resource)
    try:
        yield
    finally:
        emit_event("eagle3.gpus.end", resource=resource, follows=start)
