"""The `gpus` limit as the GPU stages hold it (tasks/_gpus.py): silent where no limit can exist
(embedded), a warning that says what to do on a real server without one, an error for what cannot
work, and real slots held while a stage runs."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

EMBEDDED = """
from prefect import flow, task
from tasks._gpus import hold_gpus

@task
def stage():
    with hold_gpus():
        return 7

@flow
def f():
    return stage()

print("result", f())
"""


def test_embedded_run_logs_no_warning_about_a_missing_limit(tmp_path):
    """`eagle3 run` (no PREFECT_API_URL: a temporary server) has no `gpus` limit and never will."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180")
    r = subprocess.run([sys.executable, "-c", EMBEDDED], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "result 7" in out, out[-3000:]
    assert "Concurrency limits" not in out and "gpus" not in out, out[-3000:]


def _run(prefect_env, env: dict[str, str] | None = None):
    """Run a one-task flow that holds the GPUs on the test server; (state, active slots seen inside, logs)."""
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from tasks._gpus import hold_gpus

    seen: list[int] = []

    @task
    def stage():
        with hold_gpus():
            with get_client(sync_client=True) as c:
                try:
                    seen.append(c.read_global_concurrency_limit_by_name("gpus").active_slots)
                except Exception:
                    seen.append(-1)

    @flow
    def f():
        stage()

    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        st = f(return_state=True)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    flt = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[st.state_details.flow_run_id]))
    deadline = time.time() + 20
    with get_client(sync_client=True) as c:
        while True:  # logs reach the server in batches; the flow's last line comes last
            logs = "\n".join(x.message for x in c.read_logs(flt))
            if "Finished in state" in logs.rsplit("\n", 1)[-1] or time.time() > deadline:
                return st, seen, logs
            time.sleep(0.5)


def test_server_without_the_limit_warns_with_the_fix(prefect_env):
    st, seen, logs = _run(prefect_env)
    assert st.is_completed() and seen == [-1]
    assert "no 'gpus' concurrency limit on the Prefect server at http" in logs
    assert "python deployments/setup.py --gpus N" in logs and "skipping acquisition" not in logs


def test_slots_are_held_while_the_stage_runs_and_too_many_is_an_error(prefect_env):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    with get_client(sync_client=True) as c:
        c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="gpus", limit=2))
    try:
        st, seen, logs = _run(prefect_env, {"CUDA_VISIBLE_DEVICES": "0,1"})
        assert st.is_completed() and seen == [2] and "concurrency limit" not in logs
        st, seen, _ = _run(prefect_env, {"CUDA_VISIBLE_DEVICES": "0,1,2"})  # 3 devices, a limit of 2
        assert st.is_failed() and seen == []
        with pytest.raises(Exception, match="Slots requested is greater than the limit"):
            st.result()
        with get_client(sync_client=True) as c:
            assert c.read_global_concurrency_limit_by_name("gpus").active_slots == 0
    finally:
        with get_client(sync_client=True) as c:
            c.delete_global_concurrency_limit_by_name("gpus")
