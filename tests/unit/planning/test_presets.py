"""Presets parse, and pass preflight on paper for the documented host; their documented figures hold."""
from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.config import PipelineConfig
from eagle3.planning import GIB, PreflightError, check, plan

EX = Path(__file__).resolve().parents[3] / "examples"
HOST = dict(free_bytes=4 << 40, free_mem=1 << 40)  # 4 TiB disk, plenty of RAM (documented in each preset)

# preset -> (hidden-state GiB, all-disk GiB with headroom, extract minutes, train minutes), as documented
DOCUMENTED = {
    "llama-3.1-8b": (697, 792, 109, 17),
    "qwen3-8b": (697, 791, 111, 16),
    "kimi-k2.5": (762, 888, 167, 23),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_gpu_preset_passes_preflight_with_documented_figures(name):
    cfg = PipelineConfig.from_file(EX / f"{name}.yaml")
    p = check(cfg, **HOST)
    rows = {(r.stage, r.what): r for r in p.rows}
    hid, total, ex_min, tr_min = DOCUMENTED[name]
    assert rows[("extract", "disk")].bytes / GIB == pytest.approx(hid, rel=0.02)
    assert rows[("all", "disk (x1.1 headroom) / free")].bytes / GIB == pytest.approx(total, rel=0.02)
    assert p.seconds["extract"] / 60 == pytest.approx(ex_min, rel=0.1)
    assert p.seconds["train"] / 60 == pytest.approx(tr_min, rel=0.1)
    assert cfg.extract.backend == "vllm" and cfg.eval.backend == "vllm"


def test_kimi_preset_specifics():
    cfg = PipelineConfig.from_file(EX / "kimi-k2.5.yaml")
    assert cfg.extract.tensor_parallel_size == 8
    assert cfg.extract.aux_layer_ids == [2, 30, 58] and cfg.target.num_hidden_layers == 61
    assert cfg.trust_remote_code is True  # its tokenizer is custom code
    assert cfg.train.draft_layer == "mla" and cfg.target.kv_lora_rank == 512  # the draft the field serves for it


def test_local_moe_target_is_planned_from_its_config(family_dirs):
    """A local Kimi-layout dir: the plan reads the wrapper's text config, counts routed + shared experts
    for the total and only the routed experts per token (+ shared) for the active parameters."""
    from eagle3.planning import target_plan

    cfg = PipelineConfig(model=str(family_dirs["kimi-k2.5"]), trust_remote_code=True)
    t = target_plan(cfg)
    assert (t.hidden_size, t.num_hidden_layers, t.vocab_size, t.head_dim) == (64, 8, 1280, 128)
    assert t.active_parameters is not None and t.active_parameters < t.num_parameters
    dense = target_plan(PipelineConfig(model=str(family_dirs["qwen3"])))
    assert dense.active_parameters is None and dense.vocab_size == 1152


def test_preflight_refuses_a_run_that_cannot_finish():
    cfg = PipelineConfig.from_file(EX / "llama-3.1-8b.yaml")
    with pytest.raises(PreflightError) as e:
        check(cfg, free_bytes=100 * GIB, free_mem=1 << 40)
    msg = str(e.value)
    assert "disk" in msg and "100.00 GiB" in msg and "fp8" in msg and "run_dir" in msg
    tight = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"tensor_parallel_size": 1}),
                                   "target": cfg.target.model_copy(update={"num_parameters": 70e9})})
    with pytest.raises(PreflightError, match="GPU memory"):
        check(tight, **HOST)


def test_demo_preset_fits_this_machine(smollm2_dir):
    cfg = PipelineConfig.from_file(EX / "smollm2-sharegpt.yaml")
    p = plan(cfg, free_bytes=20 * GIB, free_mem=20 * GIB)
    assert not p.problems and p.tokens > 0


def test_full_smollm2_preset_fits_a_dev_box_in_fp8_aux_only(smollm2_dir):
    # documented: ~36 GiB of hidden states in fp8-aux, ~40 GiB in all; bf16 (~64 GiB) would not fit 50 GiB
    cfg = PipelineConfig.from_file(EX / "smollm2-sharegpt-full.yaml")
    assert cfg.prepare.limit is None and cfg.extract.storage == "fp8-aux"
    p = check(cfg, free_bytes=50 * GIB, free_mem=20 * GIB)
    rows = {(r.stage, r.what): r for r in p.rows}
    assert rows[("extract", "disk")].bytes / GIB == pytest.approx(36, rel=0.03)
    assert rows[("all", "disk (x1.1 headroom) / free")].bytes / GIB == pytest.approx(40, rel=0.03)
    bf16 = cfg.model_copy(update={"extract": cfg.extract.model_copy(update={"storage": "bf16"})})
    with pytest.raises(PreflightError, match="disk"):
        check(bf16, free_bytes=50 * GIB, free_mem=20 * GIB)


def test_draft_layer_is_checked_against_the_target_before_the_run(family_dirs):
    """An MLA draft for a target without MLA is refused by the preflight, before any stage runs; so is a Llama-layer
    draft that vLLM's CPU engine would have to serve beside an MLA target (the eval would fail after training)."""
    from eagle3.config import EvalConfig, TrainConfig

    qwen = PipelineConfig(model=str(family_dirs["qwen3"]), train=TrainConfig(draft_layer="mla"))
    with pytest.raises(PreflightError, match="draft_layer mla needs an MLA target"):
        plan(qwen, free_bytes=HOST["free_bytes"], free_mem=HOST["free_mem"])
    kimi = PipelineConfig(model=str(family_dirs["kimi-k2.5"]), trust_remote_code=True,
                          eval=EvalConfig(backend="vllm"))
    p = plan(kimi, free_bytes=HOST["free_bytes"], free_mem=HOST["free_mem"])
    assert any("cannot serve a Llama-layer draft beside this MLA target" in x for x in p.problems)
    mla = kimi.model_copy(update={"train": TrainConfig(draft_layer="mla")})
    assert not any("Llama-layer" in x for x in plan(mla, free_bytes=HOST["free_bytes"],
                                                    free_mem=HOST["free_mem"]).problems)
