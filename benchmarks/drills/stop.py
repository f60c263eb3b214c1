"""A signal to `eagle3 run` (Prefect embedded) mid-stage: how long the whole tree takes to stop, what is
left, and whether the same command then finishes equal to a run that was never stopped.

    python -m benchmarks.drills.stop [--signal TERM|INT] [--stage train|extract] [--ranks 1|2]

The run is restart.py's: the tiny random Llama with SmolLM2's tokenizer on 24 real ShareGPT conversations,
every stage in the `eagle3 run` process (training under torchrun with `--ranks` ranks). A reference run
goes first; the same config into another dir is started and, once `--stage` is under way (its first
checkpoint or shard), its process gets one signal. Printed: the exit status, the seconds until every
process of its tree was gone, the processes still alive, the temp files left, the stop line it printed,
then the rerun's exit status and whether its manifests' checksums equal the reference's. One JSON line last.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tests.helpers.prefect_service as ps
from benchmarks.drills.restart import config, under_way

REPO = Path(__file__).resolve().parents[2]


def start(cfg: dict, path: Path, home: Path) -> subprocess.Popen:
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the embedded server
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--config", str(path)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def main() -> int:
    import psutil

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--signal", choices=["TERM", "INT"], default="TERM")
    ap.add_argument("--stage", choices=["train", "extract"], default="train")
    ap.add_argument("--ranks", type=int, default=1, help="training ranks under torchrun")
    a = ap.parse_args()
    from benchmarks.drills.faults import tiny_llama

    root = Path(tempfile.mkdtemp(prefix="eagle3-stop-"))
    model = tiny_llama(root / "tiny-llama")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "What is 2 plus 2?"}) + "\n")
    out: dict = {"bench": "stop", "signal": a.signal, "stage": a.stage, "ranks": a.ranks}
    t0 = time.time()
    ref = start(config(model, root / "ref", a.ranks), root / "ref.json", root / "home")
    _, err = ref.communicate()
    assert ref.returncode == 0, err[-3000:]
    out["reference_s"] = round(time.time() - t0, 1)

    cfg = config(model, root / "run", a.ranks)
    p = start(cfg, root / "run.json", root / "home")
    while not under_way(root / "run", a.stage):
        assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.05)
    tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
    t1 = time.time()
    p.send_signal(getattr(signal, f"SIG{a.signal}"))
    _, err = p.communicate(timeout=120)
    _, alive = psutil.wait_procs(tree, timeout=60)
    out.update(exit=p.returncode, tree=len(tree), tree_gone_s=round(time.time() - t1, 1),
               still_alive=[x.pid for x in alive],
               temp_files_left=[str(f) for f in (root / "run").rglob("*") if ".tmp" in f.name],
               stop_line=next((ln for ln in reversed(err.splitlines()) if "stopped by" in ln), ""))
    print(f"SIG{a.signal} with {a.stage} under way: exit {out['exit']}, {len(tree)} processes gone in "
          f"{out['tree_gone_s']} s, {len(alive)} still alive, {len(out['temp_files_left'])} temp files left\n"
          f"  {out['stop_line']}", flush=True)

    again = start(cfg, root / "run.json", root / "home")
    _, err = again.communicate()
    out["rerun_exit"] = again.returncode
    out["equal"] = again.returncode == 0 and ps.checksums(root / "run") == ps.checksums(root / "ref")
    print(f"the same command again: exit {again.returncode}, outputs equal the reference: {out['equal']}"
          + ("" if again.returncode == 0 else "\n" + err[-2000:]))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
