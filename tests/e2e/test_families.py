"""Each supported family end to end on a tiny random model laid out exactly like its real checkpoint.

Llama-3.1, Qwen3 (padded embedding, thinking template) and Kimi-K2.5 (VLM wrapper around a
DeepSeek-V3 MLA + MoE text model, slow custom tiktoken tokenizer through auto_map) go through
`eagle3 run`: prepare -> extract (hf) -> verifier -> train -> eval, on real ShareGPT and MT-Bench,
on CPU. Checked against references that do not go through eagle3.model.target: golden masks, stored
aux/final states against transformers' own forward at vLLM's layer convention, verifier tensors
against the checkpoint's, an export sized by the embedding rows that reloads bitwise, a lossless
evaluation and an oracle draft's tau of exactly k+1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3.config import EvalConfig, ExtractConfig, PipelineConfig, PrepareConfig, TrainConfig
from eagle3.model.target import Target
from tests.helpers.families import FAMILIES, reference_lm

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")
CONV = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road?"}]
# family -> (end-of-turn token, template text before each answer that must stay untrained)
EOT = {"llama-3.1": ("<|eot_id|>", ["<|start_header_id|>assistant<|end_header_id|>\n\n"] * 2),
       "qwen3": ("<|im_end|>", ["<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"]),
       "kimi-k2.5": ("<|im_end|>", ["<|im_assistant|>assistant<|im_middle|><think></think>"] * 2)}
TRUST = {"kimi-k2.5": True}


def open_target(family_dirs, fam) -> Target:
    return Target.open(family_dirs[fam], trust_remote_code=TRUST.get(fam, False))


# ---------------------------------------------------------------- facts of each layout
@pytest.mark.parametrize("fam", FAMILIES)
def test_target_facts(family_dirs, fam):
    t = open_target(family_dirs, fam)
    tok = t.tokenizer()
    assert (t.num_layers, t.hidden_size) == (8, 64) and t.layer_ids() == [2, 4, 5, 8]
    rows, n_tok = t.vocab_rows, len(tok)
    if fam == "llama-3.1":
        assert rows == n_tok == 1024 + 256 and tok.is_fast and t.prefixes == ("model.", "")
        stops = {"<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"}
    elif fam == "qwen3":
        assert rows == 1152 > n_tok == 1050 and tok.is_fast and t.prefixes == ("model.", "")
        stops = {"<|im_end|>", "<|endoftext|>"}
    else:
        # the slow tiktoken tokenizer names 258 special ids; the embedding holds 256 of them
        assert n_tok == rows + 2 == 1024 + 258 and not tok.is_fast and not hasattr(tok, "backend_tokenizer")
        assert t.wrapped and t.model_type == "deepseek_v3" and t.is_mla
        assert t.prefixes == ("language_model.model.", "language_model.")
        stops = {"<|im_end|>", "[EOS]"}
    assert t.stop_ids() == {tok.convert_tokens_to_ids(s) for s in stops}
    names = t.weight_names()
    assert names["lm_head"] is not None and t.read(names["embed_tokens"]).shape == (rows, 64)


def test_custom_tokenizer_needs_the_flag_and_never_runs_modeling_code(family_dirs, tmp_path):
    from eagle3.cli import main

    with pytest.raises(ValueError, match="--trust-remote-code"):
        Target.open(family_dirs["kimi-k2.5"]).tokenizer()
    # The fixture's modeling/configuration modules raise on import; loading the tokenizer and the
    # text model with trust_remote_code never imports them.
    t = open_target(family_dirs, "kimi-k2.5")
    t.tokenizer()
    t.load_model(head=False, device="cpu")
    r = subprocess.run([sys.executable, "-m", "eagle3.cli", "prepare", "--model", str(family_dirs["kimi-k2.5"]),
                        "--data", "sharegpt", "--limit", "3", "--out", str(tmp_path / "p")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--trust-remote-code" in r.stderr, r.stderr
    assert main(["prepare", "--model", str(family_dirs["kimi-k2.5"]), "--data", "sharegpt", "--limit", "3",
                 "--max-len", "256", "--out", str(tmp_path / "p"), "--trust-remote-code"]) == 0


# ---------------------------------------------------------------- golden masks
@pytest.mark.parametrize("fam", FAMILIES)
def test_golden_masks(family_dirs, fam):
    """Trainable tokens are exactly each answer's own tokens plus the end-of-turn token; the template's
    markup around an answer (Qwen3's and Kimi's think tags included) is not trained."""
    from eagle3.data.template import ChatRenderer

    t = open_target(family_dirs, fam)
    tok = t.tokenizer()
    r = ChatRenderer(tok)
    rendered = r.render(CONV)
    ids, mask = r.encode([rendered], 10_000)[0]
    assert ids.tolist() == t.encode([rendered.text])[0]  # the ids the served target sees
    eot_str, before = EOT[fam]
    eot = tok.convert_tokens_to_ids(eot_str)
    cuts = np.nonzero(np.diff(np.r_[0, mask, 0]))[0].reshape(-1, 2)  # [start, end) of each trainable run
    answers = [CONV[1]["content"], CONV[3]["content"]]
    assert len(cuts) == 2
    for (a, b), ans, pre in zip(cuts, answers, before, strict=True):
        assert ids[a:b].tolist() == t.encode([ans])[0] + [eot]
        assert tok.decode(ids[a:b].tolist(), skip_special_tokens=False) == ans + eot_str
        head = tok.decode(ids[:a].tolist(), skip_special_tokens=False)
        assert head.endswith(pre), (head[-60:], pre)
    assert int(mask.sum()) == sum(len(t.encode([a])[0]) + 1 for a in answers)


# ---------------------------------------------------------------- the whole pipeline
def family_config(fam: str, model: Path, run_dir: Path) -> PipelineConfig:
    return PipelineConfig(
        model=str(model), run_dir=str(run_dir), trust_remote_code=TRUST.get(fam, False),
        prepare=PrepareConfig(data="sharegpt", limit=24, max_len=192, draft_vocab=384, val_fraction=0.25),
        extract=ExtractConfig(storage="fp32", batch_tokens=1024),
        train=TrainConfig(ttt_steps=3, max_steps=4, pack_tokens=192, warmup_steps=1, threads=1, val_every=2,
                          ckpt_every=2, lr=1e-3),
        eval=EvalConfig(prompts="mt-bench", limit=2, k=3, max_new_tokens=10, threads=1),
    )


def run_cli(cfg: PipelineConfig, tmp: Path) -> dict:
    """`eagle3 run --config FILE` in its own process (embedded Prefect, its own PREFECT_HOME)."""
    path = tmp / "config.json"
    path.write_text(cfg.model_dump_json())
    env = {**os.environ, "PREFECT_HOME": str(tmp / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "OMP_NUM_THREADS": "1"}
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(path)], capture_output=True,
                       text=True, cwd=REPO, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "tau (acceptance length) =" in r.stdout and "-m vllm.entrypoints.openai.api_server --model" in r.stdout
    return json.loads(r.stdout[: r.stdout.index("\ntau (acceptance length)")])


def run_flow(cfg: PipelineConfig) -> dict:
    from flows.pipeline import pipeline

    state = pipeline(cfg, return_state=True)
    assert state.is_completed(), state
    return state.result()


@pytest.mark.parametrize("fam", FAMILIES)
def test_family_end_to_end(family_dirs, fam, tmp_path, request):
    from eagle3.eval.decode import measure
    from eagle3.model.formats import WEIGHTS, load_draft
    from eagle3.storage.manifests import EvalReport, HiddenStates, PreparedData
    from eagle3.storage.store import open_store
    from eagle3.verifier import OUT_FILE
    from tests.helpers.drafts import Oracle

    model = family_dirs[fam]
    cfg = family_config(fam, model, tmp_path / "run")
    # Kimi goes through the real `eagle3 run` command; the others through the same flow in this process.
    if fam == "kimi-k2.5":
        d = run_cli(cfg, tmp_path)
    else:
        request.getfixturevalue("prefect_env")
        d = run_flow(cfg)
    t = open_target(family_dirs, fam)
    rows = t.vocab_rows

    prep = PreparedData.read(d["prepare"])
    assert prep.records_kept >= 16 and prep.vocab_map.target_vocab_size == rows

    # stored aux + final states == transformers' own forward, at vLLM's layer convention
    lm = reference_lm(model)
    hidden = HiddenStates.read(d["extract"])
    assert hidden.layer_ids == [2, 4, 5, 8]
    store = open_store(d["extract"])
    for i in range(0, len(store), max(1, len(store) // 4)):
        s = store[i]
        with torch.no_grad():
            o = lm(s["input_ids"][None].long(), output_hidden_states=True)
        for j, k in enumerate([2, 4, 5]):
            torch.testing.assert_close(s["aux_hidden_states"][:, j], o.hidden_states[k][0], atol=2e-5, rtol=1e-4)
        with torch.no_grad():  # id N is the pre-norm output: norm(id N) is HF's last entry, and gives its logits
            normed = lm.model.norm(s["final_hidden_states"])
            torch.testing.assert_close(normed, o.hidden_states[-1][0], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(lm.lm_head(normed), o.logits[0], atol=1e-4, rtol=1e-4)

    # verifier tensors == the checkpoint's
    v = load_file(str(Path(d["verifier"]) / OUT_FILE))
    sd = lm.state_dict()
    assert torch.equal(v["embed_tokens"].float(), sd["model.embed_tokens.weight"])
    assert torch.equal(v["norm"].float(), sd["model.norm.weight"])
    assert torch.equal(v["lm_head"].float(), sd["lm_head.weight"])
    tid = torch.arange(len(v["d2t"])) + v["d2t"]
    assert torch.equal(v["lm_head_draft"], v["lm_head"][tid]) and v["t2d"].shape == (rows,)

    # the export: sized by the embedding rows, reloads bitwise
    final = Path(d["final"])
    fc = json.loads((final / "config.json").read_text())
    assert fc["vocab_size"] == rows and fc["draft_vocab_size"] == 384
    assert fc["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and fc["architectures"] == ["LlamaForCausalLMEagle3"]
    saved = load_file(str(final / WEIGHTS))
    assert saved["t2d"].shape == (rows,) and saved["d2t"].dtype == torch.int64
    draft, fmt = load_draft(final, model, target_embedding=v["embed_tokens"])
    assert fmt == "vllm"
    state = draft.state_dict()
    for k, x in saved.items():
        assert torch.equal(state[k], x), k
    if t.is_mla:  # a Llama draft layer for an MLA target: 128-wide heads, plain RoPE at the target's theta
        assert fc["head_dim"] == 128 and fc["rope_scaling"] is None and fc["rope_theta"] == 50000.0

    # a lossless evaluation on MT-Bench, and an oracle draft accepted at every position
    r = EvalReport.read(d["eval"])
    assert r.lossless is True and r.num_prompts == 2 and 1.0 <= r.acceptance_length <= 4.0
    from eagle3.eval.prompts import load_prompts

    convs, _ = load_prompts("mt-bench", 1)
    tok, eos = t.tokenizer(), t.stop_ids()
    target_lm = t.load_model(head=True, device="cpu")
    o = measure(target_lm, tok, Oracle(target_lm), [2, 4, 5], convs, 3, 10, eos)
    assert o["lossless"] is True and o["acceptance_length"] == 4.0


@pytest.mark.parametrize("fam", FAMILIES)
def test_regenerate_with_each_family(family_dirs, fam, tmp_path):
    """The target answers in its own template and stops on its own end-of-turn ids (hf backend)."""
    from eagle3.config import RegenConfig
    from eagle3.regenerate.run import read_records, regenerate

    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": w}]}) + "\n"
                           for w in ("hello", "goodbye")))
    m = regenerate(family_dirs[fam], str(src), tmp_path / "out", RegenConfig(max_new_tokens=6),
                   trust_remote_code=TRUST.get(fam, False))
    recs = read_records(tmp_path / "out")
    assert m.records_written == 2 and len(recs) == 2
    assert all(r["messages"][1]["role"] == "assistant" for r in recs)


def test_quantized_checkpoint_is_refused_by_the_hf_backend(family_dirs, tmp_path):
    import shutil

    d = tmp_path / "kimi-int4"
    shutil.copytree(family_dirs["kimi-k2.5"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="compressed-tensors.*--backend vllm"):
        Target.open(d, trust_remote_code=True).load_model(head=False, device="cpu")
