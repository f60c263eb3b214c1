"""Fault-injection matrix: SIGKILL at >= 20 points per stage (inside the tensor writes too), at the commits
of prepare, verifier, regenerate and eval, a rank of 2 killed under DDP (rank 1 mid-step, rank 0 mid-save),
external kills that land inside the work, a full disk during extraction, a checkpoint save and every
other stage that writes, the extract disk preflight, a Prefect task killed mid-run, and the whole
bad-input corpus; every recovery compared with the uninterrupted run.

    python -m benchmarks.drills.faults [--per-stage 20] [--random 4]

Target: the tiny random Llama (6 layers, H=64) with SmolLM2's tokenizer, on 30 ShareGPT
conversations. Every stage runs as a real `eagle3` process on a frozen copy of the code. Prints,
per stage, kill points tried / runs recovered / outputs equal to the uninterrupted run, then the
bad-input kinds tried / handled cleanly, and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import tests.helpers.fault_drills as fd
from tests.helpers.bad_inputs import CASES, build_base, run_case

REPO = Path(__file__).resolve().parents[2]


def tiny_llama(out: Path) -> Path:
    """The test suite's tiny random Llama (tests/conftest.py), with SmolLM2's tokenizer and template."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagle3.assets import materialize_smollm2

    tok = AutoTokenizer.from_pretrained(materialize_smollm2(REPO / "assets" / "smollm2"))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def kill_points(per: int) -> dict[str, list[str]]:
    """`per` points for each stage, spread over the run. The reference run has 30+ forward batches and
    shard commits, 24 optimizer steps, 12 step checkpoints (steps 2, 4, ..., 24) and one `best` (the
    tiny random target's val tau peaks at its first validation), so 13 meta.json writes. Inside the
    tensor write: a bf16 shard is 5 pieces (header, ids, aux, final, mask), a checkpoint's
    model.safetensors is its header plus one piece per tensor, its state.pt tens of torch records."""
    ckpt = ([f"dir.written@checkpoints/step-:{n}" for n in (1, 3, 5, 7, 9, 12)]      # files written, dir not renamed
            + [f"file.written@meta.json:{n}" for n in (1, 2, 4, 6, 8, 10, 13)]        # between the files of one save
            + [f"file.renamed@meta.json:{n}" for n in (1, 3, 5, 7, 9)]                # meta in place, dir not renamed
            + ["dir.written@checkpoints/best:1", "dir.renamed@checkpoints/best:1"])
    return {
        "extract": [f"extract.batch:{n}" for n in range(1, per + 1)],
        "shard commit": [f"file.{w}@shards/:{n}" for n in range(1, per) for w in ("written", "renamed")][:per],
        "training": [f"train.step:{n}" for n in range(1, per + 1)],
        "checkpoint save": (ckpt * (1 + per // len(ckpt)))[:per],
        "tensor write": ([f"file.writing@shards/:{n}" for n in (2, 3, 4, 7, 13, 24, 38)]
                         + [f"file.writing@model.safetensors:{n}" for n in (1, 3, 8, 17, 30, 41)]
                         + [f"file.writing@state.pt:{n}" for n in (1, 2, 5, 11, 23, 40, 77)])[:per],
    }


# (kill point, rank) under DDP with 2 ranks: rank 1 between optimizer steps and inside a checkpoint's files (which
# rank 0 writes: rank 1 dies at its next collective); rank 0 inside the optimizer state's write and between files.
RANK_POINTS = [("train.step:5", 1), ("train.step:13", 1), ("file.writing@state.pt:3", 0),
               ("file.written@meta.json:2", 0), ("dir.written@checkpoints/step-:3", 0)]


def prefect_drills(x: fd.Inputs, work: Path) -> list[dict]:
    """A crash inside a Prefect task, then its retry: extract fails once midway (in process), train's
    torchrun is SIGKILLed at step 5. Each retry must resume and end equal to the uninterrupted run."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["PREFECT_HOME"] = str(work / "prefect")
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(work / "prefect" / "storage")
    from prefect import flow
    from prefect.testing.utilities import prefect_test_harness

    from eagle3.config import ExtractConfig, TrainConfig
    from tasks.extract import extract_task
    from tasks.train import train_task

    ecfg = ExtractConfig(aux_layer_ids=fd.AUX, shard_bytes=1 << 16, batch_tokens=128)
    tcfg = TrainConfig(max_steps=24, epochs=20, ttt_steps=2, pack_tokens=128, log_every=1, val_every=3, ckpt_every=2,
                       warmup_steps=1, threads=1, lr=1e-3)
    extract_task.retry_delay_seconds = [0, 0]
    train_task.retry_delay_seconds = [0, 0]

    @flow
    def f(out_e: str, out_t: str):
        e = extract_task(str(x.model), str(x.prep), out_e, ecfg, return_state=True)
        t = train_task(str(x.hid), str(x.ver), out_t, tcfg, return_state=True)
        return e, t

    os.environ["EAGLE3_FAIL_ONCE"] = f"extract:{work / 'extract-failed'}"
    os.environ["EAGLE3_KILL_AT"], os.environ["EAGLE3_KILL_MARKER"] = "train.step:5", str(work / "train-killed")
    cwd = os.getcwd()
    os.chdir(fd.CODE[0])  # torchrun runs the frozen code
    try:
        with prefect_test_harness(server_startup_timeout=180):
            e, t = f(str(work / "pe"), str(work / "pt"))
    finally:
        os.chdir(cwd)
        for k in ("EAGLE3_FAIL_ONCE", "EAGLE3_KILL_AT", "EAGLE3_KILL_MARKER"):
            os.environ.pop(k, None)
    from eagle3.storage.manifests import HiddenStates

    m = HiddenStates.read(work / "pe") if e.is_completed() else None
    return [
        {"task": "extract (fails once midway)", "crashed": (work / "extract-failed").is_file(),
         "recovered": e.is_completed(), "resumed_shards": m.stats["shards_skipped"] if m else 0,
         "equal": bool(m) and fd.shard_digests(work / "pe") == fd.shard_digests(x.hid)},
        {"task": "train (torchrun SIGKILLed at step 5)", "crashed": (work / "train-killed").is_file(),
         "recovered": t.is_completed(),
         "equal": t.is_completed() and fd.losses(work / "pt") == fd.losses(x.train)
         and fd.weights(work / "pt") == fd.weights(x.train)},
    ]


def tally(row: dict, d, stage: str, point: str) -> None:
    """Count one drill's outcome into its stage's row and print it."""
    row["tried"] += 1
    row["killed"] += d.killed
    row["recovered"] += d.recovered
    row["equal"] += d.equal
    print(f"  {stage:<16} {point:<36} killed={d.killed} recovered={d.recovered} equal={d.equal} {d.detail[:120]}",
          flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-stage", type=int, default=20, help="kill points per stage (default 20)")
    ap.add_argument("--random", type=int, default=3, help="extra external SIGKILLs at random times, extract and train")
    a = ap.parse_args()
    import random

    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="eagle3-faults-"))
    os.environ["EAGLE3_CACHE_DIR"] = str(root / "sha256-stamps")  # every process of the drill; none left behind
    fd.snapshot_code(root / "code")
    model = tiny_llama(root / "tiny-llama")
    x = fd.build_inputs(root / "inputs", model)
    print(f"inputs ready in {time.perf_counter() - t0:.0f} s under {root}", flush=True)

    rows: dict[str, dict] = {}
    failures: list[dict] = []
    n = 0
    for stage, specs in kill_points(a.per_stage).items():
        r = rows.setdefault(stage, {"tried": 0, "killed": 0, "recovered": 0, "equal": 0})
        for spec in specs:
            n += 1
            d = fd.kill_drill(stage, spec, x, root / "drills" / str(n))
            tally(r, d, stage, spec)
            if not d.equal:
                failures.append({"stage": stage, "point": spec, "detail": d.detail[:300]})
    # The other writing stages: a kill at each of their commits, compared by manifest fingerprint.
    refs = {}
    for stage, specs in fd.STAGE_POINTS.items():
        refs[stage] = fd.stage_reference(stage, x, root / "refs")
        r = rows.setdefault(stage, {"tried": 0, "killed": 0, "recovered": 0, "equal": 0})
        for spec in specs:
            n += 1
            d = fd.stage_kill_drill(stage, spec, x, root / "drills" / str(n) / "out", refs[stage])
            tally(r, d, stage, spec)
            if not d.equal:
                failures.append({"stage": stage, "point": spec, "detail": d.detail[:300]})
    # One rank of 2 under DDP: torchrun stops the other, the rerun resumes.
    ranks_ref = root / "refs" / "train-2-ranks"
    assert fd.cli(fd.ranks_cmd(x, ranks_ref)).returncode == 0
    for spec, rank in RANK_POINTS:
        stage = f"train, 2 ranks (rank {rank})"
        r = rows.setdefault(stage, {"tried": 0, "killed": 0, "recovered": 0, "equal": 0})
        n += 1
        d = fd.rank_kill_drill(spec, rank, x, root / "drills" / str(n) / "out", ranks_ref)
        tally(r, d, stage, spec)
        if not d.equal:
            failures.append({"stage": stage, "point": spec, "detail": d.detail[:300]})
    rng = random.Random(0)
    # From outside, at a random moment inside the work (after a random number of shards / steps, plus
    # up to 0.3 s); "killed" counts only kills that landed there.
    for stage in ("extract", "training"):
        r = rows.setdefault(f"{stage} (external, random time)", {"tried": 0, "killed": 0, "recovered": 0, "equal": 0})
        for _ in range(a.random):
            n += 1
            d = fd.random_kill_drill("extract" if stage == "extract" else "train", x, root / "drills" / str(n), rng)
            tally(r, d, stage, d.point)

    enospc, enospc_stages = None, []
    if fd.tmpfs_available():
        e = fd.enospc_extract(x, root / "enospc")
        enospc = {"first_exit": e.first_rc, "message": e.message, "leftovers": len(e.leftovers),
                  "committed_before": e.committed, "rerun_exit": e.second_rc,
                  "equal": e.second_rc == 0 and fd.shard_digests(e.out) == fd.shard_digests(x.hid)}
        print(f"ENOSPC (tmpfs at 40% of the shards): exit {e.first_rc}, {e.committed} shards committed, "
              f"{len(e.leftovers)} temp files left; rerun after growing it: exit {e.second_rc}, "
              f"equal={enospc['equal']}")
        print(f"  message: {e.message}")
        t = fd.enospc_train(x, root / "enospc-train")
        enospc_train = {"first_exit": t.first_rc, "message": t.message, "leftovers": len(t.leftovers),
                        "checkpoints_left": t.checkpoints, "intact": t.intact, "rerun_exit": t.second_rc,
                        "resumed_from": t.resumed_from.strip(),
                        "equal": t.second_rc == 0 and fd.losses(t.out) == fd.losses(x.train)
                        and fd.weights(t.out) == fd.weights(x.train)}
        print(f"ENOSPC in a checkpoint save (tmpfs with room for 3.5 checkpoints): exit {t.first_rc}, "
              f"{len(t.leftovers)} temp files left, checkpoints {t.checkpoints} intact={t.intact}; rerun after "
              f"growing it: exit {t.second_rc}, {t.resumed_from.strip()}, equal={enospc_train['equal']}")
        print(f"  message: {t.message}")
        for stage in fd.STAGE_POINTS:
            e = fd.enospc_stage(stage, x, root / f"enospc-{stage}", (root / "refs" / f"{stage}-ref",
                                                                     root / "refs" / f"{stage}-ref-cache"), refs[stage])
            enospc_stages.append(e)
            print(f"ENOSPC in {stage} (room for half its output): exit {e['first_exit']}, one line={e['one_line']}, "
                  f"{len(e['leftovers'])} temp files left; rerun after freeing it: exit {e['rerun_exit']}, "
                  f"equal={e['equal']}\n  message: {e['message']}")
        pre = fd.extract_disk_preflight(x, root / "preflight")
        print(f"extract disk preflight (tmpfs with room for 40% of the shards): exit {pre['exit']}, "
              f"files written {pre['files_written']}\n  message: {pre['message']}")
    else:
        print("ENOSPC: no private mount namespace here for a small tmpfs; skipped")
        enospc_train = pre = None

    prefect = prefect_drills(x, root / "prefect-drills")
    for p in prefect:
        print(f"Prefect: {p}")

    base = build_base(root / "bad-base", model)
    bad = [run_case(c, root / "bad" / c.kind, base, subprocess_mode=True) for c in CASES]
    clean = sum(o.clean for o in bad)
    for o in bad:
        print(f"  {'clean' if o.clean else 'NOT CLEAN'}  {o.kind:<36} {o.detail[:150]}")

    print(f"\n{'stage':<34} {'kill points tried':>17} {'killed':>7} {'recovered':>10} {'equal':>6}")
    for stage, r in rows.items():
        print(f"{stage:<34} {r['tried']:>17} {r['killed']:>7} {r['recovered']:>10} {r['equal']:>6}")
    print(f"bad-input kinds tried: {len(bad)}, handled cleanly: {clean}")
    print(f"wall time: {time.perf_counter() - t0:.0f} s")
    print(json.dumps({"bench": "faults", "kill_points": rows, "enospc": enospc, "enospc_checkpoint": enospc_train,
                      "enospc_stages": enospc_stages,
                      "extract_disk_preflight": pre, "prefect": prefect,
                      "bad_inputs": {"kinds": len(bad), "clean": clean,
                                     "not_clean": [o.kind for o in bad if not o.clean]},
                      "failures": failures, "seconds": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
