"""Stage 2, vllm backend: on CPU against a fake LLM that follows vLLM's contract; the real thing where present."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from extract_helpers import random_samples, write_prepared

import fake_vllm
from eagle3.config import ExtractConfig
from eagle3.extract import run_extract
from eagle3.store import open_store
from eagle3.extract.vllm import llm_kwargs


def test_llm_kwargs_follow_vllm_native_extraction(tmp_path):
    cfg = ExtractConfig(backend="vllm", tensor_parallel_size=4, pipeline_parallel_size=2,
                        gpu_memory_utilization=0.7, max_num_batched_tokens=8192)
    kw = llm_kwargs("/m", [2, 15, 27, 30], cfg, max_len=2048, storage_dir=tmp_path)
    assert kw["tensor_parallel_size"] == 4 and kw["pipeline_parallel_size"] == 2
    assert kw["gpu_memory_utilization"] == 0.7 and kw["max_num_batched_tokens"] == 8192
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["max_model_len"] == 2049
    assert kw["speculative_config"] == {
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}},
    }
    assert kw["kv_transfer_config"] == {
        "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    with pytest.raises(ValueError, match="max_num_batched_tokens=1000 is below the longest"):
        llm_kwargs("/m", [1, 2, 3, 4], cfg.model_copy(update={"max_num_batched_tokens": 1000}), 2048, tmp_path)


def _prep(tmp_path, seed=7):
    # two prompts share a 32-token prefix: with prefix caching on, the second dump would be short
    rows = random_samples(1000, [40, 23, 9, 33, 17], seed=seed)
    rows[3] = (rows[0][0][:32] + rows[3][0][:1], rows[3][1][:33])
    write_prepared(tmp_path / "prep", {"train": rows[:4], "val": rows[4:]})
    return rows


def test_vllm_backend_on_fake_equals_hf_backend(tiny_llama_dir, tmp_path, monkeypatch):
    fake_vllm.install(monkeypatch)
    rows = _prep(tmp_path)
    cfg = ExtractConfig(backend="vllm", aux_layer_ids=[1, 3, 5], tensor_parallel_size=2,
                        gpu_memory_utilization=0.5, max_num_batched_tokens=4096)
    man = run_extract(tiny_llama_dir, tmp_path / "prep", tmp_path / "v", cfg, show_progress=False)
    assert man.backend == "vllm" and man.layer_ids == [1, 3, 5, 6] and man.num_samples == 5
    (llm,) = fake_vllm.LLM.instances
    assert llm.kwargs["tensor_parallel_size"] == 2 and llm.kwargs["gpu_memory_utilization"] == 0.5
    assert llm.kwargs["max_num_batched_tokens"] == 4096 and llm.kwargs["enable_prefix_caching"] is False
    # every connector file and lock was deleted once converted, and the scratch dir with them
    assert not (tmp_path / "v" / ".vllm-hidden-states").exists()
    for t in llm._threads:
        t.join()

    ref = run_extract(tiny_llama_dir, tmp_path / "prep", tmp_path / "h",
                      ExtractConfig(aux_layer_ids=[1, 3, 5]), show_progress=False)
    v, h = open_store(tmp_path / "v"), open_store(tmp_path / "h")
    assert v.sample_ids == h.sample_ids
    for i, (ids, _) in enumerate(rows):
        a, b = v[i], h[i]
        assert a["input_ids"].tolist() == ids  # mapped back by request, not by the (shuffled) output order
        # both are fp32 forwards rounded once to bf16: equal up to one bf16 ulp of float noise
        torch.testing.assert_close(a["aux_hidden_states"].float(), b["aux_hidden_states"].float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(a["final_hidden_states"].float(), b["final_hidden_states"].float(), atol=1e-2, rtol=1e-2)
    assert [s.sha256 for s in man.shards] != [] and ref.num_tokens == man.num_tokens


def test_vllm_wrong_file_for_a_request_is_caught(tiny_llama_dir, tmp_path, monkeypatch):
    fake_vllm.install(monkeypatch)
    _prep(tmp_path)
    orig = fake_vllm.LLM.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        self.swap_paths = True  # the output of request 0 names request 1's file

    monkeypatch.setattr(fake_vllm.LLM, "__init__", init)
    cfg = ExtractConfig(backend="vllm", aux_layer_ids=[1, 3, 5])
    with pytest.raises(ValueError, match="saved token ids .* differ from its prompt"):
        run_extract(tiny_llama_dir, tmp_path / "prep", tmp_path / "v", cfg, show_progress=False)
    assert not (tmp_path / "v" / "manifest.json").exists()


def test_vllm_prefix_caching_short_dump_fails_the_shard(tiny_llama_dir, tmp_path, monkeypatch):
    """If the LLM were built with prefix caching on, the shared-prefix sample comes back short."""
    fake_vllm.install(monkeypatch)
    rows = _prep(tmp_path)
    import eagle3.extract.vllm as ev

    real = ev.llm_kwargs

    def with_prefix_caching(*a, **k):
        kw = real(*a, **k)
        del kw["enable_prefix_caching"]  # vLLM's default is on
        return kw

    monkeypatch.setattr(ev, "llm_kwargs", with_prefix_caching)
    from extract_helpers import sample_id

    victim = sample_id(*rows[3])
    with pytest.raises(ValueError, match=f"sample {victim}: expected \\[T, H\\] = \\[33, 64\\] per layer, got \\[1, 64\\]"):
        run_extract(tiny_llama_dir, tmp_path / "prep", tmp_path / "v",
                    ExtractConfig(backend="vllm", aux_layer_ids=[1, 3, 5]), show_progress=False)


def test_vllm_missing_is_a_clear_error(tiny_llama_dir, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    _prep(tmp_path)
    with pytest.raises(RuntimeError, match="--backend vllm needs vLLM"):
        run_extract(tiny_llama_dir, tmp_path / "prep", tmp_path / "v",
                    ExtractConfig(backend="vllm", aux_layer_ids=[1, 3, 5]), show_progress=False)


@pytest.mark.vllm
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(), reason="needs vLLM and a GPU"
)
def test_real_vllm_matches_hf_backend(smollm2_dir, tmp_path):
    """The real engine on SmolLM2: aux and final states agree with the hf backend (both bf16 on GPU)."""
    from extract_helpers import chat_samples
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    write_prepared(tmp_path / "prep", {"train": chat_samples(tok, 8, repeat=3)})
    cfg = ExtractConfig(backend="vllm", gpu_memory_utilization=0.3)
    v = run_extract(smollm2_dir, tmp_path / "prep", tmp_path / "v", cfg, show_progress=False)
    h = run_extract(smollm2_dir, tmp_path / "prep", tmp_path / "h", ExtractConfig(), show_progress=False)
    assert v.layer_ids == h.layer_ids == [2, 15, 27, 30]
    lm = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    sv, sh = open_store(tmp_path / "v"), open_store(tmp_path / "h")
    hit = total = 0
    for a, b in zip(sv, sh):
        assert torch.equal(a["input_ids"], b["input_ids"])
        for x, y in [(a["aux_hidden_states"], b["aux_hidden_states"]), (a["final_hidden_states"], b["final_hidden_states"])]:
            x, y = x.float(), y.float()
            # bf16 kernels differ (vLLM fused ops vs eager HF): relative error per token, not bitwise
            rel = (x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-6)
            assert rel.median() < 0.02, rel.median()
        with torch.no_grad():
            pa = lm.lm_head(lm.model.norm(a["final_hidden_states"].float())).argmax(-1)
            pb = lm.lm_head(lm.model.norm(b["final_hidden_states"].float())).argmax(-1)
        hit += (pa == pb).sum().item()
        total += len(pa)
    assert hit / total >= 0.97


@pytest.mark.parametrize("fam", ["llama-3.1", "qwen3", "kimi-k2.5"])
def test_vllm_backend_on_family_layouts(family_dirs, fam, tmp_path, monkeypatch):
    """The vllm backend on each family's layout (Kimi-K2.5: wrapper, MLA + MoE, custom tokenizer) stores
    what the hf backend stores; Kimi's engine is built with trust_remote_code, and fails without it."""
    fake_vllm.install(monkeypatch)
    model, trust = family_dirs[fam], fam == "kimi-k2.5"
    rows = random_samples(1000, [30, 12, 21], seed=3)
    write_prepared(tmp_path / "prep", {"train": rows})
    v = run_extract(model, tmp_path / "prep", tmp_path / "v", ExtractConfig(backend="vllm"), show_progress=False,
                    trust_remote_code=trust)
    (llm,) = fake_vllm.LLM.instances
    assert llm.kwargs["trust_remote_code"] is trust and v.layer_ids == [2, 4, 5, 8]
    h = run_extract(model, tmp_path / "prep", tmp_path / "h", ExtractConfig(), show_progress=False,
                    trust_remote_code=trust)
    assert h.layer_ids == v.layer_ids and h.num_tokens == v.num_tokens
    for a, b in zip(open_store(tmp_path / "v"), open_store(tmp_path / "h")):
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
        torch.testing.assert_close(a["aux_hidden_states"].float(), b["aux_hidden_states"].float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(a["final_hidden_states"].float(), b["final_hidden_states"].float(), atol=1e-2, rtol=1e-2)
    if trust:
        with pytest.raises(ValueError, match="trust_remote_code"):
            run_extract(model, tmp_path / "prep", tmp_path / "v2", ExtractConfig(backend="vllm"), show_progress=False)
