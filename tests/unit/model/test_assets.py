"""The offline SmolLM2 target: a plain HF dir whose logits equal the GGUF load."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.assets import load_smollm2_gguf, materialize_smollm2


@pytest.mark.usefixtures("one_thread")  # one thread: no reduction split between threads can differ either
def test_saved_model_logits_equal_gguf_load(smollm2_dir):
    ref, tok_ref = load_smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert ids.tolist() == tok_ref.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                                       return_dict=True)["input_ids"].tolist()
    # The saved weights are the GGUF's dequantized fp32 weights, bit for bit.
    sa, sb = model.state_dict(), ref.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # Then the forward passes are bitwise equal once both models run from memory laid out alike:
    # safetensors maps tensors at the file's offsets (here 40 mod 64 bytes) and the GGUF load at 16,
    # and on some CPUs the fp32 GEMM sums in a different order for a differently aligned operand
    # (CI once saw logits 5e-3 apart from equal weights). A clone is 64-byte aligned by torch.
    with torch.no_grad():
        for m in (model, ref):
            for p in m.parameters():  # tied embed/lm_head is one Parameter: cloned once, stays tied
                p.data = p.data.clone()
        a, b = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_idempotent(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert materialize_smollm2(smollm2_dir) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
