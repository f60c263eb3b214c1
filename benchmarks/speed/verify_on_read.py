"""Verify-on-read at start-up: every rank checks every hidden-state shard against the manifest before
trusting it. Before: each rank re-hashed each shard on every start. Now: once per host and file
identity (a stamp keyed by path, size, mtime, ctime, inode), the other ranks waiting for it.

    python -m benchmarks.speed.verify_on_read [--gib 2.2] [--ranks 8] [--repeats 3]

Builds a real store of at least --gib GiB: ShareGPT conversations (up to 512 tokens) prepared with
SmolLM2's tokenizer and template, hidden states extracted by `eagle3 extract` in fp32 from a random
3-layer Llama with H=512 (the bytes are what is measured, not the model). Then --ranks processes
start at one signal, open the store the way the trainer does (`open_store`) and verify every shard
(each in its own shuffled order); the figure is the wall time from the signal until the last rank
is done, and the bytes hashed in all. Modes, interleaved, each --repeats times:

    before  the previous code path: each rank hashes every shard (`sha256_file` per process)
    cold    no stamp on this host yet (the store was written elsewhere): one rank hashes each shard
    warm    the stamps exist (any later start, retry, or a store this host wrote): nothing is read

The shards sit in the page cache after the first pass, so every mode measures hashing, not disk
reads; on cold storage `before` also reads ranks x store bytes from disk. Ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RANK = r"""
import json, os, random, sys, time
from pathlib import Path
import eagle3.storage.hashing as hashing
import eagle3.storage.store as store
hashed = [0]
real = hashing.sha256_file
def counting(p):
    hashed[0] += os.path.getsize(p)
    return real(p)
hashing.sha256_file = counting
if sys.argv[3] == "before":  # the code before stamps: shard_problem hashed with sha256_file in every process
    store.sha256_file_cached = lambda p, rehash=False: counting(p)
go, rank = Path(sys.argv[2]), int(sys.argv[4])
Path(f"{go}.ready-{rank}").touch()  # imports done: the clock starts when every rank is here
while not go.exists():
    time.sleep(0.002)
t0 = time.perf_counter()
s = store.open_store(sys.argv[1], "train")
order = list(range(len(s.manifest.shards)))
random.Random(rank).shuffle(order)
for k in order:
    if s.manifest.shards[k].split == "train":
        s._shard(k)
print(json.dumps({"seconds": time.perf_counter() - t0, "bytes_hashed": hashed[0], "end": time.time()}))
"""


def build_store(root: Path, gib: float) -> Path:
    """prepare (real ShareGPT, SmolLM2's template) -> `eagle3 extract` (fp32) from a random H=512 Llama."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagle3.assets import materialize_smollm2
    from eagle3.config import PrepareConfig
    from eagle3.prepare import prepare
    from eagle3.storage.store import bytes_per_token

    tok = AutoTokenizer.from_pretrained(materialize_smollm2(REPO / "assets" / "smollm2"))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = root / "llama-h512"
    LlamaForCausalLM(cfg).eval().save_pretrained(model, safe_serialization=True)
    tok.save_pretrained(model)
    per_tok = bytes_per_token(3, 512, "fp32")
    need = int(gib * (1 << 30) / per_tok)
    conv = int(need / (0.95 * 470) * 1.1) + 50  # ~470 tokens per kept conversation at max_len 512, a margin
    prepare(model, root / "prep", PrepareConfig(data="sharegpt", limit=conv, max_len=512, val_fraction=0.01),
            progress=False)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "extract", "--model", str(model), "--prepared",
                        str(root / "prep"), "--out", str(root / "hid"), "--aux-layers", "0,1,2", "--storage", "fp32",
                        "--shard-bytes", str(128 << 20), "--batch-tokens", "16384"],
                       cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "EAGLE3_CACHE_DIR": str(root / "cache-writer")})
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"store built by `eagle3 extract` in {time.perf_counter() - t0:.0f} s", flush=True)
    return root / "hid"


def start(hid: Path, mode: str, ranks: int, cache: Path, work: Path) -> dict:
    """`ranks` processes verify the store at one signal; wall time from the signal to the last one done."""
    go = work / f"go-{time.monotonic_ns()}"
    env = {**os.environ, "EAGLE3_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    ps = [subprocess.Popen([sys.executable, "-c", RANK, str(hid), str(go), mode, str(r)], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, text=True) for r in range(ranks)]
    deadline = time.time() + 600
    while sum(Path(f"{go}.ready-{r}").exists() for r in range(ranks)) < ranks:  # all imported, all waiting
        assert time.time() < deadline and all(p.poll() is None for p in ps), "a rank did not start"
        time.sleep(0.05)
    t0 = time.time()
    go.touch()
    outs = []
    for p in ps:
        out, _ = p.communicate(timeout=3600)
        assert p.returncode == 0
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {"wall_s": max(o["end"] for o in outs) - t0, "bytes_hashed": sum(o["bytes_hashed"] for o in outs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.2, help="store size to build, GiB (default 2.2)")
    ap.add_argument("--ranks", type=int, default=8, help="processes verifying at once (default 8, one host's GPUs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", default=None, help="build (or reuse) the store here instead of a temp dir")
    a = ap.parse_args()
    from eagle3.storage.manifests import HiddenStates

    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="eagle3-verify-bench-"))
    hid = root / "hid"
    if not HiddenStates.exists(hid):
        hid = build_store(root, a.gib)
    m = HiddenStates.read(hid)
    train = [s for s in m.shards if s.split == "train"]
    size = sum((hid / s.file).stat().st_size for s in train)
    print(f"store: {len(train)} train shards, {size / (1 << 30):.2f} GiB, {m.num_tokens:,} tokens; "
          f"{a.ranks} ranks on {os.cpu_count()} CPUs", flush=True)
    start(hid, "before", 1, root / "cache-warmup", root)  # the page cache holds the shards from here on
    res: dict[str, list[dict]] = {"before": [], "cold": [], "warm": []}
    for i in range(a.repeats):
        cache = root / f"cache-{i}"
        shutil.rmtree(cache, ignore_errors=True)
        for mode in ("before", "cold", "warm"):  # cold then warm share one cache dir: warm finds cold's stamps
            r = start(hid, mode, a.ranks, cache, root)
            res[mode].append(r)
            print(f"  repeat {i + 1} {mode:<6} wall {r['wall_s']:7.2f} s, "
                  f"hashed {r['bytes_hashed'] / (1 << 30):6.2f} GiB", flush=True)
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in res.items()}
    gib = {k: v[0]["bytes_hashed"] / (1 << 30) for k, v in res.items()}
    print(f"\nstart-up verification of {size / (1 << 30):.2f} GiB by {a.ranks} ranks (median of {a.repeats}):")
    for k in res:
        print(f"  {k:<6} {med[k]:7.2f} s  {gib[k]:6.2f} GiB hashed  ({med[k] / med['before']:.3f} of before)")
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"bench": "verify_on_read", "store_gib": round(size / (1 << 30), 3), "shards": len(train),
                      "ranks": a.ranks, "cpus": os.cpu_count(), "repeats": a.repeats,
                      "seconds_median": {k: round(v, 3) for k, v in med.items()},
                      "gib_hashed": {k: round(v, 2) for k, v in gib.items()},
                      "cold_over_before": round(med["cold"] / med["before"], 4),
                      "warm_over_before": round(med["warm"] / med["before"], 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
