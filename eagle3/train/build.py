"""The draft as a training run starts it: shaped from the target and the stored hidden states, its weights from
the verifier (embedding, the draft-vocab rows of lm_head), then a warm start's weights or the initialisation
switches, then what the config keeps frozen. Seeded: the same draft on every rank and every rerun."""
from __future__ import annotations

from pathlib import Path

import torch

from eagle3.config import TrainConfig
from eagle3.model.draft import VERIFIER_FILE, DraftConfig, Eagle3Draft
from eagle3.storage.manifests import HiddenStates, VerifierWeights


def build_draft(cfg: TrainConfig, hidden: HiddenStates, verifier_dir: Path) -> Eagle3Draft:
    ver = VerifierWeights.read(verifier_dir)
    if ver.hidden_size != hidden.hidden_size:
        raise ValueError(f"verifier hidden size {ver.hidden_size} != stored hidden states' {hidden.hidden_size}: "
                         "the verifier and the extract stage come from different targets")
    dcfg = DraftConfig.from_target(
        hidden.model_dir, draft_vocab_size=ver.draft_vocab_size, aux_layer_ids=hidden.aux_layer_ids,
        norm_before_fc=cfg.norm_before_fc, fc_norm=cfg.fc_norm, norm_output=cfg.norm_output,
        norm_before_residual=cfg.norm_before_residual, layer=cfg.draft_layer,
    )
    torch.manual_seed(cfg.seed)  # same init on every rank and every rerun
    draft = Eagle3Draft.from_verifier(dcfg, verifier_dir)
    if cfg.init_from:
        warm_start(draft, Path(cfg.init_from))  # its weights replace any initialisation switch
    else:
        init_levers(draft, cfg, verifier_dir)
    freeze(draft, cfg)
    return draft



def init_levers(draft: Eagle3Draft, cfg: TrainConfig, verifier_dir: Path) -> None:
    """The initialisation switches of `cfg` (norm_init, zero_init_residual) on a fresh draft; the same on every
    rank, as they read only the config and the verifier."""
    with torch.no_grad():
        if cfg.norm_init == "target":
            from safetensors import safe_open

            with safe_open(str(verifier_dir / VERIFIER_FILE), "pt") as f:
                draft.norm.weight.copy_(f.get_tensor("norm"))  # [H]: the target's final RMSNorm weight
        if cfg.zero_init_residual:
            draft.midlayer.self_attn.o_proj.weight.zero_()
            draft.midlayer.mlp.down_proj.weight.zero_()



def freeze(draft: Eagle3Draft, cfg: TrainConfig) -> None:
    """What `cfg` keeps fixed through training, warm start or not: fc at zero (zero_aux, the diagnostic), the head
    at its starting rows (head_lr_scale 0)."""
    if cfg.zero_aux:
        with torch.no_grad():
            draft.fc.weight.zero_()
        draft.fc.weight.requires_grad_(False)
    if cfg.head_lr_scale == 0:
        draft.lm_head.weight.requires_grad_(False)



def warm_start(draft: Eagle3Draft, src: Path) -> None:
    """Initialize from an exported draft (final/). The vocab map is never rebuilt: the source's d2t
    must equal the one this run trains with (prepare with `vocab_from` the promoted run)."""
    from safetensors.torch import load_file

    from eagle3.model.formats import draft_name

    path = src / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"init_from: {path} does not exist (expected an exported draft dir, e.g. <train>/final)")
    w = {draft_name(k): v for k, v in load_file(str(path)).items()}
    if "d2t" not in w or not torch.equal(w["d2t"], draft.d2t):
        raise ValueError(f"init_from: {src} was trained with another draft vocab (d2t differs); a warm start keeps "
                         "the vocab map fixed: prepare with vocab_from=<the promoted run's prepare dir>")
    own = draft.state_dict()
    bad = [k for k, v in w.items() if k in own and own[k].shape != v.shape]
    if bad:
        raise ValueError(f"init_from: {src} has other shapes for {bad[:4]}: a draft of another config")
    missing = [k for k in own if k not in w and k not in ("embed_tokens.weight", "t2d")]
    if missing:
        raise ValueError(f"init_from: {src} lacks {missing[:4]} (norm_before_fc / norm_output settings differ?)")
    draft.load_state_dict({k: v for k, v in w.items() if k in own}, strict=False)
