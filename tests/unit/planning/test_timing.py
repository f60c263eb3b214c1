"""The CPU trainer's precision as the planner and the trainer resolve it, and what it does to the plan."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3.config import PipelineConfig
from eagle3.planning import plan, rates
from eagle3.runtime import floats

DEMO = Path(__file__).parents[3] / "examples" / "smollm2-sharegpt.yaml"


def _demo(**train) -> PipelineConfig:
    cfg = PipelineConfig.from_file(DEMO).model_copy(update={"run_dir": "runs/none-yet"})
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=train)})


def _planned(cfg: PipelineConfig, stage: str, row: str) -> tuple[float, list[str], str]:
    """The plan's seconds for `stage`, its problems, and the value of its row starting with `row`."""
    pl = plan(cfg, free_bytes=1 << 50, free_mem=1 << 40)
    return pl.seconds[stage], pl.problems, next(r for r in pl.rows if r.what.startswith(row)).human


def _train_s(cfg: PipelineConfig) -> tuple[float, list[str], str]:
    return _planned(cfg, "train", "precision on this CPU")


@pytest.mark.parametrize("units", [True, False])
def test_fast_is_bf16_only_where_the_cpu_has_bf16_units(monkeypatch, units):
    monkeypatch.setattr(floats, "cpu_bf16", lambda: units)
    cpu = torch.device("cpu")
    assert floats.resolve_precision("fast", cpu) == ("bf16" if units else "fp32")
    assert floats.resolve_precision("auto", cpu) == "fp32"  # the same numbers on every CPU host
    assert floats.resolve_precision("bf16", cpu) == "bf16" and floats.resolve_precision("fp32", cpu) == "fp32"
    assert floats.resolve_precision("fast", "cuda") == "bf16" == floats.resolve_precision("auto", "cuda")


def test_the_plan_trains_at_the_bf16_rates_where_fast_resolves_to_bf16(monkeypatch, smollm2_dir):
    monkeypatch.setattr(floats, "cpu_bf16", lambda: False)
    fp32_s, problems, shown = _train_s(_demo(precision="fast", optimizer="adamw"))
    assert not problems and shown == "fp32"
    assert _train_s(_demo(precision="fp32", optimizer="adamw"))[0] == fp32_s
    monkeypatch.setattr(floats, "cpu_bf16", lambda: True)
    bf16_s, problems, shown = _train_s(_demo(precision="fast", optimizer="adamw"))
    assert not problems and shown == "bf16"
    # every token at the bf16 rates: between the first-epoch and the later epochs' speed-ups (the fixed parts
    # of the stage, the start and the replay set, pull the ratio towards 1)
    (a1, a2), (b1, b2) = rates.TRAIN_CPU_TOK_PER_S, rates.TRAIN_CPU_BF16_TOK_PER_S
    assert 1.0 < fp32_s / bf16_s < max(b1 / a1, b2 / a2)
    # Muon's steps cost more than AdamW's
    assert _train_s(_demo(precision="fast", optimizer="muon"))[0] > bf16_s


def test_bf16_asked_of_a_cpu_without_bf16_units_is_refused_with_the_fix(monkeypatch, smollm2_dir):
    monkeypatch.setattr(floats, "cpu_bf16", lambda: False)
    _, problems, shown = _train_s(_demo(precision="bf16"))
    assert shown == "bf16"
    assert problems == ["train: precision bf16 on a CPU without bf16 units (avx512_bf16 or AMX in /proc/cpuinfo) is "
                        "emulated and many times slower than fp32; set train.precision: fast (bf16 where the CPU has "
                        "the units) or fp32"]
    monkeypatch.setattr(floats, "cpu_bf16", lambda: True)
    assert _train_s(_demo(precision="bf16"))[1] == []


def _extract(monkeypatch, units: bool, dtype: str) -> tuple[float, list[str], str]:
    monkeypatch.setattr(floats, "cpu_bf16", lambda: units)
    cfg = _demo()
    cfg = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"dtype": dtype})})
    return _planned(cfg, "extract", "compute dtype on this CPU")


@pytest.mark.parametrize("units", [True, False])
def test_extract_dtype_resolves_like_the_trainers_precision(monkeypatch, units):
    monkeypatch.setattr(floats, "cpu_bf16", lambda: units)
    assert floats.resolve_compute_dtype("fast", "cpu") == ("bfloat16" if units else "float32")
    assert floats.resolve_compute_dtype("auto", "cpu") == "float32"
    assert floats.resolve_compute_dtype("fast", "cuda") == "bfloat16" == floats.resolve_compute_dtype("auto", "cuda")
    assert floats.resolve_compute_dtype("float32", "cuda") == "float32"
    assert floats.resolve_compute_dtype("bfloat16", "cpu") == "bfloat16"


def test_the_plan_extracts_at_the_bf16_rate_where_fast_resolves_to_bf16(monkeypatch, smollm2_dir):
    fp32_s, problems, shown = _extract(monkeypatch, False, "fast")
    assert not problems and shown == "float32"
    assert _extract(monkeypatch, False, "auto")[0] == fp32_s
    bf16_s, problems, shown = _extract(monkeypatch, True, "fast")
    assert not problems and shown == "bfloat16"
    assert fp32_s / bf16_s == pytest.approx(rates.EXTRACT_CPU_BF16_TOK_PER_S / rates.EXTRACT_CPU_TOK_PER_S)
    assert _extract(monkeypatch, True, "auto")[0] == fp32_s  # auto: the same numbers on every CPU host


def test_extract_bf16_asked_of_a_cpu_without_bf16_units_is_refused_with_the_fix(monkeypatch, smollm2_dir):
    _, problems, shown = _extract(monkeypatch, False, "bfloat16")
    assert shown == "bfloat16"
    assert problems == ["extract: dtype bfloat16 on a CPU without bf16 units (avx512_bf16 or AMX in /proc/cpuinfo) is "
                        "emulated, as the trainer's bf16 is (13-16x slower than fp32 there); set extract.dtype: fast "
                        "(bf16 where the CPU has the units) or float32"]
    assert _extract(monkeypatch, True, "bfloat16")[1] == []
