"""What an extraction run depends on (`inputs`: the "already done" check and the cache key) and what an earlier
run left in `out`: a finished store of these inputs (returned as is), or the shards a killed run committed, each
kept when its plan key matches and its bytes are whole, and named and rebuilt otherwise."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.config import ExtractConfig
from eagle3.extract.backend import compute_dtype
from eagle3.model.target import Target
from eagle3.storage.atomic import clean_temp_files
from eagle3.storage.manifests import HiddenStates, PreparedData
from eagle3.storage.store import (
    FORMAT_VERSION,
    SHARD_DIR,
    ShardPlan,
    shard_meta,
    shard_problem,
)


def inputs(model: str | Path, prepared: str | Path, cfg: ExtractConfig,
           trust_remote_code: bool = False, target: Target | None = None) -> dict[str, Any]:
    """What the stored states depend on: the prepared data's and the target's content, the layer ids, the
    storage, the compute dtype as resolved on this host (bf16 states differ from fp32's by more than two
    backends' float noise) and the shard plan's settings (backend, batch and parallelism settings change speed,
    not bytes). The stage's "already done" check and the Prefect task's cache key are both this dict. `target`: `model`
    already open."""
    target = target or Target.open(model, trust_remote_code)
    return {
        "format": FORMAT_VERSION,
        "prepared": PreparedData.read(prepared).fingerprint,
        "model": target.fingerprint(),
        "layer_ids": target.layer_ids(cfg.aux_layer_ids),
        "storage": cfg.storage,
        "dtype": compute_dtype(cfg),
        "splits": cfg.splits,
        "shard_bytes": cfg.shard_bytes,
    }



def open_target(model: Path, prepared: Path, cfg: ExtractConfig,
                trust_remote_code: bool) -> tuple[Target, dict[str, Any]]:
    """The target, opened once, and the stage's `inputs` (the "already done" check) read from it."""
    target = Target.open(model, trust_remote_code)
    return target, inputs(model, prepared, cfg, trust_remote_code, target)



@dataclass
class Previous:
    """What `out` holds from an earlier run of this stage."""

    done: HiddenStates | None = None  # a finished run of these exact inputs, every shard sound: the result
    known: dict[str, str] = field(default_factory=dict)  # shard file -> sha256 a finished run recorded
    # shard file -> its problem (None: sound), for the shards `previous_run` hashed
    checked: dict[str, str | None] = field(default_factory=dict)



def previous_run(out: Path, fp: dict[str, Any]) -> Previous:
    """Read `out`'s manifest, if any. A finished run of inputs `fp` whose shards all hash to the recorded
    sha256s is returned as `done`; otherwise the manifest is removed (out is about to change: it is no
    longer a finished stage), and the recorded sha256s are kept to check committed shards against."""
    prev = Previous()
    if HiddenStates.exists(out):
        done = HiddenStates.read(out)
        prev.known = {s.file: s.sha256 for s in done.shards}
        if done.inputs == fp:
            prev.checked = {s.file: shard_problem(out / s.file, s.sha256) for s in done.shards}
            if not any(prev.checked.values()):
                prev.done = done
                return prev
        (out / "manifest.json").unlink()  # out is about to change: it is no longer a finished stage
    return prev



def open_out(out: Path) -> None:
    """Create `out/shards` and remove the temp files a killed run left there (their renames never happened)."""
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    clean_temp_files(out)
    clean_temp_files(out / SHARD_DIR)



def committed_shards(out: Path, plans: list[ShardPlan], prev: Previous) -> set[str]:
    """The planned shard files already committed in `out`."""
    # Which shards are already committed (same plan key, whole, and the bytes a finished run recorded,
    # when one did). A damaged shard is named and recomputed.
    committed = set()
    for p in plans:
        if (m := shard_meta(out / p.file)) is None or m.get("key") != p.key:
            continue
        bad = prev.checked[p.file] if p.file in prev.checked else shard_problem(out / p.file, prev.known.get(p.file))
        if bad:
            print(f"eagle3 extract: {bad}; rebuilding it", file=sys.stderr)
        else:
            committed.add(p.file)
    return committed



def drop_stale_shards(out: Path, plans: list[ShardPlan]) -> None:
    """Drop shards of an older plan (a different config or input) that this plan does not name."""
    planned = {p.file for p in plans}
    for f in (out / SHARD_DIR).glob("*.safetensors"):
        if f"{SHARD_DIR}/{f.name}" not in planned:
            f.unlink()
