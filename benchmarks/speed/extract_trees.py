"""Extraction rate of another checkout's eagle3 on this host: is a slow run the code or the machine?

    TREE=/path/to/other/checkout .venv/bin/python -m benchmarks.speed.extract_trees 40

Prepares the first N ShareGPT conversations (demo settings: max_len 1024, draft vocab 8192) and extracts them with
the default ExtractConfig, all with the eagle3 package of TREE (a `git worktree` at an older commit, say), in this
venv. Run it for two trees in turn, more than once each: the host's own drift is as large as what it compares.
Prints one JSON line: the tree, tokens, seconds, tok/s, torch threads.
"""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# This venv's eagle3 is an editable install, whose import hook would win over sys.path: drop it, then put TREE first.
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__name__.lower()
                    and "editable" not in getattr(f, "__module__", "").lower()]
sys.path.insert(0, os.environ["TREE"])
ASSETS = Path(__file__).resolve().parents[2] / "assets" / "smollm2"


def main() -> None:
    import torch

    import eagle3
    from eagle3.config import ExtractConfig, PrepareConfig
    from eagle3.extract import run_extract
    try:
        from eagle3.prepare import prepare
    except ImportError:  # older layout
        from eagle3.data.prepare import prepare

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    tmp = Path(tempfile.mkdtemp())
    prepare(str(ASSETS), tmp / "prep", PrepareConfig(data="sharegpt", limit=n, max_len=1024, draft_vocab=8192,
                                                      val_fraction=0.03), progress=False)
    t0 = time.perf_counter()
    m = run_extract(str(ASSETS), tmp / "prep", tmp / "out", ExtractConfig(), show_progress=False)
    dt = time.perf_counter() - t0
    print(json.dumps({"tree": str(Path(eagle3.__file__).parents[1]), "tokens": m.num_tokens, "seconds": round(dt, 1),
                      "tok_s": round(m.num_tokens / dt, 1), "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
