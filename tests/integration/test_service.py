"""What the service's flows decide before any work starts: the nightly source check, the run dir's
{date}, the preflight's wall time and budget. No server needed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle3.config import PipelineConfig

EX = Path(__file__).resolve().parents[2] / "examples"


def test_nightly_refuses_an_unset_missing_or_empty_source_in_one_line(tmp_path):
    from flows.nightly import check_source

    inbox = tmp_path / "inbox"
    cases = {"": "config.conversations is not set", str(inbox): "does not exist",
             f"{inbox}/*.jsonl": "nothing matches"}
    for src, why in cases.items():
        with pytest.raises(ValueError, match=why) as e:
            check_source(src)
        assert "\n" not in str(e.value)
    inbox.mkdir()
    (inbox / "notes.txt").write_text("not a conversation file")
    with pytest.raises(ValueError, match="holds no .arrow/.parquet/.jsonl/.json files"):
        check_source(str(inbox))
    (inbox / "day1.jsonl").write_text("")
    with pytest.raises(ValueError, match="all empty"):
        check_source(str(inbox))
    with pytest.raises(ValueError, match="all empty"):
        check_source(f"{inbox}/*.jsonl")
    (inbox / "day1.jsonl").write_text('{"messages": []}\n')
    check_source(str(inbox))
    check_source(f"{inbox}/*.jsonl")


def test_run_dir_date_is_expanded_once():
    from flows.pipeline import expand

    assert expand("runs/demo") == "runs/demo"
    assert re.fullmatch(r"runs/ui-\d{8}-\d{6}", expand("runs/ui-{date}"))


def test_preflight_states_wall_time_first_and_refuses_over_budget(smollm2_dir):
    from eagle3.planning import plan

    demo = PipelineConfig.from_file(EX / "smollm2-sharegpt.yaml").model_copy(update={"run_dir": "runs/none-yet"})
    p = plan(demo, max_hours=1.0)
    assert list(p.seconds) == ["prepare", "extract", "verifier", "train", "eval"] and not p.problems
    from eagle3.planning import hms

    first = p.markdown().splitlines()[2]  # the first thing the artifact says
    assert first.startswith(f"**Estimated wall time ~{hms(p.total_seconds())}") and p.total_seconds() > 20 * 60
    # Replay: a 16 s start, 160 turns (all 80 questions) x 256 tokens decoded batched at 137 tok/s, a forward over
    # ~2x that at 715 tok/s, and 2 questions (4 turns) x 64 tokens decoded live twice (speculative, greedy) at
    # 13.5 tok/s; live: every turn decoded twice, one at a time (both scaled alike by the target's size).
    live = plan(demo.model_copy(update={"eval": demo.eval.model_copy(update={"mode": "live"})}))
    assert p.seconds["eval"] / live.seconds["eval"] == pytest.approx(
        (16 + 160 * 256 / 137 + 2 * 160 * 256 / 715 + 4 * 64 * 2 / 13.5) / (160 * 256 * 2 / 13.5),
        rel=1e-3)  # the rates scale by SmolLM2's size over 135M, the start does not
    full = PipelineConfig.from_file(EX / "smollm2-sharegpt-full.yaml").model_copy(update={"run_dir": "runs/none-yet"})
    p = plan(full, free_bytes=1 << 50, free_mem=1 << 40, max_hours=1.0)
    (problem,) = p.problems
    assert problem.startswith("time: about ") and "over max_hours = 1 (1h00m)" in problem
    assert "raise max_hours in the run form (0: no limit)" in problem
    assert sum(p.seconds.values()) > 12 * 3600  # "about a day on this CPU"
    assert not plan(full, free_bytes=1 << 50, free_mem=1 << 40, max_hours=0).problems  # 0: no limit
