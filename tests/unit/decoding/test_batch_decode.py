"""Buffered KV cache + grouped one-token attention == transformers' stock DynamicCache + SDPA."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from eagle3.decoding.batch_decode import ATTN, BufferLayer, buffer_cache, gqa_decoding
from eagle3.model.target import Target

pytestmark = pytest.mark.usefixtures("one_thread")


def _decode(model, cache, steps: int, drop_at: int) -> list[torch.Tensor]:
    """Left-padded batch of 3 prompts, greedy for `steps` steps; row 1 leaves the batch at step `drop_at`."""
    g = torch.Generator().manual_seed(0)
    lens = [9, 5, 7]
    L = max(lens)
    ids = torch.randint(0, 1000, (3, L), generator=g)
    mask = torch.zeros(3, L, dtype=torch.long)
    for r, n in enumerate(lens):
        mask[r, L - n :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = []
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
        last = pos[:, -1]
        for s in range(steps):
            out.append(logits)
            nxt = logits.argmax(-1)
            if s == drop_at:
                keep = torch.tensor([0, 2])
                cache.batch_select_indices(keep)
                mask, last, nxt = mask[keep], last[keep], nxt[keep]
            mask = torch.cat([mask, mask.new_ones(len(nxt), 1)], 1)
            last = last + 1
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1]
    return out


def test_buffered_grouped_decoding_equals_stock(tiny_llama_dir):
    model = Target.open(tiny_llama_dir).load_model(head=True, device="cpu")
    assert model.config.num_attention_heads != model.config.num_key_value_heads  # GQA: the grouped path runs
    ref = _decode(model, DynamicCache(config=model.config), 12, drop_at=4)
    cache = buffer_cache(model, reserve=10)  # smaller than prompt + 12 steps: the buffers grow mid-run
    with gqa_decoding(model):
        assert model.config._attn_implementation == ATTN
        got = _decode(model, cache, 12, drop_at=4)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert all(isinstance(layer, BufferLayer) for layer in cache.layers)
    assert (cache.get_seq_length() == 9 + 12 and cache.layers[0].kbuf.shape[2] >= 21
            and cache.layers[0].kbuf.shape[0] == 2)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert [int(x) for a in ref for x in a.argmax(-1)] == [int(x) for b in got for x in b.argmax(-1)]


def test_buffer_layer_crop():
    layer = BufferLayer(reserve=4)
    k = torch.arange(2 * 1 * 6 * 2, dtype=torch.float32).view(2, 1, 6, 2)
    layer.update(k[:, :, :3], k[:, :, :3])
    layer.update(k[:, :, 3:], k[:, :, 3:])  # grows past the reserve
    assert torch.equal(layer.keys, k) and layer.get_seq_length() == 6
    layer.crop(-2)
    assert torch.equal(layer.keys, k[:, :, :4]) and layer.get_seq_length() == 4


@pytest.mark.parametrize("keep", [[0, 2, 3], [1, 3], [0, 1, 2, 3], [3], [2, 0, 3], [1, 1, 2]])
def test_buffer_layer_select_rows(keep):
    """Finished rows leave: ascending rows compact in place (same buffer, no new allocation), any other
    selection gathers; either way the kept rows' K/V equal a gather of the original."""
    layer = BufferLayer(reserve=8)
    k = torch.randn(4, 2, 5, 3)
    v = torch.randn(4, 2, 5, 3)
    layer.update(k, v)
    ptr = layer.kbuf.data_ptr()
    layer.batch_select_indices(torch.tensor(keep))
    assert torch.equal(layer.keys, k[keep]) and torch.equal(layer.values, v[keep])
    assert layer.get_seq_length() == 5 and layer.kbuf.shape[0] == len(keep)
    assert (layer.kbuf.data_ptr() == ptr) == (keep == sorted(set(keep)))
    layer.update(k[keep][:, :, :2], v[keep][:, :, :2])  # decoding goes on in the compacted buffers
    assert torch.equal(layer.keys, torch.cat([k[keep], k[keep][:, :, :2]], 2))


def test_prefill_groups():
    from eagle3.decoding.generate import prefill_groups

    assert prefill_groups([402, 380, 300, 299, 120, 90, 42]) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert prefill_groups([9]) == [(0, 1)] and prefill_groups([5, 5, 4]) == [(0, 3)]
    assert prefill_groups([3, 10, 9, 2]) == [(0, 3), (3, 4)]  # a run's longest need not come first


def test_grouped_prefill_equals_one_padded_prefill(tiny_llama_dir):
    """Rows of very different lengths prefill in groups, each padded to its own longest, into one batch's
    buffers: the greedy answers equal the same batch prefilled as one padded forward, and each row alone."""
    from eagle3.config import RegenConfig
    from eagle3.decoding import generate as gen_mod
    from eagle3.decoding.generate import HFGenerator

    model = Target.open(tiny_llama_dir).load_model(head=True, device="cpu")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (41, 37, 23, 22, 9, 4)]
    assert len(gen_mod.prefill_groups([len(p) for p in prompts])) == 4

    def answers(batch: int, grouped: bool = True) -> list[list[int]]:
        gen = HFGenerator(model, {2}, RegenConfig(max_new_tokens=12, batch_size=batch, batch_tokens=1 << 20), 0)
        gen.grouped_prefill = grouped
        return [x.raw for x in gen.generate(prompts, [0] * len(prompts))]

    calls = []
    window = BufferLayer.window
    BufferLayer.window = lambda self, rows, start: calls.append(start) or window(self, rows, start)
    try:
        grouped = answers(len(prompts))
    finally:
        BufferLayer.window = window
    assert sorted(set(calls)) == [18, 32, 37]  # the three later groups written in place, from their own columns
    alone = answers(1)
    padded = answers(len(prompts), grouped=False)  # the whole batch as one padded forward
    assert grouped == padded == alone and all(len(a) == 12 for a in grouped)
