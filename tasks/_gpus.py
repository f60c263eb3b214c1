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
LEASE_S = 60


def visible_devices() -> list[str]:
    """The devices CUDA_VISIBLE_DEVICES names (set by the gpu pool); none where it is unset or empty."""
    return [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


def gpu_slots() -> int:
    """One slot per device the stage can see (CUDA_VISIBLE_DEVICES, set by the gpu pool), else 1.

    Processes do not pick distinct devices among the visible ones, so a stage holds all of them:
    two stages can never share the 8-GPU host's devices.
    """
    return len(visible_devices()) or 1


def split_devices(*counts: int) -> list[list[str]] | None:
    """The visible devices cut into consecutive groups of `counts` devices, in order (online: the producer's
    tensor x pipeline parallel ranks first, then the trainer's processes), for stages that run side by side.
    None where no devices are named (CPU: each stage holds one slot). Fewer devices than the groups need is an
    error: two stages on one device would fight for its memory."""
    vis = visible_devices()
    if not vis:
        return None
    if len(vis) < sum(counts):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={','.join(vis)} names {len(vis)} devices; the stages that run side by "
                         f"side need {' + '.join(map(str, counts))} = {sum(counts)}")
    out, at = [], 0
    for n in counts:
        out.append(vis[at: at + n])
        at += n
    return out


@contextlib.contextmanager
def cuda_devices(devices: list[str] | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to `devices` while the block runs (an engine whose processes start in it sees only
    those); nothing changes for None. A torch that initialized CUDA in this process before keeps the devices it
    saw then: its cuda:0 is still the first of them, which `split_devices` gives the producer."""
    if devices is None:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def _logger() -> logging.Logger | logging.LoggerAdapter:
    from prefect import get_run_logger

    try:
        return get_run_logger()
    except Exception:  # outside a flow or task run
        return logging.getLogger("eagle3")


@contextlib.contextmanager
def hold_gpus(devices: list[str] | None = None, beside: int = 0) -> Iterator[None]:
    """Wait for, then hold, one slot of the `gpus` limit per device in `devices` (default: `gpu_slots()`)
    while the block runs. `beside`: the slots a stage running at the same time holds (online: the producer's
    and the trainer's); a limit smaller than both together is an error, as each would wait for the other.

    Without such a limit nothing is held. Embedded (`eagle3 run`: a temporary server only this
    process uses) that is expected and logged at DEBUG. On a real server it means concurrent runs
    may share the devices: a WARNING that says how to create the limit. Anything else -- the
    server unreachable or refusing our credentials, more slots asked than the limit has, the
    limit deleted between the check and the acquisition (`strict`) -- raises.
    """
    n = len(devices) if devices is not None else gpu_slots()
    shown = ",".join(devices) if devices is not None else os.environ.get("CUDA_VISIBLE_DEVICES", "")
    with get_client(sync_client=True) as c:
        try:
            size = c.read_global_concurrency_limit_by_name(LIMIT).limit
            exists = True
        except ObjectNotFound:
            exists = False
        embedded, url = c.server_type == ServerType.EPHEMERAL, str(c.api_url)
    if exists and beside and size < n + beside:
        raise ValueError(f"the {LIMIT!r} limit has {size} slots; these side-by-side stages hold {n} + {beside} at once "
                         "(with fewer each would wait for the other): raise it with `python deployments/setup.py "
                         "--gpus N`")
    if not exists:
        if embedded:
            _logger().debug("no %r concurrency limit on the embedded Prefect server: this run's GPU stages run "
                            "without one (nothing else uses this server)", LIMIT)
        else:
            _logger().warning("no %r concurrency limit on the Prefect server at %s: GPU stages of concurrent runs "
                              "are not kept apart; create it with `python deployments/setup.py --gpus N` "
                              "(N = devices on the GPU host)", LIMIT, url)
        with _in_use(n, held=False, devices=shown):
            yield
        return
    # The slots are a lease the holder renews: a holder whose host died stops renewing, and its slots come back
    # LEASE_S later instead of never.
    with concurrency(LIMIT, occupy=n, strict=True, lease_duration=LEASE_S), _in_use(n, held=True, devices=shown):
        yield


@contextlib.contextmanager
def _in_use(slots: int, held: bool, devices: str) -> Iterator[None]:
    """Events `eagle3.gpus.start` / `eagle3.gpus.end` around the GPU work itself (Prefect adds the task and
    flow run): the intervals the server's event log can show never overlap, unlike the limit's own
    acquired/released events, which are sent after the server call and so may straddle a hand-over."""
    from prefect.events import emit_event

    resource = {"prefect.resource.id": f"eagle3.gpus.{socket.gethostname()}", "prefect.resource.name": LIMIT,
                "slots": str(slots), "limit-held": str(held).lower(),
                "devices": devices}
    start = emit_event("eagle3.gpus.start", resource=resource)
    try:
        yield
    finally:
        emit_event("eagle3.gpus.end", resource=resource, follows=start)
