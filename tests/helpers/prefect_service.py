"""A real eagle3 service for tests/integration/test_deployments.py and benchmarks/drills/load.py: `prefect server
start` with basic auth on, pools + the `gpus` limit (deployments/setup.py), deployments/prefect.yaml deployed, one
process worker per pool; and what both read back through the API: runs, GPU intervals, output checksums.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STAGES = ["prepare", "extract", "verifier", "train", "eval"]
LEASES = "prefect.server.concurrency.lease_storage.filesystem"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, log: Path, **kw) -> subprocess.Popen:
    """A process in its own session (so its whole group can be stopped), output to `log`."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, **kw)


def stop(p: subprocess.Popen) -> None:
    """SIGTERM the process group, SIGKILL it if it lingers."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@dataclass
class Service:
    url: str
    auth: str  # "user:password", PREFECT_SERVER_API_AUTH_STRING on the server, PREFECT_API_AUTH_STRING on clients
    home: Path
    env: dict[str, str]  # a client's environment: URL and credentials
    seconds: dict[str, float] = field(default_factory=dict)
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)  # worker name -> its process
    specs: dict[str, tuple[list[str], dict, Path]] = field(default_factory=dict)  # worker name -> cmd, env, log
    procs: list[subprocess.Popen] = field(default_factory=list)  # the server first, stopped on exit

    def kill_server(self) -> None:
        """SIGKILL the server's whole process group, as a crashed host does: nothing of it gets to clean up."""
        os.killpg(self.procs[0].pid, signal.SIGKILL)
        self.procs[0].wait()

    def start_server(self, timeout: float = 120) -> float:
        """Start the server again on the same port and PREFECT_HOME (its database); seconds until it answers."""
        cmd, env, log = self.specs["server"]
        t0 = time.time()
        self.procs[0] = start(cmd, env, log.with_suffix(f".{int(t0)}.log"))
        _wait_healthy(self.url, self.procs[0], log, timeout)
        return time.time() - t0

    def restart(self, name: str) -> None:
        """Start worker `name` again where it died (a test killed it): its host came back. A test that kills a
        worker brings it back, so the tests after it in the module find every worker (a two-node train waits at
        its rendezvous for a second host that never comes, otherwise)."""
        if self.workers[name].poll() is None:
            return
        cmd, env, log = self.specs[name]
        self.workers[name] = start(cmd, env, log.with_suffix(f".{int(time.time())}.log"), cwd=REPO)

    def check_workers(self) -> None:
        """Every worker is alive: fail now, naming the dead, instead of waiting on a run nobody takes."""
        dead = [n for n, w in self.workers.items() if w.poll() is not None]
        assert not dead, f"worker(s) {', '.join(dead)} not running (an earlier test killed them?)"

    @contextlib.contextmanager
    def client(self) -> Iterator:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: self.url, PREFECT_API_AUTH_STRING: self.auth}), \
                get_client(sync_client=True) as c:
            yield c

    def setup(self, gpus: int, silent_s: int = 90) -> None:
        """deployments/setup.py: pools `cpu` and `gpu`, the `gpus` limit of `gpus` slots, silent runs Crashed."""
        r = subprocess.run([sys.executable, "deployments/setup.py", "--gpus", str(gpus), "--silent-s", str(silent_s)],
                           cwd=REPO, env=self.env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr


@contextlib.contextmanager
def service(home: Path, gpus: int = 8, worker_env: dict[str, dict[str, str]] | None = None,
            while_booting: Callable[[], object] | None = None, gpu_workers: int = 1,
            silent_s: int = 90, gpu_limit: int | None = None) -> Iterator[Service]:
    """The whole service on a free loopback port, stopped (every process group) on exit. `gpu_workers`: process
    workers on the gpu pool (eagle3-gpu, eagle3-gpu-2, ...: GPU hosts), each in its own process group,
    `Service.workers` by name (a test may kill one); `gpu_limit`: flow runs each gpu worker takes at once (one
    per host for stages that each hold all of a host's devices)."""

    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    auth = f"eagle3:{secrets.token_hex(16)}"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_WORKER_QUERY_SECONDS": "1", "EAGLE3_REPO": str(REPO), "PREFECT_API_AUTH_STRING": auth}
    for k in ("EAGLE3_FAIL_ONCE", "EAGLE3_GPU_DEPLOYMENT", "PREFECT_SERVER_API_AUTH_STRING"):
        env.pop(k, None)
    t0, s = time.time(), None
    # The server checks the credentials (PREFECT_SERVER_API_AUTH_STRING); the clients send theirs.
    # Leases of the `gpus` slots on disk (docs/service.md): held in memory, a restarted server loses them while
    # their slots stay counted as taken, for good.
    server = ([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
              {**env, "PREFECT_SERVER_API_AUTH_STRING": auth, "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": LEASES},
              home / "server.log")
    procs = [start(*server)]
    try:
        if while_booting is not None:
            while_booting()
        _wait_healthy(url, procs[0], home / "server.log", 120)
        s = Service(url, auth, home, env, {"server": time.time() - t0}, procs=procs)
        s.specs["server"] = server
        s.setup(gpus, silent_s)
        # Deploy (it imports every flow) while the workers boot.
        deploy = start([str(BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file",
                        "deployments/prefect.yaml"], env, home / "deploy.log", cwd=REPO)
        procs.append(deploy)
        names = [("cpu", "eagle3-cpu")] + [("gpu", "eagle3-gpu" + (f"-{k + 1}" if k else ""))
                                           for k in range(gpu_workers)]
        for pool, name in names:
            limit = ["--limit", str(gpu_limit)] if pool == "gpu" and gpu_limit else []
            s.specs[name] = ([sys.executable, "deployments/worker.py", "--pool", pool, "--name", name, *limit],
                             {**env, **(worker_env or {}).get(pool, {})}, home / f"worker-{name}.log")
            s.workers[name] = start(*s.specs[name], cwd=REPO)
        assert deploy.wait(180) == 0, (home / "deploy.log").read_text()[-4000:]
        s.seconds["ready"] = time.time() - t0
        yield s
    finally:
        for p in [*(s.workers.values() if s is not None else ()), *reversed(procs)]:
            stop(p)


def _wait_healthy(url: str, p: subprocess.Popen, log: Path, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while True:
        assert p.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:  # the one path open to anyone
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, f"prefect server did not come up in {timeout:.0f} s"
        time.sleep(0.5)


# ---------------------------------------------------------------- runs
def submit(client, deployment: str, parameters: dict, job_variables: dict | None = None):
    dep = client.read_deployment_by_name(deployment)
    return client.create_flow_run_from_deployment(dep.id, parameters=parameters, job_variables=job_variables)


def wait(client, runs: list, timeout: float) -> list:
    """Poll until every flow run is in a final state; the runs as the server has them then."""
    deadline = time.time() + timeout
    while True:
        now = [client.read_flow_run(r.id) for r in runs]
        if all(r.state.is_final() for r in now):
            return now
        pending = [f"{r.name}: {r.state.name}" for r in now if not r.state.is_final()]
        assert time.time() < deadline, f"still running after {timeout} s: {pending}"
        time.sleep(1)


def trigger(client, deployment: str, parameters: dict, job_variables: dict | None = None, timeout: float = 360):
    """Start a deployment's run through the API and wait for its final state."""
    return wait(client, [submit(client, deployment, parameters, job_variables)], timeout)[0]


def task_counts(client, run) -> dict[str, int]:
    """Task runs per stage of a flow run (a stage retried or run again counts more than once)."""
    from collections import Counter

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    trs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    return dict(Counter(t.name.rsplit("-", 1)[0] for t in trs if t.name.rsplit("-", 1)[0] in STAGES))


def worker_of(service: Service, pid: int) -> tuple[str, list] | None:
    """The gpu worker whose process tree holds `pid`: its name and that tree (psutil processes, the worker
    first), or None if no gpu worker holds it."""
    import psutil

    for name, w in service.workers.items():
        try:
            tree = [psutil.Process(w.pid), *psutil.Process(w.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        if name.startswith("eagle3-gpu") and pid in {p.pid for p in tree}:
            return name, tree
    return None


def kill_worker_of(service: Service, pid: int) -> str | None:
    """SIGKILL the gpu worker whose process tree holds `pid`, with every process it started, as a host that dies
    does; the worker's name, or None if no gpu worker holds it."""
    import psutil

    if (found := worker_of(service, pid)) is None:
        return None
    name, tree = found
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    service.workers[name].wait(30)  # dead (and reaped) before anyone starts it again
    return name


def subflows(client, run) -> list:
    """The flow runs started from `run` (a stage's hop to its deployment, each try)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(
        any_=[run.id])))


def logs(client, run) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    return "\n".join(x.message for x in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))))


def events(client, names: list[str], since: datetime | None = None) -> list:
    """Every event of these names (since `since`), oldest first, all pages."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter

    flt = EventFilter(event=EventNameFilter(name=names))
    if since is not None:
        flt.occurred = EventOccurredFilter(since=since)
    page = client.read_events(flt, limit=50)  # the server's maximum page (the client's default, 100, is refused)
    out = list(page.events)
    while page.next_page:
        page = client.read_events_page(page.next_page)
        out += page.events
    return sorted(out, key=lambda e: e.occurred)


@dataclass
class Interval:
    task_run: str
    flow_run: str
    start: datetime
    end: datetime
    slots: int
    held: bool


def gpu_intervals(client, since: datetime | None = None, expect: int = 0, timeout: float = 60) -> list[Interval]:
    """The GPU work of every stage, from the server's event log: `eagle3.gpus.start` / `.end` (tasks/_gpus.py)
    paired per task run. Waits up to `timeout` for `expect` intervals (the server persists events in batches)."""
    deadline = time.time() + timeout
    while True:
        evs = events(client, ["eagle3.gpus.start", "eagle3.gpus.end"], since)
        open_: dict[str, object] = {}
        out: list[Interval] = []
        for e in evs:
            tr = next((r.id for r in e.related if r.id.startswith("prefect.task-run.")), "?")
            fr = next((r.id for r in e.related if r.id.startswith("prefect.flow-run.")), "?")
            if e.event == "eagle3.gpus.start":
                open_[tr] = e
            elif tr in open_:
                s = open_.pop(tr)
                out.append(Interval(tr, fr, s.occurred, e.occurred, int(e.resource["slots"]),
                                    e.resource["limit-held"] == "true"))
        if len(out) >= expect or time.time() > deadline:
            return sorted(out, key=lambda i: i.start)
        time.sleep(1)


def overlaps(intervals: list[Interval]) -> list[tuple[Interval, Interval]]:
    """Pairs of GPU intervals that overlap in time (on one host: one clock)."""
    s = sorted(intervals, key=lambda i: i.start)
    return [(a, b) for k, a in enumerate(s) for b in s[k + 1:] if b.start < a.end]


# ---------------------------------------------------------------- what a run produced
def checksums(run_dir: str | Path) -> dict[str, object]:
    """Every stage's content as its manifest records it: shard sha256s, weights, the eval figures that do
    not depend on the machine's speed. Two runs with equal checksums produced the same outputs."""
    from eagle3.storage.manifests import EvalReport, HiddenStates, PreparedData, TrainedDraft, VerifierWeights

    d = Path(run_dir)
    prep = PreparedData.read(d / "prepare")
    hid = HiddenStates.read(d / "extract")
    tr = TrainedDraft.read(d / "train")
    ev = EvalReport.read(d / "eval")
    return {
        "prepare": sorted(s.sha256 for shards in prep.splits.values() for s in shards) + [prep.vocab_map.sha256],
        "extract": [s.sha256 for s in hid.shards],
        "verifier": VerifierWeights.read(d / "verifier").sha256,
        "train": [tr.weights_sha256, tr.best_step, tr.best_sim_tau],
        "eval": [ev.acceptance_length, ev.per_position_acceptance, ev.lossless, ev.num_drafts],
    }


# ---------------------------------------------------------------- tiny inputs
def chat(i: int) -> dict:
    """One ShareGPT conversation: question i and its answer."""
    return {"conversations": [{"from": "human", "value": f"question {i}: what is {i} plus {i}?"},
                              {"from": "gpt", "value": f"{i} plus {i} is {2 * i}. " * 3}]}


def tiny_inputs(root: Path) -> tuple[Path, Path]:
    """12 one-turn conversations (root/conversations/day1.jsonl) and one eval prompt (root/prompts.jsonl)."""
    import json

    data = root / "conversations"
    data.mkdir()
    (data / "day1.jsonl").write_text("\n".join(json.dumps(chat(i)) for i in range(12)))
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 plus 2?"}) + "\n")
    return data, prompts

