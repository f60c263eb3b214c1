"""The `gpus` global concurrency limit, held by the stages that use the GPU host's devices."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
from prefect.client.orchestration import ServerType, get_client
from prefect.exceptions import ObjectNotFound

LIMIT = "gpus"
LEASE_S = 60  # a dead holder's slots come back this long after its last renewal
RENEW_S = 10


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
    with leased(n), _in_use(n, held=True, devices=shown):
        yield


@contextlib.contextmanager
def leased(n: int) -> Iterator[None]:
    """Hold `n` slots of the limit as a lease renewed every RENEW_S: a holder whose host died stops renewing, and
    its slots come back LEASE_S later instead of never.

    Prefect's own `concurrency()` renews every 45 s and, after three tries in a few seconds, ends the work (with
    `strict`) or stops renewing (without): a server restarted at that moment ended a stage that would have gone
    on (measured by benchmarks/drills/restart.py). Here a renewal that cannot reach the server is tried again
    every 2 s for as long as the lease can still be alive; only a lease the server no longer has, or one that
    may have run out, stops the stage (as SIGTERM to this process: a clean stop, and the retry resumes), so
    that its devices are never used by two stages at once."""
    from prefect.concurrency._events import emit_concurrency_acquisition_events, emit_concurrency_release_events
    from prefect.concurrency._sync import acquire_concurrency_slots_with_lease

    got = acquire_concurrency_slots_with_lease([LIMIT], n, lease_duration=LEASE_S, strict=True)
    events = emit_concurrency_acquisition_events(got.limits, n)
    stop = threading.Event()
    renew = threading.Thread(target=_renew, args=(got.lease_id, stop, threading.main_thread().ident), daemon=True,
                             name="eagle3-gpus-lease")
    renew.start()
    try:
        yield
    finally:
        stop.set()
        renew.join(5)  # a renewal in flight may wait on a server that is down
        _release(got.lease_id)
        emit_concurrency_release_events(got.limits, n, events)


def _renew(lease_id, stop: threading.Event, main: int | None) -> None:
    log = logging.getLogger("eagle3")
    last = time.monotonic()  # the lease's last renewal: it lives until last + LEASE_S
    with get_client(sync_client=True) as c:
        while not stop.wait(RENEW_S if time.monotonic() - last < RENEW_S else 2.0):
            try:
                c.renew_concurrency_lease(lease_id=lease_id, lease_duration=LEASE_S)
                last = time.monotonic()
                continue
            except Exception as e:  # anything but "no such lease" may pass: try again while it lives
                if isinstance(e, httpx.HTTPStatusError) and e.response.status_code == 404:
                    why = "the server no longer has it (restarted with its leases in memory?)"
                elif time.monotonic() - last < LEASE_S - 5:
                    log.warning("gpus lease: renewal failed (%s: %s); trying again", type(e).__name__, e)
                    continue
                else:
                    why = f"no renewal went through for {time.monotonic() - last:.0f} s ({type(e).__name__}: {e})"
            log.error("gpus lease %s lost: %s; stopping this stage so that its devices are not shared (its "
                      "retry resumes)", lease_id, why)
            if main is not None:
                signal.pthread_kill(main, signal.SIGTERM)
            return


def _release(lease_id) -> None:
    """Give the slots back, trying again while the server restarts; failing that, the lease runs out by itself."""
    with get_client(sync_client=True) as c:
        for attempt in range(10):
            try:
                c.release_concurrency_slots_with_lease(lease_id=lease_id)
                return
            except httpx.HTTPStatusError as e:
                if e.response.status_code == 404:  # gone already (it ran out): nothing is held
                    return
                raise
            except httpx.TransportError:
                if attempt == 9:
                    logging.getLogger("eagle3").warning("gpus lease %s: not released (server unreachable); its "
                                                        "slots come back when it runs out", lease_id)
                    return
                time.sleep(min(2 ** attempt, 10))


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
