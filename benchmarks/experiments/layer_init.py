"""A warm-start dir whose draft layer starts as one of the target's decoder layers (a lever of the levers harness).

The draft layer is a Llama decoder layer whose q/k/v read [input_norm(embedding) | hidden_norm(h)], 2H wide,
where h = fc(aux states). Trained from a random start it learns its attention and MLP from the demo's ~0.5M
tokens alone. Here it starts as target layer `--layer` (default: the last) applied to h:
- hidden_norm <- the target layer's input_layernorm; q/k/v's h half (columns H:2H) <- its q/k/v; the embedding
  half (columns 0:H) at zero, so the layer first reads h alone and learns to use the token from the gradient;
- o_proj, post_attention_layernorm and the MLP <- the target layer's;
- everything else (fc, the input norm, the final norm, lm_head, the vocab map) as the trainer initialises it for
  `--config`'s seed.
The dir is an exported draft (config.json + model.safetensors) for `train.init_from`, which takes its weights
as the start of a new run (the schedule, warmup included, starts from step 0).

    python -m benchmarks.experiments.layer_init --config runs/demo/train/train_config.json \
        --hidden runs/demo/extract --verifier runs/demo/verifier --target assets/smollm2 --out runs/layer-init
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def target_layer(target, layer: int) -> dict[str, torch.Tensor]:
    """The tensors of decoder layer `layer` (negative: from the end) of `target` (an `eagle3.model.target.Target`,
    which resolves VLM wrappers' prefixes and the shards), named as inside the layer (`self_attn.q_proj.weight`)."""
    text, _ = target.prefixes
    pre = f"{text}layers.{layer % target.num_layers}."
    out = {k[len(pre):]: target.read(k) for k in target.weight_map if k.startswith(pre)}
    if "mlp.gate_proj.weight" not in out:
        raise ValueError(f"{target.path}: no dense Llama-style layer {pre!r} (an MoE or MLA layer cannot start a "
                         "Llama draft)")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the run's train_config.json (seed, draft switches)")
    p.add_argument("--hidden", required=True)
    p.add_argument("--verifier", required=True)
    p.add_argument("--target", required=True, help="the target's HF dir (its safetensors shards)")
    p.add_argument("--layer", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="the init's seed (default: the config's)")
    p.add_argument("--parts", default="attn,mlp", help="what starts as the target's: attn (hidden_norm, q/k/v's h "
                   "half, o_proj), mlp (post_attention_layernorm and the MLP), or both")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    from eagle3.config import TrainConfig
    from eagle3.model.formats import export
    from eagle3.model.target import Target
    from eagle3.storage.manifests import HiddenStates
    from eagle3.train.build import build_draft

    cfg = TrainConfig.model_validate(json.loads(Path(a.config).read_text()))
    if a.seed is not None:
        cfg = cfg.model_copy(update={"seed": a.seed})
    if cfg.draft_layer != "llama":
        raise ValueError("only a Llama draft layer starts from a target layer")
    draft = build_draft(cfg, HiddenStates.read(a.hidden), Path(a.verifier))
    c = draft.config
    w = target_layer(Target.open(a.target), a.layer)
    m, H = draft.midlayer, c.hidden_size
    parts = set(a.parts.split(","))
    if not parts or parts - {"attn", "mlp"}:
        raise ValueError(f"--parts: attn, mlp or both, got {a.parts!r}")
    with torch.no_grad():
        if "attn" in parts:
            m.hidden_norm.weight.copy_(w["input_layernorm.weight"])
            for name in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(m.self_attn, name)  # [out, 2H]
                lin.weight[:, :H].zero_()
                lin.weight[:, H:].copy_(w[f"self_attn.{name}.weight"])
            m.self_attn.o_proj.weight.copy_(w["self_attn.o_proj.weight"])
        if "mlp" in parts:
            m.post_attention_layernorm.weight.copy_(w["post_attention_layernorm.weight"])
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(m.mlp, name).weight.copy_(w[f"mlp.{name}.weight"])
    export(draft.state_dict(), c, cfg.ttt_steps, a.out)
    print(json.dumps({"out": a.out, "layer": a.layer, "seed": cfg.seed, "parts": sorted(parts)}))


if __name__ == "__main__":
    main()
