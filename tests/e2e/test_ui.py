"""The Prefect UI as a user meets it, in headless Chromium against a real `prefect server start`.

Set up as docs/service.md says (API URL exported before the server starts,
deployments/setup.py, `prefect deploy`, deployments/worker.py for each pool), then, in the UI
the root URL opens (V2):
  - the custom-run form: descriptions rendered whole (V1 and V2), keys as titles, limits in the
    text, "(Optional)" only where empty means the default, the demo preset as the starting point;
    an out-of-range value refused before Submit with a readable message; a tiny config submitted;
  - the finished run: every stage a task run of the pipeline run, the injected extraction
    failure as run count 2 with its retry delay, the subflows named after stage and run, every
    artifact (plots included) on the pipeline run, tau in the summary;
  - the nightly deployment: its schedule paused, its time zone shown.
Screenshots go to EAGLE3_SCREENSHOTS (docs/ui's are made so) or the test's tmp dir.

Chromium is Debian's `chromium` driven by Playwright through `executable_path` (no browser
download). `make test` installs it in CI (CI=true); elsewhere this test skips, saying why.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from eagle3.config import PipelineConfig
from tests.helpers.prefect_service import BIN, REPO, free_port, start, stop, tiny_inputs

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# The flags Chromium needs on a machine without network: no sandbox (root), no GPU, and no
# background connections (each would be refused, many at a time).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _need_browser():
    """Playwright + Debian's Chromium, or a skip that says how to get them (a failure in CI)."""
    why = None
    if not Path(CHROMIUM).is_file():
        why = f"Chromium not found ({CHROMIUM}): `make browser` installs Debian's chromium (root, apt-get)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            why = "Playwright for Python is missing: `make setup` installs it (the dev extra)"
    if why and os.environ.get("CI"):
        pytest.fail(f"CI must run the browser test: {why}")
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def ui(request, tmp_path_factory):
    """Server, pools, deployments and one worker per pool, exactly as docs/service.md starts them."""
    _need_browser()
    home = tmp_path_factory.mktemp("prefect-ui")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # docs/service.md's order: the API URL is set before `prefect server start`, so the UI it serves
    # talks to this port (left unset, the UI calls :4200 and shows "Can't connect to Server API").
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"{url}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_WORKER_QUERY_SECONDS": "1", "EAGLE3_REPO": str(REPO)}
    for k in ("EAGLE3_FAIL_ONCE", "EAGLE3_GPU_DEPLOYMENT", "PREFECT_UI_API_URL"):
        env.pop(k, None)
    procs = [start([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                    env, home / "server.log")]
    try:
        request.getfixturevalue("tiny_llama_dir")  # built while the server boots
        deadline = time.time() + 120
        while True:
            assert procs[0].poll() is None, (home / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "prefect server did not come up in 120 s"
            time.sleep(0.5)
        r = subprocess.run([sys.executable, "deployments/setup.py"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        r = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all", "--prefect-file",
                            "deployments/prefect.yaml"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        marker = home / "extract-failed-once"
        for pool, extra in (("cpu", {}), ("gpu", {"EAGLE3_FAIL_ONCE": f"extract:{marker}"})):
            procs.append(start([sys.executable, "deployments/worker.py", "--pool", pool, "--name", f"ui-{pool}"],
                                {**env, **extra}, home / f"worker-{pool}.log", cwd=REPO))
        yield {"url": url, "env": env, "home": home, "workers": procs[1:]}
    finally:
        for p in reversed(procs):
            stop(p)


@pytest.fixture(scope="module")
def page(ui, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # a fresh profile per launch (Playwright's own temp user-data-dir)
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 900})  # narrower hides the schedules column
        pg.set_default_timeout(30_000)
        yield pg
        browser.close()


@contextlib.contextmanager
def recorded(pg, tmp_path: Path):
    """On a failure, keep what the browser showed: a screenshot and the page's text, named in the error."""
    try:
        yield
    except BaseException as e:
        png, txt = tmp_path / "failure.png", tmp_path / "failure.txt"
        with contextlib.suppress(Exception):
            pg.screenshot(path=str(png), full_page=True)
            txt.write_text(f"{pg.url}\n\n{pg.inner_text('body')}")
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(f"browser at failure: {png}, {txt}")
        raise


def shot(pg, name: str, tmp_path: Path) -> None:
    """A screenshot for docs/ui (EAGLE3_SCREENSHOTS) or the test's record, as a small palette PNG."""
    out = Path(os.environ.get("EAGLE3_SCREENSHOTS") or tmp_path) / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(out))
    from PIL import Image

    Image.open(out).convert("RGB").quantize(colors=128).save(out, optimize=True)


def label(name: str, optional: bool = False):
    return re.compile(rf"^{re.escape(name)}{re.escape(' (Optional)') if optional else ''}$")


def prop(pg, name: str, nth: int = 0, optional: bool = False):
    """The block of form field `name` (its label, description, input)."""
    return pg.locator("label").filter(has_text=label(name, optional)).nth(nth).locator("xpath=ancestor::div[3]")


def fill(pg, name: str, value, nth: int = 0, optional: bool = False) -> None:
    box = pg.get_by_label(label(name, optional)).nth(nth)
    box.fill("" if value is None else str(value))


def form_state(pg, ui) -> str:
    """What can keep a Submit from going through: inputs the browser holds invalid, error text the form
    shows, and the server's last log lines (its schema check answers the form before any run is made)."""
    invalid = pg.evaluate("""() => Array.from(document.querySelectorAll('input:invalid, textarea:invalid'))
        .map(e => ((e.labels && e.labels[0] && e.labels[0].innerText) || e.name || e.id)
            + ': ' + e.validationMessage)""")
    errors = pg.locator("[role=alert], .text-destructive").all_inner_texts()
    log = (ui["home"] / "server.log").read_text(errors="replace").splitlines()[-40:]
    return f"invalid inputs: {invalid}; form errors: {errors}; server log tail:\n" + "\n".join(log)


def submit_run(pg, ui, deployment: str) -> None:
    """Submit the custom-run form and wait for the page to leave it, as a user would: a Submit that did
    nothing (no run made, the form still there) is clicked once more, with a warning that says what the
    form showed; a run made without the page moving on, or a second Submit gone nowhere, fails."""
    import warnings

    from playwright.sync_api import expect
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    left = re.compile(r"/deployments/deployment/[^/]+(\?|$)")
    seen = []
    for attempt in (1, 2):
        pg.get_by_role("button", name="Submit").click()
        try:
            # the server checks the parameters, then makes the run: slow on a loaded 2-core machine
            expect(pg).to_have_url(left, timeout=90_000)
            return
        except AssertionError:
            seen.append(form_state(pg, ui))
        with temporary_settings({PREFECT_API_URL: f"{ui['url']}/api"}), get_client(sync_client=True) as c:
            dep = c.read_deployment_by_name(deployment)
            made = [r for r in c.read_flow_runs(limit=20) if r.deployment_id == dep.id]
        assert not made, f"a run was made ({made[0].name}) but the page stayed on the form: {seen[-1]}"
        if attempt == 1:
            warnings.warn(f"Submit made no run in 90 s; clicking again. The form showed: {seen[-1]}", stacklevel=1)
    raise AssertionError("two Submits made no run:\n" + "\n---\n".join(seen))


def run_log(c, run_id, until: str | None = None, timeout: float = 30) -> str:
    """A flow run's whole log, oldest first; with `until`, wait for a line matching it (lines arrive in batches)."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    deadline = time.time() + timeout
    while True:
        lines, flt = [], LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
        while page := c.read_logs(flt, sort=LogSort.TIMESTAMP_ASC, limit=200, offset=len(lines)):
            lines += [x.message for x in page]
        log = "\n".join(lines)
        if until is None or re.search(until, log, re.M) or time.time() > deadline:
            return log
        time.sleep(1)


def test_custom_run_from_the_ui_retries_artifacts_and_paused_nightly(ui, page, tmp_path, tiny_llama_dir):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    pg, url = page, ui["url"]
    with recorded(pg, tmp_path):
        data, prompts = tiny_inputs(tmp_path)

        # The root URL opens V2, connected to this port's API.
        from playwright.sync_api import expect

        pg.goto(url + "/")
        expect(pg).to_have_url(re.compile(r"/v2/"))
        pg.get_by_role("link", name="Deployments").first.click()
        pg.get_by_role("link", name="eagle3-pipeline").first.click()
        # The GPU stages' deployments have distinct names, not three called "gpu".
        with temporary_settings({PREFECT_API_URL: f"{url}/api"}), get_client(sync_client=True) as c:
            names = {d.name for d in c.read_deployments()}
        assert {"extract-gpu", "train-gpu", "eval-gpu", "eagle3-pipeline", "eagle3-nightly"} <= names, names

        # The custom-run form.
        pg.get_by_role("button", name="Run").first.click()
        pg.get_by_role("menuitem", name="Custom run").click()
        pg.get_by_label(label("max_len")).wait_for()
        assert "Can't connect" not in pg.inner_text("body")
        form = pg.inner_text("main") if pg.locator("main").count() else pg.inner_text("body")
        # What Quick run starts too: the demo preset, in its own dir, within a 1-hour budget.
        assert pg.get_by_label(label("run_dir")).input_value() == "runs/ui-{date}"
        demo = PipelineConfig.from_file(REPO / "examples" / "smollm2-sharegpt.yaml")
        assert pg.get_by_label(label("limit", optional=True)).first.input_value() == str(demo.prepare.limit)
        assert pg.get_by_label(label("max_hours", optional=True)).input_value() == "1"
        # Descriptions whole: no raw markdown, limits stated, sections titled by their keys.
        assert "run_dir/prepare, run_dir/extract" in form and "`" not in form and "PrepareConfig" not in form
        assert "truncate each sample to this many tokens (16 to 1,048,576)" in prop(pg, "max_len").inner_text()
        assert "exactly 2 values, each at least 0, below 1" in prop(pg, "betas").inner_text()
        for section in ("prepare", "extract", "train", "eval"):
            assert pg.locator("label").filter(has_text=label(section)).count() == 1, section
        # "(Optional)" only where an empty field means the default; none on a field with a value.
        assert pg.locator("label").filter(has_text=label("max_len", optional=True)).count() == 0
        shot(pg, "ui-custom-run-form", tmp_path)

        # Out of range: refused before Submit, the browser saying why (the input carries the bounds).
        fill(pg, "max_len", 5)
        pg.get_by_role("button", name="Submit").click()
        msg = pg.get_by_label(label("max_len")).evaluate("e => e.validationMessage")
        assert "16" in msg and "greater" in msg.lower(), msg
        assert "/run" in pg.url  # still on the form

        # A tiny config, field by field (the second "limit"/"threads" are eval's).
        run_root = tmp_path / "runs"
        for name, value, nth, opt in [
            ("model", tiny_llama_dir, 0, False), ("run_dir", f"{run_root}/ui-{{date}}", 0, False),
            ("data", data, 0, False), ("max_len", 1024, 0, False), ("limit", None, 0, True),
            ("draft_vocab", 256, 0, True), ("val_fraction", 0.2, 0, False), ("shard_bytes", 1 << 16, 0, False),
            ("ttt_steps", 2, 0, False), ("epochs", 1, 0, False), ("max_steps", 2, 0, True),
            ("pack_tokens", 128, 0, False), ("threads", 1, 0, True), ("val_every", 1, 0, False),
            ("ckpt_every", 1, 0, False), ("prompts", prompts, 0, False), ("k", 2, 0, False),
            ("max_new_tokens", 6, 0, False), ("limit", None, 1, True),
        ]:
            fill(pg, name, value, nth, opt)
        aux = prop(pg, "aux_layer_ids", optional=True)  # a list: three items (the tiny model has 6 layers)
        for _ in range(3):
            aux.get_by_role("button", name="Add item").click()
        for i, v in enumerate((1, 3, 4)):
            aux.locator("input").nth(i).fill(str(v))
        submit_run(pg, ui, "eagle3-pipeline/eagle3-pipeline")

        # Wait for the run (through the API; the page polls the same).
        with temporary_settings({PREFECT_API_URL: f"{url}/api"}), get_client(sync_client=True) as c:
            dep = c.read_deployment_by_name("eagle3-pipeline/eagle3-pipeline")
            deadline = time.time() + 420
            while True:
                runs = c.read_flow_runs(limit=5)
                run = next((r for r in runs if r.deployment_id == dep.id), None)
                if run is not None and run.state.is_final():
                    break
                assert time.time() < deadline, f"pipeline run still {run.state.name if run else 'absent'}"
                time.sleep(2)
            log = run_log(c, run.id, until=r"^tau = " if run.state.is_completed() else None)
        assert run.state.is_completed(), log[-4000:]
        assert run.parameters["config"]["extract"]["aux_layer_ids"] == [1, 3, 4]
        (run_dir,) = run_root.iterdir()
        assert re.fullmatch(r"ui-\d{8}-\d{6}", run_dir.name)  # {date} expanded once, for the whole run
        # The pipeline's own log: one start and one end line per stage, the stages' lines, tau last.
        for stage in ("prepare", "extract", "verifier", "train", "eval"):
            # a stage run in this process logs its peak RSS; a stage hopped to the gpu pool ran elsewhere
            mem = (r", peak RSS \d+\.\d\d GiB( \(subprocesses \d+\.\d\d GiB\))?" if stage in ("prepare", "verifier")
                   else "")
            assert f"{stage}: started" in log and re.search(rf"^{stage}: done in \d+m\d\ds{mem}: ", log, re.M), stage
        assert "extract | " in log and "injected transient failure" in log
        assert re.search(r"^tau = \d\.\d{3} at k=2 on 1 prompts", log, re.M)

        # The run page: every stage a task run of this run; extract ran twice (the retry), 10 s apart.
        pg.goto(f"{url}/v2/runs/flow-run/{run.id}?tab=TaskRuns")
        pg.get_by_text("5 Task runs").wait_for()
        for stage in ("prepare", "extract", "verifier", "train", "eval"):
            expect(pg.locator(f"a[href*='/runs/task-run/'][title='{stage}']")).to_have_count(1)
        shot(pg, "ui-finished-run", tmp_path)
        pg.locator("a[href*='/runs/task-run/'][title='extract']").click()
        pg.get_by_text("Run Count").wait_for()
        details = pg.inner_text("body")
        assert re.search(r"Run Count\s+2\b", details) and re.search(r"Retry Delay\s+10s\b", details), details[-1500:]
        # The subflows carry the stage and the run's name; the failed first try stays visible.
        pg.goto(f"{url}/v2/runs/flow-run/{run.id}?tab=SubflowRuns")
        pg.get_by_text(f"extract · {run.name} (try 2)").wait_for()
        subs = pg.inner_text("body")
        for name in (f"extract · {run.name}", f"train · {run.name}", f"eval · {run.name}"):
            assert name in subs, name
        # Every artifact of the run on the pipeline run, the plots included; tau in the summary.
        pg.goto(f"{url}/v2/runs/flow-run/{run.id}?tab=Artifacts")
        pg.get_by_text("eagle3-run-summary", exact=True).wait_for()
        arts = pg.inner_text("body")
        for key in ("eagle3-preflight", "prepare-counts", "extract-stats", "train-metrics", "train-summary",
                    "eval-results", "eval-report", "eagle3-run-stages"):
            assert key in arts, key
        pg.get_by_text("eval-report", exact=True).click()
        pg.locator("img[src^='data:image/png;base64,']").first.wait_for()
        pg.go_back()
        pg.get_by_text("eagle3-run-summary", exact=True).click()
        pg.get_by_text(re.compile(r"tau = \d\.\d{3}")).first.wait_for()
        shot(pg, "ui-run-summary", tmp_path)

        # The nightly schedule: deployed paused, its time zone in the badge's tooltip.
        pg.goto(f"{url}/v2/deployments")
        badge = pg.get_by_text("At 02:00 AM").first
        badge.hover()
        tip = pg.get_by_role("tooltip").first
        tip.wait_for()
        assert tip.inner_text().strip() == "(Paused) At 02:00 AM (Europe/Berlin)"
        # A night started anyway fails at once, saying why in one line.
        with temporary_settings({PREFECT_API_URL: f"{url}/api"}), get_client(sync_client=True) as c:
            night = c.read_deployment_by_name("eagle3-nightly/eagle3-nightly")
            r = c.create_flow_run_from_deployment(night.id)
            deadline = time.time() + 120
            while not (r := c.read_flow_run(r.id)).state.is_final():
                assert time.time() < deadline, f"nightly run still {r.state.name}"
                time.sleep(1)
        assert r.state.is_failed() and "nightly: config.conversations is not set" in r.state.message
        # docs/service.md's step turns it on with its source, and off again.
        out = subprocess.run([sys.executable, "deployments/nightly.py", "--conversations", str(data)], cwd=REPO,
                             env=ui["env"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert re.search(r"active, cron '0 2 \* \* \*' in Europe/Berlin; next night starts \S+ 02:00 Europe/Berlin",
                         out.stdout), out.stdout
        with temporary_settings({PREFECT_API_URL: f"{url}/api"}), get_client(sync_client=True) as c:
            night = c.read_deployment_by_name("eagle3-nightly/eagle3-nightly")
            assert night.schedules[0].active and night.parameters["config"]["conversations"] == str(data)
            off = subprocess.run([sys.executable, "deployments/nightly.py", "--pause"], cwd=REPO, env=ui["env"],
                                 capture_output=True, text=True, timeout=120)
            assert off.returncode == 0 and "paused" in off.stdout, off.stdout + off.stderr
            assert not c.read_deployment_by_name("eagle3-nightly/eagle3-nightly").schedules[0].active

        # V1 renders descriptions as markdown: nothing swallowed as HTML, no asterisks turned italic.
        pg.goto(f"{url}/deployments/deployment/{dep.id}/run")
        pg.get_by_text("truncate each sample to this many tokens").first.wait_for()
        v1 = pg.inner_text("body")
        assert "run_dir/prepare, run_dir/extract" in v1 and "loss weight of step j is step_decay to the power j" in v1
        assert pg.locator("main em, main i").count() == 0

        # Workers stop within seconds of SIGTERM (deployments/worker.py).
        import signal

        for w in ui["workers"]:
            t0 = time.time()
            w.send_signal(signal.SIGTERM)
            w.wait(15)
            assert time.time() - t0 < 10
