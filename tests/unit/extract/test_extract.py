"""Stage 2 (hf backend + store): layer parity with HF, batching, validation, store format, reuse."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.config import ExtractConfig
from eagle3.extract import run_extract
from eagle3.extract.hf import HFBackend
from eagle3.model.capture import batches_by_length
from eagle3.model.target import Target, check_aux_ids, default_aux_ids
from eagle3.storage.hashing import sha256_file
from eagle3.storage.manifests import HiddenStates
from eagle3.storage.store import FP8_MAX, bytes_per_token, dequantize_fp8, open_store, quantize_fp8, shard_meta
from tests.helpers.extract_helpers import chat_samples, random_samples, write_prepared


def _reference(lm, ids: list[int]):
    """HF's own forward of one sample: (hidden_states tuple of [T, H], logits [T, V]) in fp32."""
    with torch.no_grad():
        o = lm(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in o.hidden_states], o.logits[0]


def _logits_from_final(lm, final: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm.lm_head(lm.model.norm(final.float()))


# ---------------------------------------------------------------- layer ids
def test_layer_ids_follow_vllm_convention(smollm2_dir, tiny_llama_dir):
    assert default_aux_ids(30) == [2, 15, 27]  # vLLM's default for a 30-layer target (SmolLM2)
    assert Target.open(smollm2_dir).layer_ids() == [2, 15, 27, 30]
    tiny = Target.open(tiny_llama_dir)
    assert tiny.layer_ids([0, 1, 5]) == [0, 1, 5, 6]
    with pytest.raises(ValueError, match="in \\[0, 6\\)"):
        tiny.layer_ids([1, 2, 6])  # id N is added automatically, not an aux id
    with pytest.raises(ValueError, match="exactly 3"):
        ExtractConfig(aux_layer_ids=[1, 2])


@pytest.mark.parametrize("aux", [[15, 2, 27], [2, 2, 27], [2, 27, 15]])
def test_aux_ids_must_be_strictly_increasing(aux):
    # vLLM feeds fc the aux states in layer order whatever order a config lists; an unsorted
    # list would silently swap fc's input blocks between training and serving.
    from eagle3.model.draft import DraftConfig

    with pytest.raises(ValueError, match="strictly increasing"):
        check_aux_ids(aux, 30)
    with pytest.raises(ValueError, match="strictly increasing"):
        ExtractConfig(aux_layer_ids=aux)
    with pytest.raises(ValueError, match="strictly increasing"):
        DraftConfig(hidden_size=64, target_hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                    vocab_size=100, draft_vocab_size=10, aux_layer_ids=aux)


def test_batches_by_length_respects_budget():
    lengths = [5, 17, 33, 9, 33, 1]
    groups = batches_by_length(lengths, 66)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 66
    assert groups[0] == [2, 4]  # longest first, ties in input order
    assert batches_by_length([100, 3], 10) == [[0], [1]]  # over-budget sample alone


# ---------------------------------------------------------------- parity: tiny random Llama
def test_tiny_llama_parity_fp32(tiny_llama_dir, tmp_path):
    rows = random_samples(1000, [5, 17, 33, 9, 40, 2], seed=1)
    prep = tmp_path / "prep"
    write_prepared(prep, {"train": rows[:4], "val": rows[4:]})
    # batch_tokens=70 forces batches of 2 with right padding.
    cfg = ExtractConfig(storage="fp32", batch_tokens=70, aux_layer_ids=[0, 3, 5])
    man = run_extract(tiny_llama_dir, prep, tmp_path / "out", cfg, show_progress=False)
    assert man.layer_ids == [0, 3, 5, 6] and man.hidden_size == 64 and man.num_samples == 6
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    store = open_store(tmp_path / "out")
    assert len(store) == 6 and len(open_store(tmp_path / "out", "val")) == 2
    for (ids, mask), s in zip(rows, store, strict=True):
        hs, logits = _reference(lm, ids)
        assert s["input_ids"].tolist() == ids and s["loss_mask"].tolist() == mask
        assert s["aux_hidden_states"].shape == (len(ids), 3, 64) and s["final_hidden_states"].shape == (len(ids), 64)
        for j, k in enumerate([0, 3, 5]):
            torch.testing.assert_close(s["aux_hidden_states"][:, j], hs[k], atol=1e-5, rtol=1e-5)
        # id N is pre-norm: HF's last hidden_states entry is norm(id N), not id N.
        assert not torch.allclose(s["final_hidden_states"], hs[-1], atol=1e-3)
        torch.testing.assert_close(lm.model.norm(s["final_hidden_states"]), hs[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_logits_from_final(lm, s["final_hidden_states"]), logits, atol=1e-4, rtol=0)


def test_bf16_compute_is_fp32_to_bf16_rounding_and_never_mixed_with_it(tiny_llama_dir, tmp_path):
    rows = random_samples(1000, [5, 17, 33, 9, 40, 2], seed=1)
    prep = tmp_path / "prep"
    write_prepared(prep, {"train": rows[:4], "val": rows[4:]})
    fp32 = ExtractConfig(storage="fp32", aux_layer_ids=[0, 3, 5])  # fp32 storage: the computed values as they are
    bf16 = fp32.model_copy(update={"dtype": "bfloat16"})
    m32 = run_extract(tiny_llama_dir, prep, tmp_path / "fp32", fp32, show_progress=False)
    m16 = run_extract(tiny_llama_dir, prep, tmp_path / "bf16", bf16, show_progress=False)
    assert (m32.inputs["dtype"], m16.inputs["dtype"]) == ("float32", "bfloat16")
    for a, b in zip(open_store(tmp_path / "fp32"), open_store(tmp_path / "bf16"), strict=True):
        for key in ("aux_hidden_states", "final_hidden_states"):
            x, y = a[key], b[key]
            assert torch.equal(y, y.bfloat16().float())  # computed in bf16
            rel = ((x - y).norm() / x.norm()).item()
            assert 1e-4 < rel < 0.02, (key, rel)  # bf16 rounding (2^-9 relative) through 6 layers, not more
    # a float32 run does not reuse the bf16 store's samples, and in the bf16 dir keeps none of its shards
    m = run_extract(tiny_llama_dir, prep, tmp_path / "c", fp32, reuse=[tmp_path / "bf16"], show_progress=False)
    assert m.stats["samples_reused"] == 0
    m = run_extract(tiny_llama_dir, prep, tmp_path / "bf16", fp32, show_progress=False)
    assert m.stats["shards_skipped"] == 0 and m.fingerprint == m32.fingerprint
    for a, b in zip(open_store(tmp_path / "fp32"), open_store(tmp_path / "bf16"), strict=True):
        assert torch.equal(a["aux_hidden_states"], b["aux_hidden_states"])


def test_final_layer_check_refuses_the_layer_before(smollm2_dir, tmp_path, monkeypatch):
    """A backend that catches layer N - 1 where the store says N (an off-by-one on the last id: every shape right)
    is refused by the final-layer check on SmolLM2, naming the layer, and leaves no shard; the same run with the
    right layer passes."""
    import eagle3.extract.hf as eh

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    write_prepared(tmp_path / "prep", {"train": chat_samples(tok, 6)})
    real = eh.catch
    monkeypatch.setattr(eh, "catch", lambda model, ids: real(model, [*ids[:-1], ids[-1] - 1]))
    with pytest.raises(ValueError, match=r"stored final state \(layer id 30, .*\) reproduces the target's own next "
                                         r"token at \d+ of \d+ decisive positions .*transformers' own forward"):
        run_extract(smollm2_dir, tmp_path / "prep", tmp_path / "out", ExtractConfig(), show_progress=False)
    assert not list((tmp_path / "out").glob("shards/*.safetensors"))
    monkeypatch.setattr(eh, "catch", real)
    man = run_extract(smollm2_dir, tmp_path / "prep", tmp_path / "out", ExtractConfig(), show_progress=False)
    assert man.stats["final_check"]["passed"] is True


def test_batched_equals_unbatched(tiny_llama_dir):
    model = Target.open(tiny_llama_dir).load_model(head=False, device="cpu")
    samples = [(f"s{i}", torch.tensor(ids)) for i, (ids, _) in enumerate(random_samples(1000, [7, 30, 12, 30, 3], 2))]
    batched = {sid: h for sid, _, h in HFBackend(model, [1, 2, 3, 6], batch_tokens=10_000).extract(samples)}
    single = {sid: h for sid, _, h in HFBackend(model, [1, 2, 3, 6], batch_tokens=1).extract(samples)}
    assert batched.keys() == single.keys() and len(batched) == 5
    for sid in single:
        assert batched[sid].shape == single[sid].shape
        torch.testing.assert_close(batched[sid], single[sid], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- parity: real SmolLM2, every storage choice
@pytest.mark.slow
def test_smollm2_parity_and_storage(smollm2_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    rows = chat_samples(tok, 8, repeat=2)  # ~8 x 90 real chat tokens
    prep = tmp_path / "prep"
    write_prepared(prep, {"train": rows})
    backend = HFBackend(Target.open(smollm2_dir).load_model(head=False, device="cpu"), [2, 15, 27, 30],
                        batch_tokens=4096)
    lm = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    refs = [_reference(lm, ids) for ids, _ in rows]
    agree, checks = {}, {}
    for storage in ["fp32", "bf16", "fp8-aux", "fp8"]:
        out = tmp_path / storage
        man = run_extract(smollm2_dir, prep, out, ExtractConfig(storage=storage), backend=backend, show_progress=False)
        assert man.aux_layer_ids == [2, 15, 27]
        c = man.stats["final_check"]  # a trained model: most positions are decisive, fp8's rounding included
        assert c["passed"] and c["decisive"] >= 0.5 * c["positions"], (storage, c)
        checks[storage] = c
        hit = total = 0
        for (hs, logits), s in zip(refs, open_store(out), strict=True):
            if storage == "fp32":
                # extraction's linears run on oneDNN-prepacked weights, the reference on stock F.linear:
                # rounding differences build up over 27 layers to ~2e-4 here (bf16 storage rounds at ~4e-3)
                for j, k in enumerate([2, 15, 27]):
                    torch.testing.assert_close(s["aux_hidden_states"][:, j], hs[k], atol=1e-3, rtol=1e-3)
                # logits of magnitude ~10-30: up to 1.2e-4 apart; the argmax agrees on every token (below)
                torch.testing.assert_close(_logits_from_final(lm, s["final_hidden_states"]), logits, atol=1e-3, rtol=0)
            pred = _logits_from_final(lm, s["final_hidden_states"]).argmax(-1)
            hit += (pred == logits.argmax(-1)).sum().item()
            total += len(pred)
        agree[storage] = hit / total
        # bytes on disk: exactly the per-token budget plus one small safetensors header per shard
        per_tok = bytes_per_token(3, 576, storage)
        assert man.num_tokens * per_tok <= man.num_bytes <= man.num_tokens * per_tok + 64 * 1024 * len(man.shards)
    print("argmax agreement by storage:", agree, "final-layer check:", {k: (c["agree"], c["decisive"])
                                                                          for k, c in checks.items()})
    assert total > 600
    assert agree["fp32"] == 1.0
    assert agree["bf16"] >= 0.995 and agree["fp8-aux"] == agree["bf16"]  # fp8-aux keeps final in bf16
    assert agree["fp8"] < 1.0  # fp8 on the final state does cost agreement (96.8% on ShareGPT)


# ---------------------------------------------------------------- fp8
def test_fp8_per_token_scale_roundtrip():
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50).view(50, 1, 1)  # 6 decades across tokens
    x[7, 1, 5] = 900.0  # an outlier channel only scales its own token/layer vector
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (50, 3)
    y = dequantize_fp8(q, s)
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 near amax; subnormals bounded by amax * 2^-9 / 448 * 448
    assert ((y - x).abs() <= x.abs() * 2**-4 + amax * 2**-9).all()
    torch.testing.assert_close(y.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # amax -> 448 exactly
    assert q.float().abs().max().item() == FP8_MAX


# ---------------------------------------------------------------- validation
class _BadBackend:
    """Wraps a real backend and corrupts one sample the way real bugs do."""

    name = "bad"

    def __init__(self, inner, victim: str, how: str):
        self.inner, self.victim, self.how = inner, victim, how

    def extract(self, samples, on_tokens=None):
        for sid, tok, h in self.inner.extract(samples, on_tokens):
            if sid == self.victim:
                if self.how == "nan":
                    h = h.clone()
                    h[3, 1, 7] = float("nan")
                elif self.how == "one_layer":  # the collective_rpc story: 1 of 4 layers kept
                    h = h[:, :1]
                elif self.how == "tokens":
                    tok = tok.clone()
                    tok[0] += 1
                elif self.how == "short":  # prefix caching on: dumped states come out short
                    h = h[1:]
            yield sid, tok, h


@pytest.mark.parametrize(
    "how,msg",
    [("nan", "non-finite"), ("one_layer", "4 layers"), ("tokens", "token ids"), ("short", r"\[T, H\]")],
)
def test_bad_sample_fails_its_shard_and_names_it(tiny_llama_dir, tmp_path, how, msg):
    rows = random_samples(1000, [12, 20, 8, 16], seed=3)
    prep = tmp_path / "prep"
    man_p = write_prepared(prep, {"train": rows})
    import pyarrow.parquet as pq

    victim = pq.read_table(prep / man_p.splits["train"][0].file)["sample_id"][2].as_py()
    inner = HFBackend(Target.open(tiny_llama_dir).load_model(head=False, device="cpu"), [1, 2, 3, 6])
    # one shard per sample: only the victim's shard may fail
    cfg = ExtractConfig(aux_layer_ids=[1, 2, 3], shard_bytes=1 << 16)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=f"sample {victim}.*{msg}|{msg}.*sample {victim}") as e:
        run_extract(tiny_llama_dir, prep, out, cfg, backend=_BadBackend(inner, victim, how), show_progress=False)
    assert victim in str(e.value)
    assert not (out / "manifest.json").exists()
    assert not list((out / "shards").glob(".*.tmp"))  # no half-written shard left


# ---------------------------------------------------------------- store format
def test_store_shards_index_checksums_and_mmap(tiny_llama_dir, tmp_path):
    rows = random_samples(1000, [50] * 12, seed=4)
    prep = tmp_path / "prep"
    write_prepared(prep, {"train": rows[:9], "val": rows[9:]})
    per_tok = bytes_per_token(3, 64, "bf16")
    assert per_tok == 4 + 1 + 4 * 64 * 2
    cfg = ExtractConfig(aux_layer_ids=[1, 2, 3], shard_bytes=3 * 50 * per_tok)  # 3 samples a shard
    man = run_extract(tiny_llama_dir, prep, tmp_path / "out", cfg, show_progress=False)
    assert [s.num_samples for s in man.shards] == [3, 3, 3, 3]
    assert [s.split for s in man.shards] == ["train"] * 3 + ["val"]
    assert man.splits == {"train": {"num_samples": 9, "num_tokens": 450}, "val": {"num_samples": 3, "num_tokens": 150}}
    for s in man.shards:
        assert sha256_file(tmp_path / "out" / s.file) == s.sha256
        assert shard_meta(tmp_path / "out" / s.file)["lengths"] == [50, 50, 50]
    assert sha256_file(tmp_path / "out" / "index.parquet") == man.index_sha256
    # the per-token budget exactly, plus one small header (sample ids) per shard
    assert man.num_tokens * per_tok < man.num_bytes < man.num_tokens * per_tok + 1024 * len(man.shards)
    assert HiddenStates.read(tmp_path / "out").fingerprint == man.fingerprint
    store = open_store(tmp_path / "out")
    a, b = store[4], store[4]
    # memory-mapped views: two reads share the same memory, and no copy of the shard is made
    assert a["aux_hidden_states"].dtype == torch.bfloat16
    assert a["aux_hidden_states"].data_ptr() == b["aux_hidden_states"].data_ptr()
    assert a["final_hidden_states"].untyped_storage().nbytes() == (tmp_path / "out" / man.shards[1].file).stat().st_size
    assert store.find(a["sample_id"]) == 4
    assert store[-1]["sample_id"] == store.sample_ids[11]


def test_finished_run_is_returned_without_recompute(tiny_llama_dir, tmp_path):
    prep = tmp_path / "prep"
    write_prepared(prep, {"train": random_samples(1000, [10, 11], seed=5)})
    cfg = ExtractConfig(aux_layer_ids=[1, 2, 3])
    m1 = run_extract(tiny_llama_dir, prep, tmp_path / "out", cfg, show_progress=False)

    class NoBackend:
        name = "none"

        def extract(self, samples, on_tokens=None):
            raise AssertionError("a finished extract dir must not be recomputed")

    m2 = run_extract(tiny_llama_dir, prep, tmp_path / "out", cfg, backend=NoBackend(), show_progress=False)
    assert m2.fingerprint == m1.fingerprint and m2.created_at == m1.created_at


# ---------------------------------------------------------------- incremental reuse
def test_incremental_run_extracts_only_new_samples(tiny_llama_dir, tmp_path):
    rows = random_samples(1000, [20 + (i % 7) for i in range(21)], seed=6)
    p1, p2 = tmp_path / "prep1", tmp_path / "prep2"
    write_prepared(p1, {"train": rows[:20]})
    write_prepared(p2, {"train": rows})  # the data grew by 5%
    cfg = ExtractConfig(aux_layer_ids=[1, 2, 3])
    m1 = run_extract(tiny_llama_dir, p1, tmp_path / "x1", cfg, show_progress=False)
    assert m1.stats["samples_computed"] == 20
    m2 = run_extract(tiny_llama_dir, p2, tmp_path / "x2", cfg, reuse=[tmp_path / "x1"], show_progress=False)
    assert m2.stats["samples_computed"] == 1 and m2.stats["samples_reused"] == 20
    assert m2.stats["tokens_computed"] == len(rows[20][0])
    s1, s2 = open_store(tmp_path / "x1"), open_store(tmp_path / "x2")
    for i in range(20):
        j = s2.find(s1.sample_ids[i])
        assert torch.equal(s1[i]["aux_hidden_states"], s2[j]["aux_hidden_states"])
        assert torch.equal(s1[i]["final_hidden_states"], s2[j]["final_hidden_states"])
    # a store of another storage format is not reused (its bytes would be the wrong format)
    m3 = run_extract(tiny_llama_dir, p2, tmp_path / "x3", ExtractConfig(aux_layer_ids=[1, 2, 3], storage="fp32"),
                     reuse=[tmp_path / "x1"], show_progress=False)
    assert m3.stats["samples_reused"] == 0 and m3.stats["samples_computed"] == 21
    assert json.loads((tmp_path / "x2" / "manifest.json").read_text())["inputs"]["prepared"] != m1.inputs["prepared"]


def test_in_place_rerun_on_grown_data_keeps_unchanged_shards(tiny_llama_dir, tmp_path):
    rows = random_samples(1000, [70] * 9, seed=8)
    prep = tmp_path / "prep"
    cfg = ExtractConfig(aux_layer_ids=[1, 2, 3], shard_bytes=2 * 70 * bytes_per_token(3, 64, "bf16"))  # 2 a shard
    write_prepared(prep, {"train": rows[:8]})
    m1 = run_extract(tiny_llama_dir, prep, tmp_path / "out", cfg, show_progress=False)
    assert len(m1.shards) == 4
    write_prepared(prep, {"train": rows})  # one more sample at the end: a 5th shard
    m2 = run_extract(tiny_llama_dir, prep, tmp_path / "out", cfg, show_progress=False)
    assert m2.stats["shards_skipped"] == 4 and m2.stats["samples_computed"] == 1
    assert [s.sha256 for s in m2.shards[:4]] == [s.sha256 for s in m1.shards]
    assert m2.inputs["prepared"] != m1.inputs["prepared"] and len(open_store(tmp_path / "out")) == 9
