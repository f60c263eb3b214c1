"""Draft-quality levers, each scored by replay tau on all of MT-Bench (80 questions, both turns).

Every lever is one training run against the same baseline (the demo preset's training settings) and
one replay evaluation of its exported head (`eagle3 eval --mode replay`, k=3 and, for the TTT
levers, k=5; 256 new tokens; the MT-Bench continuation cache is built once, content-keyed). Levers
that do not change the data reuse one extraction (`--extract`, `--verifier`, `--prepare`); the
draft-vocab levers re-run only `prepare` (a new vocab map) and `verifier`; the on-policy lever
trains on the extract dir given by `--regen-extract` (benchmarks/experiments/onpolicy.py builds it).

Runs go one at a time, each in its own process with `--threads` torch threads; every run's train and
eval output stays under `--root/<lever>/`, and a finished run is not redone (delete its dir to rerun).
Compute is reported as the CPU seconds of the training process (on a shared machine its wall time also
measures the neighbours) next to the wall time. Results: `--root/results.jsonl` (one line per run) and the
markdown table of every run in it on stdout. Last line: one JSON object.

    .venv/bin/python -m benchmarks.experiments.levers --prepare runs/base/prepare --extract runs/base/extract \\
        --verifier runs/base/verifier --root runs/levers --threads 1 [--only baseline,lk] [--list]
    .venv/bin/python -m benchmarks.experiments.levers --root runs/levers \\
        --score demo=runs/demo/train   # a head trained elsewhere
    .venv/bin/python -m benchmarks.experiments.levers --root runs/levers --table   # every run so far, as a table
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# The demo preset's training settings at one epoch: the baseline every lever changes one thing of.
BASE = {"ttt_steps": 3, "step_decay": 0.8, "epochs": 1, "pack_tokens": 2048, "lr": 1e-3, "warmup_steps": 10,
        "val_every": 50, "ckpt_every": 50, "loss": "kl", "norm_before_fc": False}

# examples/smollm2-sharegpt.yaml's training before it took Muon and bf16 (its prepare: 400 conversations, max_len
# 1024, vocab 8192, val 0.03): the baseline every demo-length lever changes one thing of
DEMO = {"epochs": 3, "lr": 3e-3, "val_every": 100, "ckpt_every": 100}

# examples/smollm2-sharegpt.yaml's training now: Muon under bf16 autocast (where the CPU has bf16 units)
MUON = {**DEMO, "precision": "bf16", "optimizer": "muon"}
# speculators 0.9.0's training defaults where eagle3 has the same switch (its run log prints them): lr 1e-3
# decaying to 0, no TTT step decay, norms before fc and before the residual, weight decay (speculators: 0.1 on
# Muon's matrices, 0.01 on the rest; eagle3 has one weight_decay for both)
PEERSET = {"lr": 1e-3, "min_lr_ratio": 0.0, "step_decay": 1.0, "norm_before_fc": True, "norm_before_residual": True,
           "weight_decay": 0.01}
# the 471 steps of the preset's 3 epochs over the original data, on data of another size: as many epochs of it
# as the steps take (the schedule ends at max_steps)
EQUAL_STEPS = {"epochs": 50, "max_steps": 471}

# The demo preset itself, trained here (fp32 on a CPU, as `make demo` runs), and the levers at its full length
# under bf16 autocast, each paired against "demo-bf16" (vs bf16) as well as against "demo".
DEMO_LEVERS: dict[str, tuple[dict, dict, list[int]]] = {
    "demo": (DEMO, {}, [3]),
    "demo-bf16": ({**DEMO, "precision": "bf16"}, {}, [3]),
    "demo-bf16-fcnorm": ({**DEMO, "precision": "bf16", "fc_norm": True}, {}, [3]),
    "demo-bf16-init": ({**DEMO, "precision": "bf16", "norm_init": "target", "zero_init_residual": True}, {}, [3]),
    "demo-bf16-head01": ({**DEMO, "precision": "bf16", "head_lr_scale": 0.1}, {}, [3]),
    "demo-bf16-zeroaux": ({**DEMO, "precision": "bf16", "zero_aux": True}, {}, [3]),
    "demo-bf16-muon": (MUON, {}, [3]),
    # the preset as it ships with Muon (fp32 on a CPU)
    "demo-muon": ({**DEMO, "optimizer": "muon"}, {}, [3]),
    # AdamW given Muon's wall time: a Muon step took 1.17x an AdamW step (851 s / 729 s for 468 steps, seed 1,
    # each run alone), so 550 steps on a schedule of their own (a fourth epoch, cut at max_steps)
    "demo-bf16-wall": ({**DEMO, "precision": "bf16", "epochs": 4, "max_steps": 550}, {}, [3]),
    # on-policy data at equal steps: the preset on the target's own answers to the same prompts (`--regen-*`) or on
    # both sets together (`--mixed-*`)
    "demo-bf16-muon-onpolicy": ({**MUON, **EQUAL_STEPS}, {"data": "onpolicy"}, [3]),
    "demo-bf16-muon-mixed": ({**MUON, **EQUAL_STEPS}, {"data": "mixed"}, [3]),
    # whether the peer row's lead is its settings or the rest of its trainer
    "demo-bf16-muon-peerset": ({**MUON, **PEERSET}, {}, [3]),
    # the two winners together
    "demo-bf16-muon-mixed-peerset": ({**MUON, **PEERSET, **EQUAL_STEPS}, {"data": "mixed"}, [3]),
    # which target layers feed fc (an extraction of their own; vLLM serves any 3 increasing ids below N): in the
    # peerset head fc's output comes almost all from the highest aux state, so move the set toward the output
    "demo-bf16-muon-peerset-aux29": ({**MUON, **PEERSET}, {"aux": [2, 15, 29]}, [3]),
    "demo-bf16-muon-peerset-auxhi": ({**MUON, **PEERSET}, {"aux": [15, 22, 29]}, [3]),
    # the loss aimed at the acceptance rate (LK hybrid), and speculators' weight decay on Muon's matrices (0.1;
    # eagle3 has one weight_decay for every group): the held-out loss trails the train loss by ~2 nats at the end
    "demo-bf16-muon-peerset-lk": ({**MUON, **PEERSET, "loss": "lk"}, {}, [3]),
    "demo-bf16-muon-peerset-wd01": ({**MUON, **PEERSET, "weight_decay": 0.1}, {}, [3]),
    # twice the peak lr: tau still grows with the step count at this length, so the head is under-trained at 471 steps
    # (examples/smollm2-sharegpt.yaml's training since; "demo-bf16-muon-peerset" stays the reference at 1e-3)
    "demo-bf16-muon-peerset-lr2e-3": ({**MUON, **PEERSET, "lr": 2e-3}, {}, [3]),
    "demo-bf16-muon-peerset-lr4e-3": ({**MUON, **PEERSET, "lr": 4e-3}, {}, [3]),
    # the preset's training on states extracted in bf16 (extract.dtype: fast on a CPU with bf16 units; a store of its
    # own, shared by the seeds), paired against the same training on the fp32 store ("vs_fp32x")
    "demo-bf16-muon-peerset-lr2e-3-x16": ({**MUON, **PEERSET, "lr": 2e-3}, {"extract_dtype": "bfloat16"}, [3]),
    # fresh conversations instead of repeated passes, at equal steps: the preset's 471 steps over 800 conversations
    # (~1.6 passes) against 3 passes over 400. At the third pass the train loss falls ~2.5 nats below the held-out
    # loss while the held-out replay tau stops rising: the head memorises what it has seen. Its store extends the
    # -x16 lever's (the samples it holds are copied: --reuse), so the extra cost is the new conversations' bf16
    # extraction; paired against the -x16 lever ("vs_data")
    "demo-bf16-muon-peerset-lr2e-3-x16-fresh800": ({**MUON, **PEERSET, "lr": 2e-3, **EQUAL_STEPS},
                                                    {"limit": 800, "extract_dtype": "bfloat16"}, [3]),
}

# name -> (train overrides, extra: {"vocab": N} | {"limit": N} | {"data": "onpolicy" | "mixed"} | {"aux": [a, b, c]}
# | {"extract_dtype": "bfloat16"} | {}, eval k list).
# "demo-*" levers change one thing of the demo preset (3 epochs, lr 3e-3) and are also paired against the
# demo's own head, scored as lever "demo" (`--score demo=runs/demo/train`).
LEVERS: dict[str, tuple[dict, dict, list[int]]] = {
    "baseline": ({}, {}, [3, 5]),
    "ttt5": ({"ttt_steps": 5}, {}, [3, 5]),
    "ttt7": ({"ttt_steps": 7}, {}, [3, 5]),
    "decay1": ({"step_decay": 1.0}, {}, [3, 5]),
    "ttt5-decay1": ({"ttt_steps": 5, "step_decay": 1.0}, {}, [3, 5]),
    "ttt7-decay1": ({"ttt_steps": 7, "step_decay": 1.0}, {}, [3, 5]),
    "lk": ({"loss": "lk"}, {}, [3]),
    "topk": ({"loss": "topk"}, {}, [3]),
    "norm_before_fc": ({"norm_before_fc": True}, {}, [3]),
    "lr3e-3": ({"lr": 3e-3}, {}, [3]),
    "lr3e-4": ({"lr": 3e-4}, {}, [3]),
    "lr1e-2": ({"lr": 1e-2}, {}, [3]),
    "pack1024": ({"pack_tokens": 1024}, {}, [3]),
    "pack4096": ({"pack_tokens": 4096}, {}, [3]),
    "epochs3": ({"epochs": 3}, {}, [3]),
    # the demo preset (3 epochs, lr 3e-3) on 1,024-token packs: the pack1024 win, checked at full demo length
    # (validation every 100 steps: the same count as the preset's 50 at 2,048-token packs)
    "demo-pack1024": ({"epochs": 3, "lr": 3e-3, "pack_tokens": 1024, "val_every": 100, "ckpt_every": 100}, {}, [3]),
    # norm_before_fc at full demo length (its one-epoch gap, +0.007, was within noise)
    "demo-nbf": ({"epochs": 3, "lr": 3e-3, "norm_before_fc": True}, {}, [3]),
    # fresh data instead of a third pass: 600 conversations (their own prepare and extraction) for 2 epochs,
    # about the demo's training tokens (2 x 1.5 = 3 passes) for 1.5x its extraction
    "demo-600x2": ({"epochs": 2, "lr": 3e-3}, {"limit": 600}, [3]),
    **DEMO_LEVERS,
    # the second training seed (init and shuffle) of each: the seed spread next to the prompts' CI
    **{f"{name}-s1": ({**over, "seed": 1}, extra, ks) for name, (over, extra, ks) in DEMO_LEVERS.items()},
    "vocab16k": ({}, {"vocab": 16384}, [3]),
    "vocab32k": ({}, {"vocab": 32000}, [3]),
    "onpolicy": ({}, {"data": "onpolicy"}, [3]),
}


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run(cmd: list[str], log: Path, threads: int) -> tuple[float, float]:
    """Run cmd (output to log); returns (wall seconds, CPU seconds of the process tree)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    c0, w0 = child_cpu(), time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    if rc:
        raise RuntimeError(f"exit {rc}: {' '.join(cmd)} (see {log})")
    return time.perf_counter() - w0, child_cpu() - c0


