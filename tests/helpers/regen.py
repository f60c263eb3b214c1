"""Regeneration sources and the check that every regenerated turn is the target's own greedy answer."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3.config import RegenConfig
from eagle3.model.target import Target
from eagle3.regenerate.hf import load_hf
from eagle3.regenerate.run import read_records


def write_source(path: Path, n: int, start: int = 0, two_turn_every: int = 3) -> Path:
    """n ShareGPT-form records r<start>..; every `two_turn_every`-th has a second exchange."""
    rows = []
    for i in range(start, start + n):
        conv = [{"from": "human", "value": f"question {i}: what is {i} plus {i}?"},
                {"from": "gpt", "value": f"{i} plus {i} is {2 * i}."}]
        if i % two_turn_every == 0:
            conv += [{"from": "human", "value": f"and {i} times {i}?"}, {"from": "gpt", "value": f"{i * i}"}]
        rows.append({"id": f"r{i}", "conversations": conv})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path



def target_greedy(model, tok, history: list[dict], max_new: int, eos: set[int]) -> list[int]:
    """The target's own greedy answer to `history`, one sequence, through `model.generate`."""
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    x = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                           eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])[0, x.shape[1]:].tolist()
    for i, t in enumerate(y):
        if t in eos:
            return y[:i]
    return y



def check_equal_to_target(model_dir: Path, out: Path, max_new: int) -> int:
    """Every regenerated turn == the target's greedy answer to the regenerated history; returns turns checked."""
    gen, tok = load_hf(Target.open(model_dir), RegenConfig())
    checked = 0
    for rec in read_records(out):
        msgs, turns = rec["messages"], rec["provenance"]["turns"]
        k = 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            ids = target_greedy(gen.model, tok, msgs[:i], max_new, gen.eos)
            assert tok.decode(ids, skip_special_tokens=True) == m["content"], (rec["id"], i)
            assert len(ids) == turns[k]["tokens"], (rec["id"], i)
            assert turns[k]["finish"] == ("length" if len(ids) == max_new else "stop")
            k += 1
            checked += 1
    return checked
