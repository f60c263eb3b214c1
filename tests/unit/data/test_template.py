"""Golden loss masks: exactly the assistant content tokens plus the end-of-turn token."""
from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from eagle3.data.normalize import Skip
from eagle3.data.template import ChatRenderer, show
from tests.helpers.templates import INST, INST_SPECIAL, LLAMA3, LLAMA3_SPECIAL, with_template

CONV = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke"},
    {"role": "assistant", "content": "Why did the chicken cross the road?"},
]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def encode(tok, msgs, max_len=10_000):
    r = ChatRenderer(tok)
    return r.encode([r.render(msgs)], max_len)[0]


def bits(s: str) -> list[int]:
    return [int(c) for c in s]


def test_chatml_smollm2_golden_multiturn(tok):
    # SmolLM2's template inserts a default system prompt; none of it is trainable.
    ids, mask = encode(tok, CONV)
    assert ids.tolist() == [
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
        19712, 8182, 2, 198, 1, 4093, 198, 26843, 665, 2, 198, 1, 520, 9531, 198, 19556, 17, 1073, 416,
        339, 724, 47, 2, 198, 1, 4093, 198, 31530, 549, 253, 24021, 2, 198, 1, 520, 9531, 198, 4898,
        1250, 260, 9610, 3050, 260, 3398, 47, 2, 198,
    ]
    assert mask.tolist() == bits("0000000000000000000000000000000011111111000000000000001111111110")
    # The trainable tokens decode to each answer followed by <|im_end|>, and nothing else.
    assert tok.decode(ids[32:40]) == "Hello! How can I help?<|im_end|>"
    assert tok.decode(ids[54:63]) == "Why did the chicken cross the road?<|im_end|>"


def test_chatml_with_system_turn(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    ids, mask = encode(tok, msgs)
    assert ids.tolist() == [1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 34, 27, 34, 47, 2, 198,
                            1, 520, 9531, 198, 36, 2, 198]
    assert mask.tolist() == bits("000000000000000000000110")


def test_llama3_style_golden(tok):
    t = with_template(tok, LLAMA3, LLAMA3_SPECIAL, "<|begin_of_text|>", "<|eot_id|>")
    eot = t.convert_tokens_to_ids("<|eot_id|>")
    ids, mask = encode(t, CONV)
    assert mask.tolist() == bits("000000000000000111111110000000000000000111111111")
    runs = np.split(ids, np.nonzero(np.diff(mask))[0] + 1)
    trainable = [r for r, m in zip(runs, np.split(mask, np.nonzero(np.diff(mask))[0] + 1), strict=True) if m[0]]
    assert [t.decode(r) for r in trainable] == ["Hello! How can I help?<|eot_id|>",
                                                "Why did the chicken cross the road?<|eot_id|>"]
    assert all(r[-1] == eot for r in trainable)


def test_llama3_trims_content(tok):
    # The template trims; the mask must follow the text it actually rendered.
    t = with_template(tok, LLAMA3, LLAMA3_SPECIAL, "<|begin_of_text|>", "<|eot_id|>")
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "  padded answer \n"}]
    ids, mask = encode(t, msgs)
    assert t.decode(ids[mask == 1]) == "padded answer<|eot_id|>"


def test_inst_style_eos_and_alternation(tok):
    t = with_template(tok, INST, INST_SPECIAL, "<s>", "</s>")
    ids, mask = encode(t, CONV)
    assert mask.tolist() == bits("00000000001111111100000000000111111111")
    assert t.decode(ids[mask == 1]) == " Hello! How can I help?</s> Why did the chicken cross the road?</s>"
    with pytest.raises(Skip) as e:
        ChatRenderer(t).render([{"role": "system", "content": "s"}] + CONV)
    assert e.value.reason == "template_error"


def test_truncation_keeps_prefix(tok):
    full_ids, full_mask = encode(tok, CONV)
    ids, mask = encode(tok, CONV, max_len=36)
    assert ids.tolist() == full_ids[:36].tolist() and mask.tolist() == full_mask[:36].tolist()


def test_giant_turn_is_cut_before_tokenizing_with_identical_prefix(tok):
    big = "word " * 50_000  # 250k chars; capped at max_len * 64 before tokenization
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": big}]
    r = ChatRenderer(tok)
    ids, mask = r.encode([r.render(msgs)], max_len=512)[0]
    exact = r._encode([r.render(msgs).text], [r.render(msgs)], 512)[0]
    assert len(ids) == 512
    assert ids.tolist() == exact[0].tolist() and mask.tolist() == exact[1].tolist()


def test_no_chat_template_is_a_clear_error(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(t, name="model X")


def test_template_overhead_and_show(tok):
    r = ChatRenderer(tok)
    assert r.template_overhead() == 31  # default system prompt + user turn + assistant header
    ids, mask = encode(tok, CONV[:2])
    assert show(tok, ids, mask, color=False).count("«") == 1
    assert "«Hello! How can I help?<|im_end|>»" in show(tok, ids, mask, color=False)


def test_backend_batch_equals_hf_call(tok):
    r = ChatRenderer(tok)
    rendered = r.render(CONV)
    ids, _ = r.encode([rendered], 10_000)[0]
    assert ids.tolist() == tok(rendered.text, add_special_tokens=False)["input_ids"]
    assert ids.tolist() == tok.apply_chat_template(CONV, tokenize=True, return_dict=True)["input_ids"]
