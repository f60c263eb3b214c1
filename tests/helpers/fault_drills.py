"""Fault drills shared by tests/integration/test_faults.py (a subset) and benchmarks/drills/faults.py (the full matrix).

A drill runs a real `eagle3` stage process with EAGLE3_KILL_AT set, checks that it died of
SIGKILL at that point, reruns the same command, and compares the result with an uninterrupted
run: shard sha256s for extraction; the loss trajectory and the exported weights for training.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3.storage.hashing import sha256_file

REPO = Path(__file__).resolve().parents[2]
CODE = [REPO]  # where stage processes import eagle3 from (see snapshot_code)


def snapshot_code(dest: Path) -> Path:
    """Run every drill process on a frozen copy of the code: a reference run and its rerun must run
    the same code, and this working tree may be edited while a long drill runs."""
    import shutil

    for pkg in ("eagle3", "tasks", "flows"):
        shutil.copytree(REPO / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    CODE[0] = dest
    return dest
AUX = [1, 3, 4]  # the 6-layer tiny Llama
# 65 KiB shards hold one ~90-token sample (517 bytes/token at H=64, bf16), and a 128-token batch
# budget runs one sample per forward: every sample is its own batch and its own shard commit.
EXTRACT_FLAGS = ["--aux-layers", ",".join(map(str, AUX)), "--shard-bytes", str(1 << 16), "--batch-tokens", "128"]
TRAIN_FLAGS = ["--max-steps", "24", "--epochs", "20", "--ttt-steps", "2", "--pack-tokens", "128", "--log-every", "1",
               "--val-every", "3", "--ckpt-every", "2", "--warmup-steps", "1", "--threads", "1", "--lr", "1e-3"]


@dataclass
class Inputs:
    model: Path
    prep: Path
    ver: Path
    hid: Path  # the uninterrupted extract run
    train: Path  # the uninterrupted train run


def build_inputs(root: Path, model: Path, conversations: int = 30) -> Inputs:
    """Prepare `conversations` real ShareGPT conversations, then the uninterrupted extract and train runs."""
    from eagle3.config import PrepareConfig
    from eagle3.prepare import prepare
    from eagle3.verifier import extract_verifier

    x = Inputs(model, root / "prep", root / "ver", root / "hid", root / "train")
    prepare(model, x.prep, PrepareConfig(data="sharegpt", limit=conversations, max_len=96, val_fraction=0.15,
                                         draft_vocab=256), progress=False)
    extract_verifier(model, x.prep, x.ver)
    for cmd in (extract_cmd(x, x.hid), train_cmd(x, x.train)):
        r = cli(cmd)
        assert r.returncode == 0, r.stderr[-3000:]
    return x


def extract_cmd(x: Inputs, out: Path) -> list[str]:
    return ["extract", "--model", str(x.model), "--prepared", str(x.prep), "--out", str(out), *EXTRACT_FLAGS]


def train_cmd(x: Inputs, out: Path) -> list[str]:
    return ["train", "--hidden", str(x.hid), "--verifier", str(x.ver), "--out", str(out), *TRAIN_FLAGS]


def cli(argv: list[str], env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_KILL")}
    return subprocess.run([sys.executable, "-m", "eagle3.cli", *argv], capture_output=True, text=True, cwd=CODE[0],
                          env={**clean, **(env or {})}, timeout=timeout)


# ---------------------------------------------------------------- what "equal" means
def shard_digests(d: Path) -> list[tuple[str, str]]:
    """(file, sha256) of every shard, as the manifest records it and as the bytes on disk say."""
    m = json.loads((d / "manifest.json").read_text())
    return [(s["file"], s["sha256"]) for s in m["shards"]] + [
        (s["file"], sha256_file(d / s["file"])) for s in m["shards"]]


def losses(d: Path) -> list[tuple[int, float]]:
    """The loss trajectory: (step, loss) of every train and validation record."""
    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["split"], r["loss"]) for r in rows]


def weights(d: Path) -> str:
    return sha256_file(d / "final" / "model.safetensors")


def leftovers(d: Path) -> list[str]:
    return [str(p) for p in d.rglob(".*.tmp")]


# ---------------------------------------------------------------- one drill
@dataclass
class Drill:
    stage: str
    point: str
    killed: bool = False  # the process died of SIGKILL at the point
    recovered: bool = False  # the rerun finished (exit 0, no temp leftovers)
    equal: bool = False  # its outputs equal the uninterrupted run's
    detail: str = ""


def kill_drill(stage: str, spec: str, x: Inputs, out: Path) -> Drill:
    """Run the stage with EAGLE3_KILL_AT=spec, rerun it, compare with the uninterrupted run."""
    cmd = extract_cmd(x, out) if stage in ("extract", "shard commit") or "shards/" in spec else train_cmd(x, out)
    d = Drill(stage, spec)
    first = cli(cmd, {"EAGLE3_KILL_AT": spec})
    d.killed = first.returncode == -signal.SIGKILL
    if not d.killed:
        d.detail = f"not killed (exit {first.returncode}): {first.stderr[-300:]}"
        return d
    if spec.startswith("file.writing"):  # it died inside a tensor file's write: a partial temp file is left
        part = partial_files(out)
        d.killed = bool(part)
        if not part:
            d.detail = "killed, but no partially written temp file was left"
            return d
        d.detail = f"partial: {part[0][0]} ({part[0][1]:,} bytes)"
    return _rerun_and_compare(d, cmd, x, out)


def partial_files(out: Path) -> list[tuple[str, int]]:
    """(name, bytes) of every file inside a killed writer's temp file or temp dir."""
    found = []
    for t in out.rglob(".*.tmp"):
        for f in ([t] if t.is_file() else [f for f in t.rglob("*") if f.is_file()]):
            found.append((str(f.relative_to(out)), f.stat().st_size))
    return found


