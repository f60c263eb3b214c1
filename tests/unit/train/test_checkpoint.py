"""Checkpoints hold no pickled object: state.pt is read with weights_only=True, the RNG round-trips
exactly through tensors, and a state.pt carrying a pickled object is refused in one line without
running it."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.storage.hashing import sha256_file
from eagle3.train import checkpoint as ckpt


class _RunsCode:
    """What a tampered state.pt carries: unpickling it calls os.system (a marker file proves it ran)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def tamper(d: Path, payload) -> None:
    """Replace d/state.pt with `payload` and fix meta.json's checksum, as anyone who can write the dir can."""
    torch.save(payload, d / "state.pt")
    meta = json.loads((d / "meta.json").read_text())
    meta["files"]["state.pt"] = sha256_file(d / "state.pt")
    (d / "meta.json").write_text(json.dumps(meta))


def test_rng_state_round_trips_exactly_as_tensors(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # a cached gaussian in Python's state, and in numpy's
    np.random.standard_normal()
    s = ckpt.rng_state()
    ckpt.save(tmp_path, "step-00000001", {"w": torch.zeros(2)}, {"rng": s, "pos": {"step": 1}}, {"step": 1})
    want = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    _, state, meta = ckpt.load(tmp_path / ckpt.CKPT_DIR / "step-00000001")
    assert meta["format"] == ckpt.FORMAT
    ckpt.set_rng_state(state["rng"])
    got = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    assert got == want


def test_optimizer_and_scheduler_state_load_with_weights_only(tmp_path):
    """What the trainer stores (AdamW + LambdaLR after a step) is plain data."""
    w = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    w.sum().backward()
    opt.step()
    sched.step()
    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": ckpt.rng_state(),
             "pos": {"epoch": 0, "epoch_step": 1, "step": 1}, "best": {"tau": -1.0, "step": -1}, "last_val": -1}
    ckpt.save(tmp_path, "step-00000001", {"w": w.detach()}, state, {"step": 1})
    _, back, _ = ckpt.load(tmp_path / ckpt.CKPT_DIR / "step-00000001")
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert back["scheduler"]["last_epoch"] == 1 and back["pos"]["step"] == 1


def test_saving_a_python_object_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match=r"state\['rng'\]\['numpy'\]: a numpy.ndarray"):
        ckpt.save(tmp_path, "step-00000001", {"w": torch.zeros(2)}, {"rng": {"numpy": np.zeros(3)}}, {})
    assert not (tmp_path / ckpt.CKPT_DIR / "step-00000001").exists()


def test_checkpoint_carrying_a_pickled_object_is_refused_and_never_run(tmp_path):
    d = ckpt.save(tmp_path, "step-00000001", {"w": torch.zeros(2)}, {"pos": {}}, {"step": 1})
    marker = tmp_path / "code-ran"
    tamper(d, {"pos": {}, "rng": _RunsCode(marker)})
    assert ckpt.problem(d) is None  # the checksums agree: only the loader can tell
    with pytest.raises(ValueError) as e:
        ckpt.load(d)
    msg = str(e.value)
    assert "\n" not in msg and f"{d / 'state.pt'}: refused, it carries pickled Python objects" in msg
    assert "posix.system" in msg and "weights_only=False" not in msg
    assert not marker.exists()


def test_older_format_checkpoint_is_named(tmp_path):
    d = ckpt.save(tmp_path, "step-00000001", {"w": torch.zeros(2)}, {"pos": {}}, {"step": 1})
    meta = json.loads((d / "meta.json").read_text())
    del meta["format"]
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"step-00000001: checkpoint format 1, this eagle3 reads format 2"):
        ckpt.load(d)

