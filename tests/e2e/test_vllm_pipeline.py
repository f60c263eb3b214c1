"""The whole pipeline with `backend: vllm` on the real engine, then the head served as the pipeline says.

One `eagle3 run` (a real embedded Prefect server, the user's command) per target: SmolLM2, and the tiny
Kimi-K2.5 layout (VLM wrapper, MLA + MoE, slow custom tokenizer) with an MLA draft layer. Extract and eval
run on vLLM's CPU engine (regenerate too on SmolLM2), training under torchrun. The head is trained for 15 epochs on
the target's own answers to 24 questions, so it has learnt them and is accepted when asked them again.
Then the exact command the run prints under "serve it:" starts vLLM's OpenAI server with the trained
head; chat replies through the `openai` client must equal the target's own greedy answers, and the
server's /metrics must count accepted draft tokens. On Kimi-K2.5's layout the trained head also scores
in the hf evaluator exactly what vLLM's counters scored in the run, far above a random head of its kind.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

pytestmark = pytest.mark.vllm

ENGINE = {"enforce_eager": True}  # tests/helpers/engine.py: start in ~45 s instead of ~150 s


@pytest.fixture(scope="module", params=["smollm2", "kimi-k2.5"])
def vllm_run(request, smollm2_dir, family_dirs, tmp_path_factory):
    from tests.helpers.prefect_service import chat

    kimi = request.param == "kimi-k2.5"
    root = tmp_path_factory.mktemp("vllm-run")
    data = root / "chats.jsonl"
    data.write_text("\n".join(json.dumps(chat(i)) for i in range(24)))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}: what is {i} plus {i}?"}) + "\n" for i in (3, 7)))
    cfg = {
        "model": str(family_dirs["kimi-k2.5"] if kimi else smollm2_dir), "run_dir": str(root / "run"),
        "trust_remote_code": kimi,
        # Kimi-K2.5's answers come from the hf backend (regenerate on the engine is SmolLM2's run): one engine less
        "regenerate": {"backend": "hf" if kimi else "vllm", "max_new_tokens": 32,
                       "engine_args": {} if kimi else ENGINE},
        "prepare": {"data": str(data), "draft_vocab": 512, "val_fraction": 0.1},
        "extract": {"backend": "vllm", "engine_args": ENGINE},
        "train": {"ttt_steps": 3, "epochs": 15, "pack_tokens": 512, "lr": 3e-3, "warmup_steps": 5, "val_every": 1000,
                  "replay_prompts": 0, "draft_layer": "mla" if kimi else "llama"},
        "eval": {"backend": "vllm", "prompts": str(prompts), "k": 3, "max_new_tokens": 24, "engine_args": ENGINE},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PREFECT_HOME": str(root / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the user's path: an embedded server for this one run
    p = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--config", str(root / "run.yaml")], env=env,
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return root, cfg, p.stdout


def test_pipeline_runs_every_engine_stage_on_vllm(vllm_run):
    from eagle3.storage.manifests import EvalReport, HiddenStates

    root, cfg, out = vllm_run
    run = root / "run"
    hidden = HiddenStates.read(run / "extract")
    n = 8 if cfg["trust_remote_code"] else 30
    assert hidden.backend == "vllm" and hidden.layer_ids[-1] == n and hidden.num_samples > 0
    check = hidden.stats["final_check"]
    assert check["passed"] and check["source"] == "vLLM prompt_logprobs", check
    regen = json.loads((run / "regenerate" / "manifest.json").read_text())
    assert regen["backend"] == cfg["regenerate"]["backend"] and regen["settings"]["dtype"] == "float32"
    r = EvalReport.read(run / "eval")
    assert r.backend == "vllm" and r.lossless and r.num_drafts > 0 and 1.0 < r.acceptance_length <= 4.0
    assert "serve it: VLLM_CPU_KVCACHE_SPACE=2 " in out
    final = json.loads((run / "train" / "final" / "config.json").read_text())
    if cfg["trust_remote_code"]:  # Kimi-K2.5: an MLA head, served text-only with the CPU MLA backend
        assert final["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and final["kv_lora_rank"] == 512
        assert "--language-model-only --attention-backend CPU_MLA --trust-remote-code" in out
    else:
        assert final["architectures"] == ["LlamaForCausalLMEagle3"]


def test_trained_head_scores_in_hf_what_vllm_counted(vllm_run):
    """The hf evaluator, on the head the run exported and the run's prompts, finds the drafts, accepted tokens and
    per-position counts vLLM's counters gave in the run; a random head of the same kind is accepted far less: the
    engine served the trained weights."""
    from eagle3.config import EvalConfig
    from eagle3.eval.run import evaluate
    from eagle3.model.formats import export
    from eagle3.storage.manifests import EvalReport
    from tests.helpers.drafts import random_draft

    root, cfg, out = vllm_run
    run, trust = root / "run", cfg["trust_remote_code"]
    v = EvalReport.read(run / "eval")
    ecfg = EvalConfig(prompts=cfg["eval"]["prompts"], k=3, max_new_tokens=24, threads=1)
    h = evaluate(cfg["model"], run / "train" / "final", root / "hf-eval", ecfg, trust_remote_code=trust)
    assert (h.num_drafts, h.num_accepted_tokens, h.per_position_acceptance, h.acceptance_length) == \
        (v.num_drafts, v.num_accepted_tokens, v.per_position_acceptance, v.acceptance_length)
    d = random_draft(cfg["model"], draft_vocab=512, seed=2, layer="mla" if trust else "llama")
    rnd = evaluate(cfg["model"], export(d.state_dict(), d.config, 3, root / "random"), root / "random-eval", ecfg,
                   trust_remote_code=trust)
    print(f"\ntrained head: tau {v.acceptance_length:.3f} (vLLM) = {h.acceptance_length:.3f} (hf); a random head "
          f"{rnd.acceptance_length:.3f}")
    assert v.acceptance_length >= rnd.acceptance_length + 0.5


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_served_head_answers_as_the_target_and_counts_accepted_tokens(vllm_run):
    import httpx
    import torch
    from openai import OpenAI

    from eagle3.model.target import Target, prompt_ids

    root, cfg, out = vllm_run
    line = next(x for x in out.splitlines() if x.startswith("serve it: "))[len("serve it: "):]
    port = _port()
    # the printed command as is, plus where to listen and no compile warm-up (start-up time only)
    cmd = f"{line} --host 127.0.0.1 --port {port} --enforce-eager"
    log = open(root / "serve.log", "w")
    proc = subprocess.Popen(["bash", "-c", cmd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while time.time() < deadline:
            assert proc.poll() is None, (root / "serve.log").read_text()[-4000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("the server did not come up in 600 s:\n" + (root / "serve.log").read_text()[-4000:])

        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        model_name = client.models.list().data[0].id
        target = Target.open(cfg["model"], trust_remote_code=cfg["trust_remote_code"])
        tok = target.tokenizer()
        lm = target.load_model(head=True).eval()
        eos = sorted(target.stop_ids())
        questions = ["question 5: what is 5 plus 5?", "question 11: what is 11 plus 11?",
                     "question 20: what is 20 plus 20?"]
        for q in questions:
            msgs = [{"role": "user", "content": q}]
            reply = client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=32)
            ids = torch.tensor([prompt_ids(tok, msgs)])
            with torch.no_grad():
                g = lm.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            want = tok.decode([t for t in g[0, ids.shape[1]:].tolist() if t not in eos], skip_special_tokens=True)
            assert reply.choices[0].message.content == want, q

        metrics = httpx.get(f"{url}/metrics", timeout=10).text

        def total(name: str) -> float:
            vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.M)]
            assert vals, f"{name} not in /metrics"
            return sum(vals)

        drafts, accepted = (total("vllm:spec_decode_num_drafts_total"),
                            total("vllm:spec_decode_num_accepted_tokens_total"))
        assert drafts > 0 and accepted > 0, (drafts, accepted)
        print(f"\nserved head: {accepted:.0f} draft tokens accepted in {drafts:.0f} drafts "
              f"(tau {1 + accepted / drafts:.3f})")
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the shell, the server and its engine processes
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=60)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()
