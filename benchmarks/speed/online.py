"""Online against offline training on one CPU host: SmolLM2, real ShareGPT, the demo's train settings.

Runs, in this order, in one invocation (so both see the same machine):
- offline: `eagle3 extract` (the whole store, bf16) then `eagle3 train` on it, each with all cores;
- online: `eagle3 produce` and `eagle3 train --online` side by side, one core each (the same two cores),
  with the spool capped at --spool-fraction of the offline store's measured size.

Prints
- peak_disk_ratio: the most the spool ever held (sampled every 5 ms, and the producer's own count)
  divided by the offline store's bytes on disk; the goal is <= 0.05;
- wall_ratio: the online pair's wall time / (offline extract + offline train) wall time;
- the heads' agreement: max |online - offline| over every weight (bf16 states; hf batches of
  several samples agree to float noise, so equality is not expected here), and each run's last loss.
Last line: one JSON object.

    .venv/bin/python -m benchmarks.speed.online [--limit 100] [--epochs 1] [--spool-fraction 0.05]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.assets import materialize_smollm2
from eagle3.config import PipelineConfig, PrepareConfig
from eagle3.prepare import prepare
from eagle3.storage.spool import spool_dir_bytes
from eagle3.verifier import extract_verifier

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "smollm2-sharegpt.yaml"


def eagle3(*args: str, threads: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "eagle3.cli", *args], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def done(p: subprocess.Popen, log: Path) -> None:
    if p.wait() != 0:
        raise SystemExit(f"{' '.join(p.args[2:5])} failed:\n{log.read_text()[-3000:]}")


def timed(*args: str, threads: int, log: Path) -> float:
    t = time.perf_counter()
    done(eagle3(*args, threads=threads, log=log), log)
    return time.perf_counter() - t


def last_loss(out: Path) -> float:
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["split"] == "train"][-1]["loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--limit", type=int, default=100, help="ShareGPT conversations (the demo reads 400)")
    ap.add_argument("--epochs", type=int, default=1, help="train epochs (the demo trains 3)")
    ap.add_argument("--spool-fraction", type=float, default=0.05, help="spool cap / offline store bytes")
    ap.add_argument("--work", default=None, help="work dir (default: a temp dir)")
    a = ap.parse_args()

    root = Path(a.work or tempfile.mkdtemp(prefix="eagle3-online-"))
    root.mkdir(parents=True, exist_ok=True)
    model = materialize_smollm2(REPO / "assets" / "smollm2")
    prepare(model, root / "prep", PrepareConfig(data="sharegpt", limit=a.limit, max_len=1024, draft_vocab=8192,
                                                val_fraction=0.03), progress=False)
    extract_verifier(model, root / "prep", root / "ver")
    cores = os.cpu_count() or 2
    # one train config file for all three readers: the offline trainer, the online one and the producer (its
    # read order must be the online trainer's)
    tc = PipelineConfig.from_file(DEMO).train.model_copy(update={"epochs": a.epochs})
    (root / "train.json").write_text(tc.model_dump_json())
    train = ["--config", str(root / "train.json")]

    t_ext = timed("extract", "--model", str(model), "--prepared", str(root / "prep"), "--out", str(root / "hid"),
                  threads=cores, log=root / "extract.log")
    t_tr = timed("train", "--hidden", str(root / "hid"), "--verifier", str(root / "ver"), "--out", str(root / "off"),
                 *train, "--threads", str(cores), threads=cores, log=root / "train.log")
    store = sum(f.stat().st_size for f in (root / "hid" / "shards").iterdir())
    spool_bytes = int(store * a.spool_fraction)

    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], spool_dir_bytes(root / "spool"))
            time.sleep(0.005)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    t = time.perf_counter()
    prod = eagle3("produce", "--model", str(model), "--prepared", str(root / "prep"), "--out", str(root / "spool"),
                  "--spool-bytes", str(spool_bytes), "--train-config", str(root / "train.json"),
                  threads=cores // 2 or 1, log=root / "produce.log")
    tr = eagle3("train", "--online", "--hidden", str(root / "spool"), "--verifier", str(root / "ver"), "--out",
                str(root / "on"), *train, "--threads", str(cores // 2 or 1), threads=cores // 2 or 1,
                log=root / "train-online.log")
    done(tr, root / "train-online.log")
    done(prod, root / "produce.log")
    t_on = time.perf_counter() - t
    stop.set()
    w.join()

    m = json.loads((root / "spool" / "manifest.json").read_text())
    wa, wb = load_file(root / "on" / "final" / "model.safetensors"), load_file(root / "off" / "final" /
                                                                              "model.safetensors")
    diff = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    most = max(peak[0], m["stats"]["peak_spool_bytes"])
    res = {
        "host": platform.processor() or platform.machine(), "cores": cores, "limit": a.limit, "epochs": a.epochs,
        "store_bytes": store, "spool_bytes": spool_bytes, "peak_spool_bytes": most,
        "peak_disk_ratio": round(most / store, 4),
        "offline_extract_s": round(t_ext, 1), "offline_train_s": round(t_tr, 1), "online_s": round(t_on, 1),
        "wall_ratio": round(t_on / (t_ext + t_tr), 3), "windows": m["num_windows"],
        "tokens_produced": m["stats"]["tokens_produced"], "max_abs_weight_diff": diff,
        "last_loss_offline": last_loss(root / "off"), "last_loss_online": last_loss(root / "on"),
        "torch_threads_offline": cores, "torch_threads_online_each": cores // 2 or 1, "torch": torch.__version__,
    }
    print(f"offline: extract {t_ext:.0f} s + train {t_tr:.0f} s; online pair {t_on:.0f} s -> wall ratio "
          f"{res['wall_ratio']:.3f}")
    print(f"disk: store {store / 2**20:.1f} MiB, spool cap {spool_bytes / 2**20:.1f} MiB, peak "
          f"{res['peak_spool_bytes'] / 2**20:.1f} MiB -> peak/store {res['peak_disk_ratio']:.4f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
