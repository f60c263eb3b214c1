"""Eval stage: chain speculative decoding, tau, lossless, head loaders, prompts, the CLI."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle3.eval.decode import DraftProposer, Stats, TargetLM, measure, run_conversation, speculative_generate
from eagle3.eval.prompts import Conversation, load_prompts, read_jsonl_prompts
from eagle3.model.draft import Eagle3Draft
from eagle3.model.formats import load_draft
from eagle3.model.target import prompt_ids
from tests.helpers.drafts import Mixed, Oracle, random_draft, write_native, write_speculators

K = 3
MAX_NEW = 24


# ---------------------------------------------------------------- helpers
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def eos(tiny_llama_dir):
    from eagle3.model.target import Target

    return Target.open(tiny_llama_dir).stop_ids()


@pytest.fixture(scope="module")
def convs():
    return [
        Conversation("a", [{"role": "user", "content": "Name three colors."}]),
        Conversation("b", [{"role": "user", "content": "What is 2+2?"}], ["And 3+3?"]),
    ]


# ---------------------------------------------------------------- decoding
def test_oracle_gives_k_plus_1_and_always_wrong_gives_1(target, convs, eos):
    model, tok = target
    r = measure(model, tok, Oracle(model), (1, 3, 4), convs, K, MAX_NEW, eos)
    assert r["lossless"] is True
    assert r["acceptance_length"] == K + 1
    assert r["per_position_acceptance"] == [1.0] * K
    assert r["num_turns"] == 3 and r["generated_tokens"] == r["target_generated_tokens"] > 0
    w = measure(model, tok, Oracle(model, wrong=True), (1, 3, 4), convs, K, MAX_NEW, eos)
    assert w["lossless"] is True
    assert w["acceptance_length"] == 1.0
    assert w["per_position_acceptance"] == [0.0] * K and w["num_accepted_tokens"] == 0
    # Every wrong pass yields exactly one token (the target's own): one pass per token but the first.
    assert w["num_drafts"] == sum(t["tokens"] - 1 for it in w["items"] for t in it["turns"])
    # The oracle accepts k per pass, + 1 bonus: ceil((n - 1) / (k + 1)) passes for n tokens.
    assert r["num_drafts"] >= sum(-(-(t["tokens"] - 1) // (K + 1)) for it in r["items"] for t in it["turns"])


def test_random_draft_is_lossless_and_counts_match_vllm(target, tiny_llama_dir, convs, eos):
    model, tok = target
    d = random_draft(tiny_llama_dir)
    d.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    r = measure(model, tok, DraftProposer(d), d.config.aux_layer_ids, convs, K, MAX_NEW, eos)
    assert r["lossless"] is True
    assert 1.0 <= r["acceptance_length"] <= K + 1
    assert r["acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    assert sum(r["num_accepted_tokens_per_pos"]) == r["num_accepted_tokens"]
    assert r["num_draft_tokens"] == K * r["num_drafts"]


def test_packed_cpu_kernels_decode_as_stock(target, tiny_llama_dir, convs, eos):
    """Live eval runs on oneDNN-prepacked linears by default: same outputs, rounds and tau as torch's stock
    F.linear on this tiny target (fp32 rounding could only flip an exact near-tie); the kernels are reported."""
    model, tok = target
    d = random_draft(tiny_llama_dir)
    d.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    stock = measure(model, tok, DraftProposer(d), d.config.aux_layer_ids, convs, K, MAX_NEW, eos, cpu_linear=False)
    packed = measure(model, tok, DraftProposer(d), d.config.aux_layer_ids, convs, K, MAX_NEW, eos)
    assert stock["cpu_linear"] == {} and set(packed["cpu_linear"]) == {*map(str, range(1, K + 2)), f"{K + 2}+"}
    assert packed["lossless"] is True
    assert ([t["text"] for it in packed["items"] for t in it["turns"]]
            == [t["text"] for it in stock["items"] for t in it["turns"]])
    for key in ("acceptance_length", "num_drafts", "num_accepted_tokens_per_pos"):
        assert packed[key] == stock[key]
    from eagle3.decoding.cpu_linear import PackedLinear

    assert not any(isinstance(m, PackedLinear) for net in (model, d) for m in net.modules())  # restored


def test_draft_cache_equals_a_fresh_draft_over_the_whole_prefix(target, tiny_llama_dir):
    """After any mix of accepted/rejected rounds, the incremental draft (cache + crops) proposes
    what a fresh draft proposes from all verified states at once; tau counts exactly the accepted."""
    model, tok = target
    d = random_draft(tiny_llama_dir, seed=1)
    d.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    mixed = Mixed(model, d)
    prompt = prompt_ids(tok, [{"role": "user", "content": "Tell me a story about a cat."}])
    stats = Stats(K)
    out = speculative_generate(TargetLM(model, d.config.aux_layer_ids), mixed, prompt, K, 24, set(), stats)
    assert len(out) == 24
    assert stats.drafts == len(mixed.ns) and stats.accepted == sum(mixed.ns)
    assert stats.per_pos == [sum(n > i for n in mixed.ns) for i in range(K)]
    assert any(0 < n < K for n in mixed.ns) and any(n == K for n in mixed.ns)
    tgt = TargetLM(model, d.config.aux_layer_ids)
    for ids, mine in mixed.calls[1:]:
        tgt.reset()
        _, aux = tgt.forward(ids[:-1])  # states of t_0..t_{L-2}, no cache involved
        assert DraftProposer(d).propose(ids, aux, K) == mine


# ---------------------------------------------------------------- loaders
def _same(a: Eagle3Draft, b: Eagle3Draft, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        if k not in skip:
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def test_load_native_dirs_and_variants(target, tiny_llama_dir, tmp_path):
    model, _ = target
    emb = model.get_input_embeddings().weight
    d = random_draft(tiny_llama_dir, norm_before_fc=True, norm_output=False, norm_before_residual=True)
    # ours: no embed (the target's is used), d2t + t2d
    got, fmt = load_draft(write_native(d, tmp_path / "ours"), tiny_llama_dir, emb)
    assert fmt == "vllm" and got.config == d.config
    _same(got, d, skip={"embed_tokens.weight"})
    torch.testing.assert_close(got.embed_tokens.weight, emb, rtol=0, atol=0)
    # another tool: `model.` prefix, embed present, t2d only (d2t derived), pytorch_model.bin
    d.embed_tokens.weight.data.normal_()
    got, _ = load_draft(write_native(d, tmp_path / "other", prefix="model.", keep=("t2d",), embed=True,
                                     file="pytorch_model.bin"), tiny_llama_dir, emb)
    _same(got, d)
    # a broken dir names its file and what is missing
    bad = write_native(d, tmp_path / "bad")
    from safetensors.torch import load_file

    sd = load_file(bad / "model.safetensors")
    del sd["midlayer.self_attn.q_proj.weight"]
    save_file(sd, bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors.*midlayer\.self_attn\.q_proj\.weight"):
        load_draft(bad, tiny_llama_dir, emb)


def test_load_speculators_dir(target, tiny_llama_dir, tmp_path):
    model, tok = target
    emb = model.get_input_embeddings().weight
    d = random_draft(tiny_llama_dir, seed=3, norm_before_fc=True, norm_output=True, norm_before_residual=False)
    d.embed_tokens.weight.data.copy_(emb)
    for embed in (False, True):
        got, fmt = load_draft(write_speculators(d, tmp_path / f"spec{embed}", tiny_llama_dir, embed), tiny_llama_dir,
                              emb)
        assert fmt == "speculators" and got.config == d.config
        _same(got, d)
    # and it proposes what the original proposes
    prompt = prompt_ids(tok, [{"role": "user", "content": "Hello there"}])
    tgt = TargetLM(model, d.config.aux_layer_ids)
    tgt.reset()
    nxt, aux = tgt.forward(prompt)  # aux [T, 3, H]
    ids = prompt + [nxt[-1]]
    assert DraftProposer(got).propose(ids, aux, 5) == DraftProposer(d).propose(ids, aux, 5)


# ---------------------------------------------------------------- prompts
def test_mtbench_two_turns_second_sees_first_answer(target):
    _, tok = target
    convs, fp = load_prompts("mt-bench")
    assert len(convs) == 80 and all(c.turns == 2 for c in convs) and len(fp) == 64
    convs, _ = load_prompts("mt-bench", limit=3)
    assert len(convs) == 3
    c = convs[0]
    seen = []

    def fake_generate(prompt):
        seen.append(prompt)
        return tok("ANSWER-ONE", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    run_conversation(c, tok, fake_generate)
    assert len(seen) == 2
    first, second = (tok.decode(p) for p in seen)
    assert c.messages[0]["content"] in first and first.endswith("<|im_start|>assistant\n")
    assert second.startswith(first) and "ANSWER-ONE<|im_end|>" in second
    assert c.followups[0] in second and second.endswith("<|im_start|>assistant\n")


def test_jsonl_prompts_and_errors(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(
        json.dumps({"prompt": "hi"}) + "\n\n"
        + json.dumps({"id": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "q"},
                                               {"role": "assistant", "content": "reference"}]}) + "\n"
    )
    a, b = read_jsonl_prompts(p)
    assert a.messages == [{"role": "user", "content": "hi"}] and a.turns == 1
    assert b.id == "m" and [m["role"] for m in b.messages] == ["system", "user"]
    p.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no"}) + "\n")
    with pytest.raises(ValueError, match=r"p\.jsonl:2: needs a `prompt`"):
        read_jsonl_prompts(p)
    with pytest.raises(ValueError, match="not 'mt-bench'"):
        load_prompts(tmp_path / "missing.jsonl")


def test_prepared_val_split_prompts(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    from eagle3.config import PrepareConfig
    from eagle3.prepare import prepare

    data = tmp_path / "d.jsonl"
    data.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                 {"role": "assistant", "content": f"answer number {i}"}]}) + "\n"
        for i in range(6)
    ))
    prepare(tiny_llama_dir, tmp_path / "prep", PrepareConfig(data=str(data), val_fraction=0.5), progress=False)
    convs, fp = load_prompts(tmp_path / "prep")
    assert convs and len(fp) == 64
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for c in convs:
        q = tok.decode(c.ids).split("question ")[1].split("<|im_end|>")[0]
        assert c.ids == prompt_ids(tok, [{"role": "user", "content": f"question {q}"}])


# ---------------------------------------------------------------- CLI, report, manifest
def test_cli_eval_writes_report_png_manifest(target, tiny_llama_dir, tmp_path):
    from eagle3.cli import main
    from eagle3.storage.manifests import EvalReport

    model, _ = target
    d = random_draft(tiny_llama_dir, seed=4)
    draft = write_native(d, tmp_path / "final")
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "Say something."}) + "\n" + json.dumps({"prompt": "Count to five."}) + "\n")
    out = tmp_path / "eval"
    rc = main(["eval", "--model", str(tiny_llama_dir), "--draft", str(draft), "--prompts", str(p),
               "--k", "2", "--max-new-tokens", "8", "--threads", "1", "--out", str(out)])
    assert rc == 0
    r = json.loads((out / "report.json").read_text())
    for key in ("acceptance_length", "per_position_acceptance", "k", "num_prompts", "lossless",
                "tokens_per_second", "speedup_vs_target"):
        assert key in r
    assert r["k"] == 2 and r["num_prompts"] == 2 and r["lossless"] is True and r["lossless_failures"] == []
    assert len(r["per_position_acceptance"]) == 2 and r["tokens_per_second"] > 0 and r["speedup_vs_target"] > 0
    assert r["acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2
    m = EvalReport.read(out)
    assert m.acceptance_length == r["acceptance_length"] and m.lossless and m.draft_format == "vllm"
    assert set(m.inputs) == {"model", "draft", "prompts", "config"} and m.plot_file == "acceptance.png"
    assert m.config["k"] == 2 and m.config["threads"] == 1 and m.config["max_new_tokens"] == 8
    # a user error is one line, exit 2
    assert main(["eval", "--model", str(tiny_llama_dir), "--draft", str(tmp_path), "--prompts", str(p),
                 "--k", "2", "--out", str(tmp_path / "e2")]) == 2


def test_loads_what_our_exporter_writes(target, tiny_llama_dir, tmp_path):
    """The trainer's export (eagle3.model.formats.export), both formats, loads back bit for bit."""
    from eagle3.model.formats import export

    model, _ = target
    emb = model.get_input_embeddings().weight
    d = random_draft(tiny_llama_dir, seed=6, norm_before_fc=False, norm_output=True, norm_before_residual=True)
    d.embed_tokens.weight.data.copy_(emb)
    for fmt in ("vllm", "speculators"):
        out = export(d.state_dict(), d.config, 3, tmp_path / fmt, fmt=fmt, verifier=str(tiny_llama_dir))
        got, f = load_draft(out, tiny_llama_dir, emb)
        assert f == fmt and got.config == d.config
        _same(got, d)


def test_bf16_draft_keeps_fp32_rotary_tables(tiny_llama_dir):
    """On GPU the evaluator runs the draft in bf16; its RoPE tables must stay the fp32 ones (as vLLM's
    are). A plain `.to(bf16)` also casts `inv_freq` and moves the angles by radians at long distances."""
    import copy

    from eagle3.eval.run import cast_draft

    d = random_draft(tiny_llama_dir)
    pos = torch.tensor([[0, 1, 17, 1000, 4000]])
    x = torch.zeros(1, 5, d.config.head_dim)
    ref_cos, ref_sin = d.rope(x, pos)
    b = cast_draft(copy.deepcopy(d), "cpu", torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in b.parameters())
    assert b.d2t.dtype == torch.int64 and b.t2d.dtype == torch.bool
    cos, sin = b.rope(x.bfloat16(), pos)
    assert torch.equal(cos, ref_cos.bfloat16()) and torch.equal(sin, ref_sin.bfloat16())
    naive = copy.deepcopy(d).to(dtype=torch.bfloat16)
    bad_cos, _ = naive.rope(x.bfloat16(), pos)
    assert (bad_cos.float() - ref_cos).abs().max() > 0.1  # what the cast above avoids
