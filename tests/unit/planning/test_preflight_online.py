"""Preflight in online mode: the spool instead of the store on disk, online recommended when only it fits, and
extract beside train (the longer side plus one window) instead of one after the other."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eagle3.config import PipelineConfig
from eagle3.planning import GIB, HEADROOM, hms, human, plan

EX = Path(__file__).resolve().parents[3] / "examples"
RAM = 1 << 40
PRESETS = ("kimi-k2.5", "qwen3-8b", "llama-3.1-8b")


def llama(**update) -> PipelineConfig:
    return PipelineConfig.from_file(EX / "llama-3.1-8b.yaml").model_copy(update=update)


def disk_rows(p) -> dict[str, float]:
    return {r.stage: r.bytes for r in p.rows if r.what == "disk"}


def test_an_offline_store_that_does_not_fit_recommends_online_first():
    p = plan(llama(), free_bytes=100 * GIB, free_mem=RAM)
    (msg,) = p.problems
    need = disk_rows(p)
    assert need["extract"] / GIB == pytest.approx(696.85, abs=0.01)
    # the spool online needs: the validation shard (~2% of the store, 13.91 GiB) plus two optimizer steps of 8
    # ranks x 8,192 tokens x 32,773 bytes (2.00 GiB each), rounded up to the MiB
    spool = 19227738112
    assert spool / GIB == pytest.approx(13.906 + 2 * 8 * 8192 * 32773 / GIB, abs=1e-3)
    online = (sum(need.values()) - need["extract"] + spool) * HEADROOM
    assert online / GIB == pytest.approx(44.86, abs=0.01)
    assert msg.startswith(f"disk: the remaining stages need about {human(sum(need.values()) * HEADROOM)} ")
    assert f"Options: mode: online with spool_bytes: {spool} (17.91 GiB; about {human(online)} in all" in msg
    assert msg.index("mode: online") < msg.index("storage 'fp8'") < msg.index("prepare.limit")


def test_no_online_recommendation_when_online_would_not_fit_either():
    (msg,) = plan(llama(), free_bytes=30 * GIB, free_mem=RAM).problems  # online needs ~44.86 GiB
    assert "mode: online" not in msg and "Options: storage 'fp8' (~50% of 'bf16')" in msg


def test_the_same_config_online_with_a_spool_that_fits_passes_the_disk_check():
    p = plan(llama(mode="online", spool_bytes=20 * GIB), free_bytes=100 * GIB, free_mem=RAM)
    assert not p.problems
    need = disk_rows(p)
    assert need["extract"] == 20 * GIB
    rows = {(r.stage, r.what): r for r in p.rows}
    total = rows[("all", "disk (x1.1 headroom) / free")].bytes
    assert total == pytest.approx(sum(need.values()) * HEADROOM) and total / GIB == pytest.approx(47.16, abs=0.01)
    store = rows[("extract", "offline store vs online spool")]
    assert store.bytes / GIB == pytest.approx(696.85, abs=0.01)
    assert store.human == "696.85 GiB offline store / 20.00 GiB spool (online)"
    assert "\nHidden states: 696.85 GiB offline store / 20.00 GiB spool (online)\n" in p.markdown()


def test_online_problems_name_the_spool():
    big = plan(llama(mode="online", spool_bytes=200 * GIB), free_bytes=100 * GIB, free_mem=RAM)
    (msg,) = big.problems
    assert msg.startswith("disk: the remaining stages need about 245.16 GiB")
    assert "Options: lower spool_bytes (now 200.00 GiB; the producer waits while the spool is full)" in msg
    small = plan(llama(mode="online", spool_bytes=4 * GIB), free_bytes=100 * GIB, free_mem=RAM)
    assert small.problems == ["spool: spool_bytes = 4.00 GiB cannot hold the validation shard plus two optimizer "
                              "steps' samples (17.91 GiB); raise spool_bytes, or lower train.val_max_packs, "
                              "train.pack_tokens or train.grad_accum"]


def test_online_wall_time_is_the_longer_side_plus_one_window_not_the_sum():
    off = plan(llama(), free_bytes=4 << 40, free_mem=RAM)
    on = plan(llama(mode="online", spool_bytes=20 * GIB), free_bytes=4 << 40, free_mem=RAM)
    ex, tr = on.seconds["extract"], on.seconds["train"]
    assert ex == pytest.approx(3 * off.seconds["extract"]) and tr == pytest.approx(off.seconds["train"])
    assert ex / 60 == pytest.approx(327.4, abs=0.1) and tr / 60 == pytest.approx(17.34, abs=0.1)
    store = 696.85 * GIB
    window = (20 - 13.906) * GIB / 2  # the spool's windows: half of what the val shard leaves
    assert on.pair_s == pytest.approx(max(ex, tr) + min(ex / 3, tr / 3) * window / store, rel=1e-4)
    others = sum(v for k, v in on.seconds.items() if k not in ("extract", "train"))
    assert on.total_seconds() == pytest.approx(others + on.pair_s)
    assert on.total_seconds() < sum(on.seconds.values()) - 15 * 60  # the ~16 min of training is hidden
    assert off.pair_s is None and off.total_seconds() == pytest.approx(sum(off.seconds.values()))
    assert on.time_line().startswith(f"estimated wall time ~{hms(on.total_seconds())} (prepare ")
    assert f"; online, extract and train overlap: {hms(on.pair_s)} together); no time budget" in on.time_line()
    # the time budget is judged on the pair: ~5h33m online, where the stages' sum is ~5h50m
    assert sum(on.seconds.values()) > 5.7 * 3600 > on.total_seconds()
    assert not plan(llama(mode="online", spool_bytes=20 * GIB), free_bytes=4 << 40, free_mem=RAM,
                    max_hours=5.7).problems


def test_online_extraction_repeats_as_many_epochs_as_max_steps_reaches():
    off = plan(llama(), free_bytes=4 << 40, free_mem=RAM).seconds["extract"]
    # ~22.4M train tokens / 8,192 per pack = 2,731 packs, 8 per step (8 ranks x 1): 342 steps per epoch
    for steps, epochs in ((1, 1), (342, 1), (343, 2), (1000, 3), (5000, 15)):
        cfg = llama(mode="online", spool_bytes=20 * GIB)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": steps})})
        assert plan(cfg, free_bytes=4 << 40, free_mem=RAM).seconds["extract"] == pytest.approx(epochs * off)


@pytest.mark.parametrize("name", PRESETS)
def test_each_gpu_preset_states_its_mode_and_its_store_fits_the_host(name):
    raw = yaml.safe_load((EX / f"{name}.yaml").read_text())
    assert raw["mode"] == "offline"
    cfg = PipelineConfig.from_file(EX / f"{name}.yaml")
    p = plan(cfg, free_bytes=4 << 40, free_mem=RAM)
    rows = {(r.stage, r.what): r for r in p.rows}
    assert not p.problems and rows[("all", "disk (x1.1 headroom) / free")].bytes < (4 << 40) / 4
    # the preset's comment: the data could grow ~4.8x (Kimi) / ~5.3x (8B) before the store outgrows 4 TiB
    fixed = sum(b for s, b in disk_rows(p).items() if s not in ("prepare", "extract"))
    grow = ((4 << 40) / HEADROOM - fixed) / (disk_rows(p)["prepare"] + disk_rows(p)["extract"])
    assert grow == pytest.approx(4.8 if name == "kimi-k2.5" else 5.3, abs=0.05)


@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3.1-8b"])
def test_online_would_be_slower_for_the_8b_presets(name):
    cfg = PipelineConfig.from_file(EX / f"{name}.yaml")
    off = plan(cfg, free_bytes=4 << 40, free_mem=RAM)
    on = plan(cfg.model_copy(update={"mode": "online", "spool_bytes": 20 * GIB}), free_bytes=4 << 40, free_mem=RAM)
    assert on.pair_s / 60 == pytest.approx(331, abs=4.0)  # 3 epochs of extraction on one GPU
    assert (off.seconds["extract"] + off.seconds["train"]) / 60 == pytest.approx(127, abs=1.0)


def test_kimi_online_would_share_gpus_that_have_no_room_for_the_trainer():
    cfg = PipelineConfig.from_file(EX / "kimi-k2.5.yaml")
    p = plan(cfg, free_bytes=4 << 40, free_mem=RAM)
    rows = {(r.stage, r.what): r for r in p.rows}
    act = rows[("train", "activation memory per rank (estimate)")].bytes
    engine = cfg.gpu_memory_gib * GIB * cfg.extract.gpu_memory_utilization  # vLLM's share of each of the 8 GPUs
    assert act / GIB == pytest.approx(40.06, abs=0.01) and engine + act > cfg.gpu_memory_gib * GIB
    assert rows[("extract", "offline store vs online spool")].human == \
        "762.43 GiB offline store / 4.00 GiB spool (offline)"
