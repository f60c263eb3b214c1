"""Stage 4: training the draft.

    ttt_attention(q, k0, v0, kd, vd, doc)   blockwise TTT attention, O(L*(block+k)) extra memory
    TargetHead.from_verifier(dir)(final)    -> (draft-vocab target logits, draft id of target argmax)
    ttt_loss(draft_logits, target_logits, target_top, loss_mask, doc, weights) -> TTTLossOutput
    ttt_loss_fused(states, lm_head, ...)    the same from normed states, never holding [L, Vd] for backward
"""
from eagle3.train.attention import doc_ids_from_cu_seqlens, doc_ids_from_position_ids, ttt_attention
from eagle3.train.loss import TargetHead, TTTLossOutput, step_weights, ttt_loss, ttt_loss_fused

__all__ = [
    "TTTLossOutput",
    "TargetHead",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_position_ids",
    "step_weights",
    "ttt_attention",
    "ttt_loss",
    "ttt_loss_fused",
]
