"""The vLLM backend of eagle3 regenerate: on CPU against a fake that follows vLLM's contract; on a GPU for real."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from eagle3.config import RegenConfig
from eagle3.decoding.generate import Gen
from eagle3.regenerate.run import read_records, regenerate
from tests.helpers import fake_vllm_generate as fake
from tests.helpers.regen import check_equal_to_target, write_source

pytestmark = pytest.mark.usefixtures("one_thread")


def test_vllm_backend_equals_hf_backend_and_target_greedy(tmp_path, tiny_llama_dir, monkeypatch):
    fake.install(monkeypatch)
    src = write_source(tmp_path / "src.jsonl", 6)  # r0, r3 have two turns
    cfg = RegenConfig(backend="vllm", max_new_tokens=10, tensor_parallel_size=2, gpu_memory_utilization=0.5)
    m = regenerate(tiny_llama_dir, str(src), tmp_path / "vllm", cfg)
    (llm,) = fake.LLM.instances
    assert llm.kwargs == {"model": str(tiny_llama_dir), "tensor_parallel_size": 2, "dtype": "float32", "seed": 0,
                          "gpu_memory_utilization": 0.5, "max_model_len": 4096, "enable_prefix_caching": True,
                          "trust_remote_code": False}
    assert llm.calls == [6, 2]  # one generate call per wave: continuous batching inside vLLM
    assert (m.backend, m.settings["backend"], m.settings["dtype"]) == ("vllm", "vllm", "float32")  # auto on CPU
    assert (m.records_written, m.turns_written) == (6, 8)
    hf = regenerate(tiny_llama_dir, str(src), tmp_path / "hf", RegenConfig(max_new_tokens=10))
    assert ([r["messages"] for r in read_records(tmp_path / "vllm")]
            == [r["messages"] for r in read_records(tmp_path / "hf")])
    assert hf.settings["backend"] == "hf" and read_records(tmp_path / "vllm")[0]["provenance"]["key"] != \
        read_records(tmp_path / "hf")[0]["provenance"]["key"]  # another backend/dtype: never reused for the other
    assert check_equal_to_target(tiny_llama_dir, tmp_path / "vllm", 10) == 8


def test_vllm_outputs_stop_tokens_order_and_seeds(tiny_llama_dir, monkeypatch):
    from eagle3.regenerate.vllm import VllmGenerator

    fake.install(monkeypatch)
    eos = {2, 7}
    g = VllmGenerator(tiny_llama_dir, RegenConfig(backend="vllm", max_new_tokens=4, temperature=0.5, seed=3), 4096, eos)
    sp = g.params([11, 12])
    assert [(p.temperature, p.seed, p.max_tokens, sorted(p.stop_token_ids), p.detokenize) for p in sp] == \
        [(0.5, 11, 4, [2, 7], False), (0.5, 12, 4, [2, 7], False)]
    greedy = VllmGenerator(tiny_llama_dir, RegenConfig(backend="vllm"), 4096, eos).params([5])[0]
    assert (greedy.temperature, greedy.seed, greedy.top_p) == (0.0, None, 1.0)

    def out(rid, prompt, ids, reason):
        return SimpleNamespace(request_id=rid, prompt_token_ids=prompt,
                               outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason)])

    g.llm = SimpleNamespace(generate=lambda prompts, params, use_tqdm: [
        out("0", [1, 2], [5, 6, 7], "stop"),  # a kept (non-special) stop token is dropped
        out("1", [3], [5, 6], "stop"),  # eos already left out by vLLM
        out("2", [4], [8, 8, 8, 8], "length"),
    ])
    assert g.generate([[1, 2], [3], [4]], [0, 0, 0]) == [Gen([5, 6], "stop"), Gen([5, 6], "stop"),
                                                         Gen([8, 8, 8, 8], "length")]
    with pytest.raises(RuntimeError, match="answers another prompt"):
        g.generate([[3], [1, 2], [4]], [0, 0, 0])
    g.llm = SimpleNamespace(generate=lambda prompts, params, use_tqdm: [out("0", [1], [5], "abort")])
    with pytest.raises(RuntimeError, match="finish_reason='abort'"):
        g.generate([[1]], [0])


def test_stop_tokens_kept_or_not_by_vllm_give_the_same_file(tmp_path, tiny_llama_dir, monkeypatch):
    """A stop id the model really emits (set in generation_config): vLLM may return it or not; hf never does."""
    import shutil

    from eagle3.model.target import Target

    src = write_source(tmp_path / "src.jsonl", 3)
    regenerate(tiny_llama_dir, str(src), tmp_path / "probe", RegenConfig(max_new_tokens=6))
    tok = Target.open(tiny_llama_dir).tokenizer()
    answer = read_records(tmp_path / "probe")[0]["messages"][1]["content"]
    stop = tok(answer, add_special_tokens=False)["input_ids"][2]  # r0's third answer token
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    gc = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gc, "eos_token_id": [tok.eos_token_id, stop]}))

    fake.install(monkeypatch)
    files = {}
    for name, keep, cfg in (("hf", None, RegenConfig(max_new_tokens=6)),
                            ("keep", True, RegenConfig(backend="vllm", max_new_tokens=6)),
                            ("drop", False, RegenConfig(backend="vllm", max_new_tokens=6))):
        fake.LLM.keep_stop_token = keep
        regenerate(model, str(src), tmp_path / name, cfg)
        recs = read_records(tmp_path / name)
        files[name] = [r["messages"] for r in recs]
        assert recs[0]["provenance"]["turns"][0] == {"tokens": 2, "finish": "stop"}
    assert files["hf"] == files["keep"] == files["drop"]


@pytest.mark.vllm
def test_real_engine_regenerates_the_hf_greedy_answers(tmp_path, smollm2_dir, monkeypatch):
    """SmolLM2 on the real engine (fp32 on CPU, one generate call per wave, prefix caching on) writes the same
    conversations as the hf backend's batched greedy decoding, and as the fake engine does."""
    from tests.helpers.engine import ENGINE, engine_processes

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "messages": m}) + "\n" for i, m in enumerate([
        [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
         {"role": "user", "content": "And of Italy?"}, {"role": "assistant", "content": "Rome."}],
        [{"role": "user", "content": "Name a prime number above 10."}, {"role": "assistant", "content": "11"}],
        [{"role": "user", "content": "Write one sentence about the sea."}, {"role": "assistant", "content": "Blue."}],
    ])))
    cfg = RegenConfig(max_new_tokens=24)
    v = regenerate(smollm2_dir, str(src), tmp_path / "vllm",
                   cfg.model_copy(update={"backend": "vllm", "engine_args": ENGINE}))
    assert engine_processes() == []
    h = regenerate(smollm2_dir, str(src), tmp_path / "hf", cfg)
    assert (v.records_written, v.turns_written) == (h.records_written, h.turns_written) == (3, 4)
    assert v.settings["dtype"] == h.settings["dtype"] == "float32"
    msgs = [r["messages"] for r in read_records(tmp_path / "vllm")]
    assert msgs == [r["messages"] for r in read_records(tmp_path / "hf")]
    assert msgs[0][1]["content"] != "Paris."  # really regenerated
    fake.install(monkeypatch)
    regenerate(smollm2_dir, str(src), tmp_path / "fake", cfg.model_copy(update={"backend": "vllm"}))
    assert [r["messages"] for r in read_records(tmp_path / "fake")] == msgs
