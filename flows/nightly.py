"""Nightly incremental retrain: new conversations in, a warm-started draft out, promoted only if tau holds."""
from __future__ import annotations

import glob
import json
import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from eagle3.config import PipelineConfig
from eagle3.data.readers import resolve_source, source_files
from eagle3.form import FORM
from eagle3.storage.atomic import atomic_write_json
from eagle3.storage.manifests import EvalReport, HiddenStates, PreparedData, TrainedDraft
from flows.pipeline import FORM_DEFAULT, run_stages


class NightlyConfig(BaseModel):
    """Where conversations arrive, where nightly runs and the promoted draft live, and when to promote."""

    model_config = FORM  # the run form: keys as titles, limits in descriptions

    conversations: str = Field(
        "", description="a directory of conversation files (JSON, JSONL, Parquet) or a glob of them; each night "
        "reads all of them and extracts only the samples no earlier night stored. Unset, a night fails at once "
        "(deployments/nightly.py sets it and turns the schedule on)")
    root: str = Field("runs/nightly", description="each night runs in a subdir of root named by its UTC start "
                      "time (YYYYmmdd-HHMMSS), one subdir per stage; root/promoted.json names the promoted draft")
    margin: float = Field(0.05, ge=0.0, le=32.0,
                          description="promote unless the new tau falls more than this below the promoted draft's tau")
    seed_run: str | None = Field(None, description="while nothing is promoted yet: a pipeline run dir whose draft "
                                 "counts as promoted (warm start, vocab map, hidden states to reuse)")
    base: PipelineConfig = Field(default_factory=lambda: FORM_DEFAULT,
                                 description="target model and stage settings (default: the demo preset); run_dir, "
                                 "prepare.data, prepare.vocab_from and train.init_from are set each night")


@flow(name="eagle3-nightly", log_prints=True)
def nightly(config: NightlyConfig = NightlyConfig()) -> dict:  # noqa: B008  Prefect shows this default on the run form
    """Retrain on every conversation so far, warm-started from the promoted draft; promote it if tau holds."""
    check_source(config.conversations)  # before anything is written: a misconfigured night fails in one line
    root = Path(config.root)
    run_dir = root / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    current = promoted(config)  # None on the very first night: a cold start
    earlier = earlier_extracts(root, current)

    # A warm start keeps the promoted draft's d2t/t2d: prepare copies its vocab map, never rebuilds it.
    b = config.base
    data = collect(config.conversations, run_dir)
    vocab_from = f"{current['run_dir']}/prepare" if current else None
    init_from = current["draft"] if current else None
    cfg = b.model_copy(update={"run_dir": str(run_dir),
                               "prepare": b.prepare.model_copy(update={"data": data, "vocab_from": vocab_from}),
                               "train": b.train.model_copy(update={"init_from": init_from})})
    d, report = run_stages(cfg, reuse=earlier)  # extracts only the samples `earlier` does not hold

    new = {"run_dir": str(run_dir), "draft": d["final"], "tau": report.acceptance_length}
    promote = current is None or new["tau"] >= current["tau"] - config.margin
    if promote:
        atomic_write_json(root / "promoted.json", new)
    create_markdown_artifact(decision_markdown(new, current, promote, config.margin, d, earlier),
                             key="eagle3-nightly-promotion", description="eagle3 nightly: promotion decision")
    return {**new, "promoted": promote, "previous_tau": current["tau"] if current else None}


def promoted(config: NightlyConfig) -> dict | None:
    """The promoted draft: <root>/promoted.json, else the seed run, else None (the first night trains cold)."""
    path = Path(config.root) / "promoted.json"
    if path.is_file():
        return json.loads(path.read_text())
    if config.seed_run is None:
        return None
    run = Path(config.seed_run)
    return {"run_dir": str(run), "draft": str(run / "train" / TrainedDraft.read(run / "train").final_dir),
            "tau": EvalReport.read(run / "eval").acceptance_length}


def earlier_extracts(root: Path, current: dict | None) -> list[str]:
    """Hidden states to reuse: the latest night's extract dir and the promoted run's."""
    nights = sorted(p.parent for p in root.glob("*/extract/manifest.json"))
    dirs = [str(p) for p in nights[-1:]] + ([f"{current['run_dir']}/extract"] if current else [])
    return [x for i, x in enumerate(dirs) if x not in dirs[:i] and HiddenStates.exists(x)]


def check_source(conversations: str) -> None:
    """Raise a one-line ValueError when the source is unset, missing or holds no conversation file with data."""
    if not conversations.strip():
        raise ValueError("nightly: config.conversations is not set: name a directory or glob of conversation "
                         "files (python deployments/nightly.py --conversations DIR sets it)")
    if any(c in conversations for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(conversations, recursive=True)) if Path(f).is_file()]
        if not files:
            raise ValueError(f"nightly: conversations: nothing matches {conversations!r}")
    else:
        files = source_files(resolve_source(conversations))  # raises: missing, or no .json/.jsonl/.parquet
    if not any(f.stat().st_size for f in files):
        raise ValueError(f"nightly: conversations: {conversations!r}: its {len(files)} file(s) are all empty")


def collect(conversations: str, run_dir: Path) -> str:
    """A directory is the source as is; a glob becomes <run_dir>/conversations, links to the files it matches."""
    if not any(c in conversations for c in "*?["):
        return conversations
    files = sorted(glob.glob(conversations, recursive=True))
    if not files:
        raise ValueError(f"conversations: nothing matches {conversations!r}")
    out = run_dir / "conversations"
    out.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(files):
        (out / f"{i:06d}-{Path(f).name}").symlink_to(Path(f).resolve())
    return str(out)


def decision_markdown(new: dict, current: dict | None, promote: bool, margin: float, d: dict, earlier: list) -> str:
    prep, hidden = PreparedData.read(d["prepare"]), HiddenStates.read(d["extract"])
    s = hidden.stats
    verdict = "**promoted**" if promote else "**not promoted** (the promoted draft stays)"
    rule = (f"promote if new tau >= {current['tau']:.4f} - {margin} = {current['tau'] - margin:.4f}"
            if current else "nothing was promoted yet: the first draft is promoted")
    lines = [f"# eagle3 nightly `{new['run_dir']}`: {verdict}", "", rule, "",
             "| draft | tau | dir |", "|---|---|---|",
             f"| new | {new['tau']:.4f} | `{new['draft']}` |"]
    if current:
        lines.append(f"| promoted before | {current['tau']:.4f} | `{current['draft']}` |")
    lines += ["", f"Conversations read: {prep.records_read}; samples: {hidden.num_samples}, of which "
              f"{s.get('samples_computed')} extracted tonight and {s.get('samples_reused')} reused from "
              f"{', '.join(f'`{x}`' for x in earlier) or 'nothing'}.",
              f"Warm start: {'`' + current['draft'] + '`' if current else 'none (cold start)'}; "
              f"vocab map: {'kept from `' + current['run_dir'] + '/prepare`' if current else 'built tonight'}."]
    return "\n".join(lines) + "\n"