def random_kill_drill(stage: str, x: Inputs, out: Path, rng) -> Drill:
    """SIGKILL the real process from outside at a random moment *inside* its work: once a random number
    of shards (extract) or optimizer steps (train) of the uninterrupted run is done, after a further
    random fraction of the pace observed so far (seconds per shard or step). A fixed delay would miss
    on a fast machine: the tiny drill extraction writes its last shards and the manifest within
    milliseconds. The process is frozen (SIGSTOP) before it is judged, so nothing changes between the
    check and the kill. `killed` counts only kills that landed there: the process was still running
    and had not written its manifest."""
    if stage == "extract":
        total = len(json.loads((x.hid / "manifest.json").read_text())["shards"])
        target = rng.randint(1, total - 1)
        cmd = extract_cmd(x, out)

        def progress() -> int:
            return len(list((out / "shards").glob("*.safetensors"))) if (out / "shards").is_dir() else 0
    else:
        target = rng.randint(1, 23)  # of TRAIN_FLAGS' 24 steps
        cmd = train_cmd(x, out)

        def progress() -> int:
            m = out / "metrics.jsonl"
            return max((json.loads(ln)["step"] for ln in m.read_text().splitlines() if '"train"' in ln), default=0) \
                if m.is_file() else 0
    frac = rng.uniform(0.0, 1.0)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_KILL")}
    p = subprocess.Popen([sys.executable, "-m", "eagle3.cli", *cmd], cwd=CODE[0], env=clean,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, first, done = time.time() + 600, None, 0
    while done < target and p.poll() is None and time.time() < deadline:
        time.sleep(0.002)
        done = progress()
        if done and first is None:
            first = (done, time.time())  # the first unit seen: the pace is measured from here
    pace = (time.time() - first[1]) / (done - first[0]) if first and done > first[0] else 0.0
    delay = frac * min(pace, 0.3)
    time.sleep(delay)
    if p.poll() is None:
        p.send_signal(signal.SIGSTOP)
    alive = p.poll() is None
    manifest = (out / "manifest.json").exists()
    p.send_signal(signal.SIGKILL)
    p.wait()
    d = Drill(stage, f"external SIGKILL after {target} {'shards' if stage == 'extract' else 'steps'} + {delay:.3f}s "
                     f"({frac:.2f} of {pace:.3f}s each)")
    d.killed = alive and p.returncode == -signal.SIGKILL and not manifest
    if not d.killed:
        d.detail = "finished before the kill" if not alive else "the manifest was already written"
        return d
    return _rerun_and_compare(d, cmd, x, out)


def _rerun_and_compare(d: Drill, cmd: list[str], x: Inputs, out: Path) -> Drill:
    again = cli(cmd)
    d.recovered = again.returncode == 0 and not leftovers(out)
    if not d.recovered:
        d.detail = f"rerun exit {again.returncode}, leftovers {leftovers(out)[:3]}: {again.stderr[-500:]}"
        return d
    if cmd[0] == "extract":
        d.equal = shard_digests(out) == shard_digests(x.hid)
        d.detail = "" if d.equal else "shard sha256s differ from the uninterrupted run"
    else:
        same_loss, same_w = losses(out) == losses(x.train), weights(out) == weights(x.train)
        d.equal = same_loss and same_w
        d.detail = ("" if d.equal
                    else f"vs the uninterrupted run: loss trajectory equal={same_loss}, weights equal={same_w}")
    return d


# ---------------------------------------------------------------- ENOSPC on a small tmpfs
def tmpfs_available() -> bool:
    """A private mount namespace (root, or unprivileged user namespaces) where a tmpfs can be mounted."""
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


ENOSPC_SCRIPT = r"""
set -u
mount -t tmpfs -o size="$BIG" tmpfs "$DISK"
"$PY" -m eagle3.cli "$@" > /dev/null 2> "$RES/first.err" &
pid=$!
# another writer fills the disk once extraction has committed its first shard (the preflight passed)
while kill -0 $pid 2> /dev/null && ! ls "$DISK"/out/shards/*.safetensors > /dev/null 2>&1; do sleep 0.01; done
head -c "$FILL" /dev/zero > "$DISK/filler" 2> /dev/null
wait $pid; echo $? > "$RES/first.rc"
find "$DISK" -name '.*.tmp' > "$RES/leftovers.txt"
ls "$DISK/out/shards" > "$RES/committed.txt" 2>/dev/null
rm "$DISK/filler"   # space freed
"$PY" -m eagle3.cli "$@" > /dev/null 2> "$RES/second.err"; echo $? > "$RES/second.rc"
cp -r "$DISK/out" "$RES/out"
"""

@dataclass
class EnospcResult:
    first_rc: int
    message: str
    leftovers: list[str]
    committed: int
    second_rc: int
    out: Path


def enospc_extract(x: Inputs, work: Path, fraction: float = 0.4) -> EnospcResult:
    """Extract on a tmpfs with room for all shards; once the first is committed, a filler leaves room
    for only `fraction` of them; remove it; rerun. Runs in its own mount namespace, so nothing is
    mounted on this machine after it."""
    total = sum(s["num_bytes"] for s in json.loads((x.hid / "manifest.json").read_text())["shards"])
    disk, res = work / "disk", work / "res"
    disk.mkdir(parents=True)
    res.mkdir()
    big = 2 * total + (8 << 20)
    env = {**os.environ, "BIG": str(big), "FILL": str(big - int(total * fraction)),
           "DISK": str(disk), "RES": str(res), "PY": sys.executable}
    env = {k: v for k, v in env.items() if not k.startswith("EAGLE3_KILL")}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", ENOSPC_SCRIPT, "sh", *extract_cmd(x, disk / "out")],
                       cwd=CODE[0], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    err = (res / "first.err").read_text().strip().splitlines()
    return EnospcResult(
        first_rc=int((res / "first.rc").read_text()),
        message="\n".join(ln for ln in err if "error" in ln.lower() or "Traceback" in ln),
        leftovers=(res / "leftovers.txt").read_text().split(),
        committed=len([f for f in (res / "committed.txt").read_text().split() if f.endswith(".safetensors")]),
        second_rc=int((res / "second.rc").read_text()),
        out=res / "out",
    )


ENOSPC_TRAIN_SCRIPT = r"""
set -u
mount -t tmpfs -o size="$SMALL" tmpfs "$DISK"
"$PY" -m eagle3.cli "$@" > /dev/null 2> "$RES/first.err"; echo $? > "$RES/first.rc"
find "$DISK" -name '.*.tmp' > "$RES/leftovers.txt"
cp -r "$DISK/out" "$RES/after-failure"
mount -o remount,size="$BIG" "$DISK"   # space freed
"$PY" -m eagle3.cli "$@" > /dev/null 2> "$RES/second.err"; echo $? > "$RES/second.rc"
cp -r "$DISK/out" "$RES/out"
"""


@dataclass
class EnospcTrainResult:
    first_rc: int
    message: str  # the error lines of the failed run
    leftovers: list[str]
    checkpoints: list[str]  # step checkpoints left by the failed run, newest last
    intact: bool  # every one of them (and `best`) is complete and matches its checksums
    second_rc: int
    resumed_from: str  # the rerun's "resumed from ..." line
    out: Path


def enospc_train(x: Inputs, work: Path, room: float = 3.5) -> EnospcTrainResult:
    """Train with --out on a tmpfs with room for `room` checkpoints: with 2 step checkpoints kept plus
    `best`, the first save that needs a 4th one runs out of space. Then grow it and rerun."""
    from eagle3.train import checkpoint as ckpt

    one = sum(f.stat().st_size for f in next((x.train / "checkpoints").glob("step-*")).iterdir())
    disk, res = work / "disk", work / "res"
    disk.mkdir(parents=True)
    res.mkdir()
    pages = int(room * (one + 3 * 4096)) + 8 * 4096  # tmpfs counts whole pages per file
    env = {**os.environ, "SMALL": str(pages // 4096 * 4096), "BIG": str(8 * one + (32 << 20)), "DISK": str(disk),
           "RES": str(res), "PY": sys.executable}
    env = {k: v for k, v in env.items() if not k.startswith("EAGLE3_KILL")}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", ENOSPC_TRAIN_SCRIPT, "sh", *train_cmd(x, disk / "out")],
                       cwd=CODE[0], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    err = (res / "first.err").read_text().strip().splitlines()
    after = res / "after-failure"
    steps = ckpt.step_dirs(after)
    best = after / ckpt.CKPT_DIR / ckpt.BEST
    again = (res / "second.err").read_text()
    return EnospcTrainResult(
        first_rc=int((res / "first.rc").read_text()),
        message="\n".join(ln for ln in err if "error" in ln.lower() or "Traceback" in ln),
        leftovers=(res / "leftovers.txt").read_text().split(),
        checkpoints=[d.name for d in steps],
        intact=bool(steps) and all(ckpt.problem(d) is None for d in steps + ([best] if best.is_dir() else [])),
        second_rc=int((res / "second.rc").read_text()),
        resumed_from=next((ln for ln in again.splitlines() if "resumed from" in ln), ""),
        out=res / "out",
    )


PREFLIGHT_SCRIPT = r"""
mount -t tmpfs -o size="$SIZE" tmpfs "$DISK" && "$PY" -m eagle3.cli "$@"; rc=$?
find "$DISK/out" -type f ! -name .eagle3.lock; exit $rc
"""


def extract_disk_preflight(x: Inputs, work: Path, fraction: float = 0.4) -> dict:
    """`eagle3 extract` on a tmpfs with room for `fraction` of the shards: it must refuse up front, in one
    line, having written nothing but its lock file."""
    total = sum(s["num_bytes"] for s in json.loads((x.hid / "manifest.json").read_text())["shards"])
    disk = work / "disk"
    disk.mkdir(parents=True)
    env = {**os.environ, "SIZE": str(int(total * fraction) // 4096 * 4096), "DISK": str(disk), "PY": sys.executable}
    r = subprocess.run(["unshare", "-rm", "sh", "-c", PREFLIGHT_SCRIPT, "sh", *extract_cmd(x, disk / "out")],
                       cwd=CODE[0], capture_output=True, text=True, timeout=600,
                       env={k: v for k, v in env.items() if not k.startswith("EAGLE3_KILL")})
    err = [ln for ln in r.stderr.splitlines() if "error" in ln.lower() or "Traceback" in ln]
    return {"exit": r.returncode, "message": "\n".join(err), "files_written": r.stdout.split(),
            "out": str(disk / "out")}


# ---------------------------------------------------------------- the other writing stages
# Each stage's command into `out` (and, for eval, its replay cache in `cache`), on the drill's inputs.
def stage_cmd(stage: str, x: Inputs, out: Path, cache: Path | None = None) -> list[str]:
    if stage == "prepare":  # 4 train shards of 8 samples, so kills land between shard commits
        return ["prepare", "--model", str(x.model), "--data", "sharegpt", "--limit", "30", "--max-len", "96",
                "--val-fraction", "0.15", "--draft-vocab", "256", "--shard-samples", "8", "--out", str(out)]
    if stage == "verifier":
        return ["verifier", "--model", str(x.model), "--prepared", str(x.prep), "--out", str(out)]
    if stage == "regenerate":  # 3 chunks of 2 records
        return ["regenerate", "--model", str(x.model), "--data", "sharegpt", "--limit", "6", "--max-new-tokens", "12",
                "--chunk-records", "2", "--threads", "1", "--out", str(out)]
    if stage == "eval":  # replay: the target's answers, then its aux states, then the draft's pass and the report
        return ["eval", "--model", str(x.model), "--draft", str(x.train / "final"), "--prompts", str(x.prep),
                "--limit", "4", "--max-new-tokens", "12", "--k", "2", "--mode", "replay", "--threads", "1",
                "--replay-cache", str(cache or out.parent / f"{out.name}-cache"), "--out", str(out)]
    raise ValueError(stage)


# Kill points inside each stage's own writes: a file complete but not renamed, renamed but not recorded, and the
# manifest's own write.
STAGE_POINTS = {
    "prepare": ["file.written@train-:2", "file.renamed@train-:2", "file.written@manifest.json:1"],
    "verifier": ["file.written@verifier.safetensors:1", "file.renamed@verifier.safetensors:1",
                 "file.written@manifest.json:1"],
    "regenerate": ["file.written@progress.json:2", "file.renamed@progress.json:3", "file.written@manifest.json:1"],
    "eval": ["dir.written@cache:1", "file.written@cache:1", "file.written@samples.jsonl:1",
             "file.written@report.json:1"],
}


def fingerprint(out: Path) -> str:
    return json.loads((out / "manifest.json").read_text())["fingerprint"]


def stage_reference(stage: str, x: Inputs, root: Path) -> str:
    """The uninterrupted run's manifest fingerprint (content only: no path, no time)."""
    r = cli(stage_cmd(stage, x, root / f"{stage}-ref"))
    assert r.returncode == 0, r.stderr[-3000:]
    return fingerprint(root / f"{stage}-ref")


def stage_kill_drill(stage: str, spec: str, x: Inputs, out: Path, ref: str) -> Drill:
    """SIGKILL `stage` at `spec`, rerun it, compare its manifest's fingerprint with the uninterrupted run's."""
    cmd, d = stage_cmd(stage, x, out), Drill(stage, spec)
    first = cli(cmd, {"EAGLE3_KILL_AT": spec})
    d.killed = first.returncode == -signal.SIGKILL
    if not d.killed:
        d.detail = f"not killed (exit {first.returncode}): {first.stderr[-300:]}"
        return d
    again = cli(cmd)
    d.recovered = again.returncode == 0 and not leftovers(out) and not leftovers(out.parent / f"{out.name}-cache")
    if not d.recovered:
        d.detail = f"rerun exit {again.returncode}, leftovers {leftovers(out)[:3]}: {again.stderr[-500:]}"
        return d
    d.equal = fingerprint(out) == ref
    d.detail = "" if d.equal else "the manifest's fingerprint differs from the uninterrupted run's"
    return d


# ---------------------------------------------------------------- a rank of several killed
def ranks_cmd(x: Inputs, out: Path) -> list[str]:
    return [*train_cmd(x, out), "--nproc-per-node", "2", "--grad-accum", "1"]


def rank_kill_drill(spec: str, rank: int, x: Inputs, out: Path, ref: Path) -> Drill:
    """`eagle3 train` with 2 ranks, rank `rank` SIGKILLed at `spec` (torchrun then stops the other and the command
    fails); rerun; compare with the uninterrupted 2-rank run `ref` (losses and weights, bitwise)."""
    d, marker = Drill(f"train, 2 ranks (rank {rank} killed)", spec), out.parent / f"{out.name}.killed"
    first = cli(ranks_cmd(x, out), {"EAGLE3_KILL_AT": spec, "EAGLE3_KILL_RANK": str(rank),
                                    "EAGLE3_KILL_MARKER": str(marker)})
    d.killed = marker.is_file() and first.returncode != 0
    if not d.killed:
        d.detail = f"not killed (exit {first.returncode}): {first.stderr[-300:]}"
        return d
    again = cli(ranks_cmd(x, out))
    d.recovered = again.returncode == 0 and not leftovers(out)
    if not d.recovered:
        d.detail = f"rerun exit {again.returncode}, leftovers {leftovers(out)[:3]}: {again.stderr[-500:]}"
        return d
    d.equal = losses(out) == losses(ref) and weights(out) == weights(ref)
    d.detail = "" if d.equal else "loss trajectory or weights differ from the uninterrupted 2-rank run"
    return d


# ---------------------------------------------------------------- ENOSPC in any stage
ENOSPC_STAGE_SCRIPT = r"""
set -u
mount -t tmpfs -o size="$BIG" tmpfs "$DISK"
head -c "$FILL" /dev/zero > "$DISK/filler"
"$PY" -m eagle3.cli "$@" > /dev/null 2> "$RES/first.err"; echo $? > "$RES/first.rc"
find "$DISK" -name '.*.tmp' > "$RES/leftovers.txt"
rm "$DISK/filler"   # space freed
"$PY" -m eagle3.cli "$@" > /dev/null 2> "$RES/second.err"; echo $? > "$RES/second.rc"
cp "$DISK/out/manifest.json" "$RES/manifest.json" 2> /dev/null
"""


def du(*dirs: Path) -> int:
    """Bytes of every file under `dirs`, each rounded up to whole 4 KiB pages (as tmpfs counts them)."""
    return sum(-(-f.stat().st_size // 4096) * 4096 for d in dirs if d.is_dir() for f in d.rglob("*") if f.is_file())


def enospc_stage(stage: str, x: Inputs, work: Path, ref_dirs: tuple[Path, ...], ref: str,
                 fraction: float = 0.5) -> dict:
    """`stage` writing to a tmpfs with room for `fraction` of what its uninterrupted run wrote (`ref_dirs`): it must
    fail in one line naming the full disk, exit 2, and leave no temp file; after the space is freed the same
    command must finish with the uninterrupted run's fingerprint."""
    disk, res = work / "disk", work / "res"
    disk.mkdir(parents=True)
    res.mkdir()
    need = du(*ref_dirs)
    big = need + (8 << 20)
    env = {**os.environ, "BIG": str(big), "FILL": str(big - int(need * fraction) // 4096 * 4096), "DISK": str(disk),
           "RES": str(res), "PY": sys.executable}
    env = {k: v for k, v in env.items() if not k.startswith("EAGLE3_KILL")}
    cmd = stage_cmd(stage, x, disk / "out", disk / "cache")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", ENOSPC_STAGE_SCRIPT, "sh", *cmd], cwd=CODE[0], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    err = (res / "first.err").read_text().strip().splitlines()
    second = int((res / "second.rc").read_text())
    return {"stage": stage, "room": int(need * fraction), "first_exit": int((res / "first.rc").read_text()),
            "message": err[-1] if err else "",
            "one_line": bool(err) and err[-1].startswith(f"eagle3 {stage}: error: ") and not any("Traceback" in ln
                                                                                                  for ln in err),
            "leftovers": (res / "leftovers.txt").read_text().split(), "rerun_exit": second,
            "equal": second == 0 and fingerprint(res) == ref}
