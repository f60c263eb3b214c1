"""fit_minutes: the demo sized to a slow host by its conversations, the choice kept for reruns of the dir."""
from __future__ import annotations

import json
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.planning import plan
from eagle3.planning.fit import FIT_FILE, FLOOR, STEP, fit, read_fit
from eagle3.probe import HostSpeed

DEMO = Path(__file__).parents[3] / "examples" / "smollm2-sharegpt.yaml"


def _demo(run_dir: Path, minutes: float) -> PipelineConfig:
    return PipelineConfig.from_file(DEMO).model_copy(update={"run_dir": str(run_dir), "fit_minutes": minutes})


def _host(speed: float) -> HostSpeed:
    return HostSpeed(speed, speed, speed, measured=True)


def test_a_slow_host_gets_fewer_conversations_within_the_budget_and_reruns_keep_them(tmp_path, smollm2_dir):
    cfg = _demo(tmp_path / "run", 40)
    assert cfg.prepare.limit == 800
    slow = _host(0.6)
    fitted, f = fit(cfg, slow)
    n = fitted.prepare.limit
    assert f.cut and f.limit == 800 and f.fitted_limit == n and FLOOR <= n < 800 and n % STEP == 0
    assert f.planned_s == plan(cfg, free_bytes=1 << 60, free_mem=1 << 60, host=slow).total_seconds() > 40 * 60
    assert f.fitted_s == plan(fitted, free_bytes=1 << 60, free_mem=1 << 60, host=slow).total_seconds() <= 40 * 60
    # the largest such limit: one step more is over the budget
    more = fitted.model_copy(update={"prepare": fitted.prepare.model_copy(update={"limit": n + STEP})})
    assert plan(more, free_bytes=1 << 60, free_mem=1 << 60, host=slow).total_seconds() > 40 * 60
    kept = json.loads((tmp_path / "run" / FIT_FILE).read_text())
    assert kept["fitted_limit"] == n == read_fit(tmp_path / "run").fitted_limit
    assert f"prepare.limit 800 -> {n}" in f.line()
    # fewer conversations, not more passes: the preset's max_steps (471, ~1.6 passes over 800) would take the
    # trainer (max_steps overrides epochs) over the cut data ~3 times and past the budget; its 2 epochs end first
    assert cfg.train.max_steps == 471 and cfg.train.epochs == 2
    assert fitted.train.max_steps is None and f.max_steps_dropped and kept["max_steps_dropped"]
    assert "train.max_steps dropped: its epochs over them end first" in f.line()
    as_set = fitted.model_copy(update={"train": fitted.train.model_copy(update={"max_steps": 471})})
    assert plan(as_set, free_bytes=1 << 60, free_mem=1 << 60, host=slow).total_seconds() > 40 * 60
    # a rerun of the dir on a host that probes faster resumes the same run
    again, g = fit(cfg, _host(0.9))
    assert again.prepare.limit == n and g == f


def test_a_small_cut_keeps_max_steps_where_it_still_ends_training_first(tmp_path, smollm2_dir):
    cfg, host = _demo(tmp_path / "run", 40), _host(1.0)
    at = cfg.model_copy(update={"prepare": cfg.prepare.model_copy(update={"limit": 750})})
    budget = plan(at, free_bytes=1 << 60, free_mem=1 << 60, host=host).total_seconds() / 60
    fitted, f = fit(cfg.model_copy(update={"fit_minutes": budget}), host, keep=False)
    # 2 epochs over 750 conversations are more steps than 471: max_steps still ends training, as configured
    assert fitted.prepare.limit == 750 and fitted.train.max_steps == 471 and not f.max_steps_dropped
    assert "max_steps" not in f.line()


def test_a_host_fast_enough_runs_as_configured_and_a_dry_run_writes_nothing(tmp_path, smollm2_dir):
    cfg = _demo(tmp_path / "run", 600)
    same, f = fit(cfg, _host(1.0), keep=False)
    assert same.prepare.limit == 800 and not f.cut and "as configured" in f.line()
    assert not (tmp_path / "run").exists()
    # not cut: the config as given, an unset limit left unset (a source's count may be an estimate from its size)
    unset = cfg.model_copy(update={"prepare": cfg.prepare.model_copy(update={"limit": None})})
    assert fit(unset, _host(100.0), keep=False)[0] is unset
    off = _demo(tmp_path / "off", 0)
    assert fit(off, _host(0.1)) == (off, None) and not (tmp_path / "off").exists()


def test_too_slow_a_host_stops_at_the_floor_and_says_so(tmp_path, smollm2_dir):
    fitted, f = fit(_demo(tmp_path / "run", 5), _host(0.2), keep=False)
    assert fitted.prepare.limit == FLOOR and f.fitted_s > 5 * 60
    assert f"(the floor, {FLOOR}: still over the budget)" in f.line()
