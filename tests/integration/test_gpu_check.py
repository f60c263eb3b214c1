"""`python -m benchmarks.gpu_check --smoke`: every section of the GPU check runs on the CPU at tiny shapes, so the
script the GPU machine runs never rots; its equalities are asserted here from the figures it records."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ["trainer", "attention", "extract", "evaluator", "gpu_tests"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--smoke", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=900)
    assert (out / "gpu_check.json").is_file(), p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    return p, report, out


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def result(report, name) -> dict:
    sec = report["sections"][name]
    assert sec["status"] == "ok", (name, sec.get("error"), sec.get("log_tail"))
    return sec["result"]


def test_every_section_runs_and_records_its_figures(smoke):
    p, r, out = smoke
    assert r["mode"] == "smoke" and list(r["sections"]) == SECTIONS
    for name in SECTIONS:
        assert not result(r, name)["partial"]
    assert r["skipped"] == []  # nothing left out for time
    assert r["failed"] == [] and r["ok"] is True and p.returncode == 0
    log = (out / "gpu_check.log").read_text()
    assert all(f"== {n}: ok" in log for n in SECTIONS)

    t = result(r, "trainer")
    assert t["ddp"]["wrapper"] == "DistributedDataParallel" and t["fsdp"]["wrapper"].startswith("FSDP")
    for mode in ("ddp", "fsdp"):
        for key in ("tokens_per_s", "step_s", "peak_memory_gib", "model_tflops", "mfu_vs_matmul"):
            assert number(t[mode][key]) and t[mode][key] > 0, (mode, key)
        assert len(t[mode]["losses"]) == 3 and all(number(x) and x > 0 for x in t[mode]["losses"])
    # FSDP2 (over gloo here) trains exactly as DDP: same init, same packs, same losses step by step
    assert t["fsdp"]["losses"] == pytest.approx(t["ddp"]["losses"], rel=1e-5)
    assert t["checks"] == {"losses_finite": True, "ddp_fsdp_equal_losses": True}

    a = result(r, "attention")
    eq = a["equality"]
    assert eq["documents"] == 3 and eq["tolerance"] == 1e-5
    for impl in ("ours", "flex", "sdpa"):  # outputs (and gradients) against the fp64 reference
        assert number(eq[impl]["out"]) and eq[impl]["out"] <= 1e-5, impl
    for impl in ("ours", "sdpa"):
        assert number(eq[impl]["grads"]) and eq[impl]["grads"] <= 1e-5, impl
    assert eq["flex"]["grads"] is None and "no CPU backward" in a["flex_backward"]  # the reason is recorded
    assert all(a["checks"].values()) and len(a["checks"]) == 3
    assert list(a["lengths"]) == ["128", "256"]
    for L, res in a["lengths"].items():
        for impl in ("ours", "flex", "sdpa"):
            assert number(res[impl]["fwd_ms"]) and res[impl]["fwd_ms"] > 0, (L, impl)
        assert number(res["ours"]["bwd_ms"]) and number(res["sdpa"]["bwd_ms"]) and res["flex"]["bwd_ms"] is None
        assert number(res["time_ratio_sdpa"]) and number(res["fwd_time_ratio_flex"])

    e = result(r, "extract")
    assert e["tokens"] > 0 and e["samples"] == 12
    for key in ("tokens_per_s", "bare_tokens_per_s", "throughput_ratio", "bytes_per_token"):
        assert number(e[key]) and e[key] > 0, key
    assert 1.0 <= e["bytes_ratio"] < 1.05  # bf16 storage: 4 states x H x 2 bytes, plus headers
    assert e["aux_rel_err"] <= 5e-3 and e["checks"] == {"stored_states_equal_forward": True}

    v = result(r, "evaluator")
    assert v["rotary"]["draft_dtype"] == "bfloat16" and number(v["rotary"]["max_abs_diff"])
    assert v["lossless_random"]["lossless"] is True or all(f["near_tie"] for f in v["lossless_random"]["failures"])
    tau = v["tau_vs_fp32_cpu"]
    assert tau["tau_bf16"] == tau["tau_fp32_cpu"] > 1.0 and tau["same_outputs"] == tau["of"] == 3
    assert tau["per_position_bf16"] == tau["per_position_fp32_cpu"]
    assert tau["lossless_bf16"] is True and tau["lossless_fp32"] is True
    assert v["checks"] == {"rotary_tables_fp32": True, "lossless_random_target": True, "tau_equals_fp32_cpu": True,
                           "decisive_tau_above_1": True}

    g = result(r, "gpu_tests")  # on the CPU every gpu test skips, saying why
    assert "tests/integration/test_train_gpu.py" in g["files"] and g["returncode"] == 0
    assert g["skipped"] == len(g["cases"]) >= 2 and g["failure"] == g["error"] == g["passed"] == 0
    assert all(c["message"] == "needs a CUDA device" for c in g["cases"])
    assert g["checks"] == {"gpu_tests_pass": True}


def test_evaluator_keeps_the_draft_rotary_tables_fp32(smoke):
    """The draft the evaluator runs in bf16 computes cos/sin from an fp32 inv_freq: its tables equal the
    fp32 draft's up to bf16 rounding (2^-9 at most) at every position below 8192 (a bf16 inv_freq: off by 2)."""
    v = result(smoke[1], "evaluator")
    assert v["rotary"]["inv_freq_dtype"] == "float32" and v["rotary"]["positions"] == 8192
    assert v["rotary"]["max_abs_diff"] <= 2**-8 and v["checks"]["rotary_tables_fp32"] is True
