"""Draft vocab: counted over loss-masked tokens only; d2t/t2d consistent as vLLM reads them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3.data.vocab import build_maps, check_maps, load_maps, save_maps, select_draft_tokens


def test_top_k_by_count_ties_by_id():
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 2], dtype=np.int64)
    assert select_draft_tokens(counts, 4).tolist() == [0, 2, 3, 5]
    # the 7th slot: the unseen token with the lowest id
    assert select_draft_tokens(counts, 7).tolist() == [0, 1, 2, 3, 4, 5, 7]
    # 7 slots: seen tokens 2,5 (9), 0,3 (5), 7 (2), 4 (1), then the unseen with the lowest id (1).


def test_ties_among_unseen_fill_by_lowest_id():
    counts = np.array([0, 0, 3, 0], dtype=np.int64)
    assert select_draft_tokens(counts, 2).tolist() == [0, 2]


@pytest.mark.parametrize("V,k,seed", [(50, 10, 0), (1000, 1000, 1), (49152, 8192, 2)])
def test_maps_consistent(V, k, seed, tmp_path):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 100, V)
    ids = select_draft_tokens(counts, k)
    d2t, t2d = build_maps(ids, V)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    i = torch.arange(k)
    assert bool(t2d[i + d2t].all())                      # t2d[i + d2t[i]] for every draft index
    assert int(t2d.sum()) == k
    assert torch.equal(i + d2t, torch.as_tensor(ids))   # target = draft + d2t[draft]
    assert bool((d2t >= 0).all()) and bool((d2t[1:] >= d2t[:-1]).all())
    save_maps(tmp_path / "v.safetensors", d2t, t2d)
    d2, t2 = load_maps(tmp_path / "v.safetensors")
    assert torch.equal(d2, d2t) and torch.equal(t2, t2d)


def test_mismatched_maps_are_rejected():
    d2t, t2d = build_maps(np.array([1, 4, 7]), 10)
    bad = t2d.clone()
    bad[4] = False
    bad[5] = True
    with pytest.raises(ValueError, match="disagree"):
        check_maps(d2t, bad)
    with pytest.raises(ValueError, match="entries"):
        check_maps(d2t[:2], t2d)
    with pytest.raises(ValueError, match="int64"):
        check_maps(d2t.int(), t2d)
