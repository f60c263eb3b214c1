"""Draft dirs for the eval and serving tests: a random draft on the tiny target, written in vLLM's native layout
or speculators', and test proposers (the target's own continuation, or a mix of right and wrong tokens)."""
from __future__ import annotations

import json
import random

import torch
from safetensors.torch import save_file

from eagle3.eval.decode import DraftProposer
from eagle3.model.draft import DraftConfig, Eagle3Draft


def random_draft(tiny_llama_dir, draft_vocab=512, seed=0, **switches) -> Eagle3Draft:
    """A random draft on the tiny target, with a random draft vocab and non-trivial norms."""
    torch.manual_seed(seed)
    c = DraftConfig.from_target(tiny_llama_dir, draft_vocab, aux_layer_ids=(1, 3, 4), **switches)
    d = Eagle3Draft(c)
    tid = torch.randperm(c.vocab_size)[:draft_vocab].sort().values
    with torch.no_grad():
        d.d2t.copy_(tid - torch.arange(draft_vocab))
        d.t2d.zero_()
        d.t2d[tid] = True
        for name, p in d.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return d.eval()



def layer_config(c: DraftConfig) -> dict:
    return {
        "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size, "tie_word_embeddings": False,
    }



def write_native(d: Eagle3Draft, out, prefix: str = "", keep=("d2t", "t2d"), embed=False, file="model.safetensors"):
    """vLLM's native EAGLE-3 layout (LlamaForCausalLMEagle3), as our exporter and EAGLE/SpecForge write it."""
    c = d.config
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], **layer_config(c), "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size, "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm, "norm_output": c.norm_output,
    }
    (out / "config.json").write_text(json.dumps(cfg))
    sd = {k: v for k, v in d.state_dict().items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    sd.update({k: d.state_dict()[k] for k in keep})
    if embed:
        sd["embed_tokens.weight"] = d.embed_tokens.weight
    sd = {prefix + k: v.contiguous() for k, v in sd.items()}
    if file.endswith(".bin"):
        torch.save(sd, out / file)
    else:
        save_file(sd, out / file)
    return out



def write_speculators(d: Eagle3Draft, out, verifier: str, embed: bool):
    """speculators' Eagle3 layout: `speculators_model_type`, `transformer_layer_config`,
    `speculators_config` (proposal_methods[0].speculative_tokens, verifier.name_or_path); the
    decoder layer is `layers.0.*`, plus fc, input_norm (norm_before_fc), norm, lm_head, d2t, t2d;
    embed_tokens is optional (speculators ignores it when missing on load)."""
    c = d.config
    out.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": layer_config(c), "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc,
        "norm_output": c.norm_output, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": str(verifier), "architectures": ["LlamaForCausalLM"]},
        },
    }
    (out / "config.json").write_text(json.dumps(cfg))
    sd = {}
    for k, v in d.state_dict().items():
        if k == "embed_tokens.weight" and not embed:
            continue
        sd[k.replace("midlayer.", "layers.0.")] = v.contiguous()
    save_file(sd, out / "model.safetensors")
    return out



class Oracle:
    """Test draft: the target's own greedy continuation (full recompute, no cache). wrong=True
    proposes each of those tokens + 1, so the first position is never accepted."""

    def __init__(self, model, wrong: bool = False):
        self.model, self.wrong = model, wrong

    def reset(self) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ids, aux, k):
        seq, out = list(ids), []
        for _ in range(k):
            nxt = int(self.model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(nxt)
            out.append((nxt + 1) % self.model.config.vocab_size if self.wrong else nxt)
        return out



class Mixed:
    """Runs the real DraftProposer (so its KV-cache bookkeeping is exercised) but returns the
    oracle's first n tokens, n random, then a wrong token: exactly n get accepted."""

    def __init__(self, model, draft, seed=0):
        self.oracle, self.dp, self.rng = Oracle(model), DraftProposer(draft), random.Random(seed)
        self.calls, self.ns = [], []

    def reset(self) -> None:
        self.dp.reset()

    def propose(self, ids, aux, k):
        mine = self.dp.propose(ids, aux, k)
        self.calls.append((list(ids), mine))
        truth = self.oracle.propose(ids, aux, k)
        n = self.rng.randint(0, k)
        self.ns.append(n)
        return truth[:n] + ([(truth[n] + 1) % len(self.dp.draft.t2d)] if n < k else []) + mine[n + 1 :]