def paired_delta(base: Path, other: Path, draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """tau(other) - tau(base) with a 95% bootstrap CI over prompts, both heads resampled with the same prompts.

    Both evals replay the same cached answers, so a prompt that is easy for one head is easy for the other:
    the paired CI is much tighter than comparing the two unpaired CIs. tau = 1 + accepted / rounds, summed
    over the drawn prompts (each prompt's `rounds` in samples.jsonl: the accepted count of every round)."""
    import numpy as np

    def per_prompt(d: Path) -> dict[str, tuple[int, int]]:
        out = {}
        for line in (d / "samples.jsonl").read_text().splitlines():
            r = json.loads(line)
            rounds = [a for t in r["turns"] for a in t["rounds"]]
            out[r["id"]] = (sum(rounds), len(rounds))
        return out

    a, b = per_prompt(base), per_prompt(other)
    ids = sorted(a.keys() & b.keys())
    acc = np.array([[a[i][0], b[i][0]] for i in ids], dtype=np.float64)  # [prompts, 2]
    rnd = np.array([[a[i][1], b[i][1]] for i in ids], dtype=np.float64)
    tau = lambda ix: (acc[ix].sum(0) / rnd[ix].sum(0))  # noqa: E731 -- [2]: accepted per round, base and other
    point = float(np.diff(tau(np.arange(len(ids))))[0])
    rng = np.random.default_rng(seed)
    d = np.array([np.diff(tau(rng.integers(0, len(ids), len(ids))))[0] for _ in range(draws)])
    lo, hi = np.quantile(d, [0.025, 0.975])
    return point, float(lo), float(hi)


def score(a, root: Path, name: str, draft: Path, ks: list[int], row: dict) -> dict:
    """Replay-evaluate `draft` at each k into root/name/eval-k{k}, add tau, CI, per-position acceptance and
    the paired delta to the baseline to `row`, append it to root/results.jsonl. Finished evals are reused."""
    d = root / name
    for k in ks:
        out = d / f"eval-k{k}"
        if not (out / "report.json").is_file():
            args = ["eval", "--model", a.model, "--draft", str(draft), "--prompts", "mt-bench", "--k", str(k),
                    "--max-new-tokens", str(a.max_new_tokens), "--mode", "replay", "--threads", str(a.threads),
                    "--out", str(out)]
            if a.limit:
                args += ["--limit", str(a.limit)]
            run(eagle3(*args), d / "log.txt", a.threads)
        r = json.loads((out / "report.json").read_text())
        row[f"tau_k{k}"] = round(r["acceptance_length"], 4)
        row[f"ci_k{k}"] = [round(x, 4) for x in r["acceptance_length_ci"]]
        row[f"per_position_k{k}"] = [round(x, 4) for x in r["per_position_acceptance"]]
        row.update({key: [round(x, 4) for x in v] for key, v in paired_deltas(root, name, k).items()})
    with open(root / "results.jsonl", "a") as f:
        f.write(json.dumps({**row, "at": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    print(json.dumps(row), flush=True)
    return row


def paired_deltas(root: Path, name: str, k: int) -> dict[str, tuple[float, float, float]]:
    """The paired deltas of lever `name` at k, from the per-prompt rounds on disk: against the baseline
    ("delta_k{k}", every lever), the demo head ("vs_demo_k{k}", the "demo-*" levers) and the demo's bf16 head
    ("vs_bf16_k{k}", the "demo-bf16-*" levers), the Muon preset ("vs_muon_k{k}") and speculators' settings
    ("vs_peerset_k{k}", the levers on top of them), and a "-x16" run (bf16-extracted states) the same run on the fp32
    store ("vs_fp32x_k{k}"), each of the same training seed."""
    mine, out = root / name / f"eval-k{k}", {}
    refs = {f"delta_k{k}": "baseline"} if name != "baseline" else {}
    # a second-seed run pairs with the same seed's references; a run's last step ("NAME-last") with NAME's head
    seed = "-s1" if name.removesuffix("-last").endswith("-s1") else ""
    if name.endswith("-last"):
        refs[f"vs_selected_k{k}"] = name.removesuffix("-last")
    if name.startswith("demo-"):
        refs[f"vs_demo_k{k}"] = "demo" + seed
    if name.startswith("demo-bf16-"):
        refs[f"vs_bf16_k{k}"] = "demo-bf16" + seed
    if name.startswith("demo-bf16-muon-") or name == "peer":
        refs[f"vs_muon_k{k}"] = "demo-bf16-muon" + seed
    stem = name.removesuffix("-last").removesuffix("-s1")  # the lever itself, whichever seed and step
    if stem.startswith("demo-bf16-muon-peerset-"):
        refs[f"vs_peerset_k{k}"] = "demo-bf16-muon-peerset" + seed
    if stem.endswith("-x16"):
        refs[f"vs_fp32x_k{k}"] = name.replace("-x16", "")
    if "-x16-" in stem:  # a data lever on the bf16 store: against the same training on the demo's data
        refs[f"vs_data_k{k}"] = stem.split("-x16-")[0] + "-x16" + seed
    refs = {key: ref for key, ref in refs.items() if ref != name}
    for key, ref in refs.items():
        theirs = root / ref / f"eval-k{k}"
        if (mine / "samples.jsonl").is_file() and (theirs / "samples.jsonl").is_file():
            out[key] = paired_delta(theirs, mine)
    return out


# the paired deltas of paired_deltas at k=3, in the order the table prints them
VS_LABELS = (("delta_k3", ""), ("vs_demo_k3", "vs demo "), ("vs_bf16_k3", "vs demo-bf16 "),
             ("vs_muon_k3", "vs demo-bf16-muon "), ("vs_peerset_k3", "vs peerset "),
             ("vs_selected_k3", "vs its selected step "), ("vs_fp32x_k3", "vs the fp32 store "),
             ("vs_data_k3", "vs the demo's data "))


def table(root: Path) -> None:
    """The levers table: every lever's newest row in root/results.jsonl, baseline first."""
    rows: dict[str, dict] = {}
    for ln in (root / "results.jsonl").read_text().splitlines():
        r = json.loads(ln)
        rows[r["lever"]] = r
    ci = lambda t, c: f"{t:.3f} [{c[0]:.3f}, {c[1]:.3f}]"  # noqa: E731
    dl = lambda x: "{:+.3f} [{:+.3f}, {:+.3f}]".format(*x)  # noqa: E731
    print("| lever | setting | steps | train CPU s (wall s) | replay tau k=3 [95% CI] "
          "| vs baseline, k=3 [paired 95% CI] | tau k=5 [95% CI] (vs baseline) | per position (k=3) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in sorted(rows, key=lambda n: (n != "baseline", rows[n].get("at", ""))):
        r = rows[name]
        for k in (3, 5):
            r.update(paired_deltas(root, name, k))
        setting = {**r["train"], **LEVERS.get(name, ({}, {}, []))[1]}
        cpu = f"{r['train_cpu_s']:.0f} ({r['train_wall_s']:.0f})" if r.get("train_cpu_s") else ""
        k5 = (ci(r["tau_k5"], r["ci_k5"]) + (f" ({dl(r['delta_k5'])})" if "delta_k5" in r else "")
              if "tau_k5" in r else "")
        pp = " / ".join(f"{x:.3f}" for x in r["per_position_k3"])
        vs = "; ".join(f"{label}{dl(r[key])}" for key, label in VS_LABELS if key in r)
        print(f"| {name} | {json.dumps(setting)} | {r['steps'] or ''} | {cpu} | {ci(r['tau_k3'], r['ci_k3'])} "
              f"| {vs} | {k5} | {pp} |")


def export_last(train: Path, man: dict, out: Path, model: str) -> Path:
    """Export the last step checkpoint of the training run in `train` (its manifest `man`) to `out`, as the trainer
    exports final/, for scoring the run's last step next to the checkpoint its validations chose."""
    from eagle3.model.draft import DraftConfig
    from eagle3.model.formats import export
    from eagle3.train import checkpoint as ckpt
    from eagle3.train.loop import last_step_dir

    if not (out / "model.safetensors").is_file():
        weights, _, meta = ckpt.load(last_step_dir(train))
        if meta["step"] != man["steps"]:
            raise RuntimeError(f"{train}: the newest checkpoint is step {meta['step']}, the run ended at "
                               f"{man['steps']}")
        export(weights, DraftConfig(**man["draft_config"]), man["config"]["ttt_steps"], out, man["export_format"],
               verifier=model, extra={"exported_step": meta["step"]})
    return out


def eagle3(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle3.cli", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--model", default=str(REPO / "assets" / "smollm2"))
    ap.add_argument("--prepare", help="(levers) the baseline's prepare dir")
    ap.add_argument("--extract", help="(levers) the baseline's extract dir")
    ap.add_argument("--verifier", help="(levers) the baseline's verifier dir")
    ap.add_argument("--regen-extract", default=None, help="extract dir of regenerated data (on-policy lever)")
    ap.add_argument("--regen-verifier", default=None)
    ap.add_argument("--regen-prepare", default=None)
    ap.add_argument("--mixed-extract", default=None, help="extract dir of original + regenerated data (onpolicy.py "
                    "--mixed: its --root/mixed/extract)")
    ap.add_argument("--mixed-verifier", default=None)
    ap.add_argument("--mixed-prepare", default=None)
    ap.add_argument("--root", default="runs/levers")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data-threads", type=int, default=None,
                    help="threads of a lever's own prepare/extract/verifier (default --threads): the data of a lever "
                    "is built once, before its seeds train side by side")
    ap.add_argument("--only", default=None, help="comma-separated lever names (default: all, in order)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="MT-Bench questions (default all 80)")
    ap.add_argument("--base", default=None, help="JSON of baseline training overrides (e.g. a shorter run)")
    ap.add_argument("--override", default=None,
                    help="JSON of training settings applied over every lever's own, e.g. '{\"precision\": \"fp32\"}' "
                    "on a CPU without bf16 units (which emulates bf16 many times slower); runs are keyed by lever "
                    "name, so give these runs a --root of their own")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--table", action="store_true",
                    help="print the table of every run in --root/results.jsonl and exit")
    ap.add_argument("--score", default=None, metavar="NAME=DIR",
                    help="score a head trained elsewhere (e.g. the demo's runs/demo/train) as lever NAME, and exit")
    ap.add_argument("--score-last", default=None, metavar="NAME",
                    help="score the last step of lever NAME's run as NAME-last, paired against the head its trainer "
                    "exported (the checkpoint its validations chose), and exit")
    a = ap.parse_args()
    if a.table:
        return table(Path(a.root))
    if a.score_last:
        root, name = Path(a.root), a.score_last + "-last"
        train = root / a.score_last / "train"
        man = json.loads((train / "manifest.json").read_text())
        draft = export_last(train, man, root / name / "final", a.model)
        row = {"lever": name, "train": LEVERS[a.score_last][0] if a.score_last in LEVERS else {},
               "steps": man["steps"], "exported_step": man["steps"], "selected_step": man["best_step"],
               "draft": str(draft)}
        score(a, root, name, draft, [3], row)
        return
    if a.score:
        name, train = a.score.split("=", 1)
        (Path(a.root) / name).mkdir(parents=True, exist_ok=True)
        if not (Path(train) / "manifest.json").is_file():  # a head another tool wrote (the peer's checkpoint)
            row = {"lever": name, "train": {}, "steps": None, "draft": train}
            score(a, Path(a.root), name, Path(train), [3], row)
            return
        man = json.loads((Path(train) / "manifest.json").read_text())
        row = {"lever": name,
               "train": {k: man["config"][k] for k in ("epochs", "lr", "ttt_steps", "loss")
                         if k in man.get("config", {})},
               "steps": man["steps"], "best_step": man["best_step"], "best_metric": man.get("best_metric"),
               "val_replay_tau": man.get("best_replay_tau"), "draft": str(Path(train) / "final")}
        score(a, Path(a.root), name, Path(train) / "final", [3], row)
        return
    if not (a.prepare and a.extract and a.verifier) and not a.list:
        ap.error("the levers need --prepare, --extract and --verifier (the baseline's stage dirs)")
    base = {**BASE, **(json.loads(a.base) if a.base else {})}
    override = json.loads(a.override) if a.override else {}
    names = a.only.split(",") if a.only else list(LEVERS)
    if a.list:
        for n in names:
            print(n, json.dumps({**base, **LEVERS[n][0], **override}), LEVERS[n][1])
        return
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        over, extra, ks = LEVERS[name]
        d = root / name
        d.mkdir(exist_ok=True)
        log = d / "log.txt"
        prepare, extract, verifier = Path(a.prepare), Path(a.extract), Path(a.verifier)
        aux = ["--aux-layers", ",".join(map(str, extra["aux"]))] if "aux" in extra else []
        dtype = ["--dtype", extra["extract_dtype"]] if "extract_dtype" in extra else []
        data_threads = a.data_threads or a.threads
        if "vocab" in extra or "limit" in extra:
            # its own prepare: a new vocab map over the same samples (the hidden states do not change), or more
            # (or fewer) conversations, which need their own extraction too (one data dir per size and dtype, shared
            # by the seeds)
            src = json.loads((Path(a.prepare) / "manifest.json").read_text())["config"]
            data = (root / f"data-{extra['limit']}-{extra.get('extract_dtype', 'auto')}" if "limit" in extra else d)
            prepare, verifier = data / "prepare", data / "verifier"
            extract = data / "extract" if "limit" in extra else extract
            if not (verifier / "manifest.json").is_file():
                w0 = time.perf_counter()
                run(eagle3("prepare", "--model", a.model, "--data", src["data"],
                           "--limit", str(extra.get("limit", src["limit"])), "--max-len", str(src["max_len"]),
                           "--val-fraction", str(src["val_fraction"]), "--seed", str(src["seed"]),
                           "--draft-vocab", str(extra.get("vocab", src["draft_vocab"])), "--out", str(prepare)),
                    log, data_threads)
                if "limit" in extra:  # the samples already in a store of the same settings are copied, not recomputed
                    reuse = [x for s in (Path(a.extract), root / f"extract-{extra.get('extract_dtype')}")
                             if (s / "manifest.json").is_file() for x in ("--reuse", str(s))]
                    run(eagle3("extract", "--model", a.model, "--prepared", str(prepare), "--out", str(extract),
                               *dtype, *reuse), log, data_threads)
                run(eagle3("verifier", "--model", a.model, "--prepared", str(prepare), "--out", str(verifier)),
                    log, data_threads)
                if "limit" in extra:  # the data's wall time counts for this lever (an extraction of its own)
                    w = round(time.perf_counter() - w0, 1)
                    (data / "data_timing.json").write_text(json.dumps({"data_wall_s": w}))
        # the same samples, other states: an extraction per set of ids or dtype (shared by the seeds)
        if (aux or dtype) and "limit" not in extra:
            extract = root / (f"extract-aux-{'-'.join(map(str, extra['aux']))}" if aux else
                              f"extract-{extra['extract_dtype']}")
            if not (extract / "manifest.json").is_file():
                w0 = time.perf_counter()
                run(eagle3("extract", "--model", a.model, "--prepared", str(prepare), "--out", str(extract), *aux,
                           *dtype), log, a.threads)
                (d / "data_timing.json").write_text(json.dumps({"data_wall_s": round(time.perf_counter() - w0, 1)}))
        if extra.get("data") in ("onpolicy", "mixed"):
            src = "regen" if extra["data"] == "onpolicy" else "mixed"
            dirs = [getattr(a, f"{src}_{stage}") for stage in ("prepare", "extract", "verifier")]
            if not all(dirs):
                print(f"{name}: skipped (needs --{src}-prepare, --{src}-extract and --{src}-verifier)", flush=True)
                continue
            prepare, extract, verifier = map(Path, dirs)
        cfg = {**base, **over, **override, "threads": a.threads}
        (d / "train_config.json").write_text(json.dumps(cfg, indent=1))
        timing = d / "timing.json"
        if not timing.is_file():
            replay = subprocess.check_output(
                eagle3("replay-set", "--model", a.model, "--prompts", str(prepare), "--limit", "32",
                       "--max-new-tokens", "128", "--threads", str(a.threads), *aux), cwd=REPO, text=True,
                stderr=subprocess.DEVNULL).strip().splitlines()[-1]
            wall, cpu = run([sys.executable, "-m", "eagle3.train", "--hidden", str(extract), "--verifier",
                             str(verifier), "--out", str(d / "train"), "--config", str(d / "train_config.json"),
                             "--replay", replay], log, a.threads)
            timing.write_text(json.dumps({"train_wall_s": round(wall, 1), "train_cpu_s": round(cpu, 1)}))
        t = json.loads(timing.read_text())
        for f in (d / "data_timing.json", extract.parent / "data_timing.json"):
            if f.is_file():  # a lever with its own extraction: its wall time counts too
                t.update(json.loads(f.read_text()))
        man = json.loads((d / "train" / "manifest.json").read_text())
        row = {"lever": name, "train": {k: v for k, v in cfg.items() if k in over or k in override or k == "epochs"},
               "steps": man["steps"], "best_step": man["best_step"], "best_metric": man.get("best_metric"),
               "val_sim_tau": round(man["best_sim_tau"], 4), "val_replay_tau": man.get("best_replay_tau"), **t}
        rows.append(score(a, root, name, d / "train" / "final", ks, row))
    print()
    table(root)  # every run so far, this invocation's included
    print(json.dumps({"root": str(root), "runs": rows}))


if __name__ == "__main__":
    main()
