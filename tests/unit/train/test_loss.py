"""The TTT loss: hand-computed KL values, the step alignment, the out-of-vocab rule, TargetHead."""
from __future__ import annotations

import math

import pytest
import torch

from eagle3.train.loss import TargetHead, step_weights, ttt_loss

LN2 = math.log(2)


pytestmark = pytest.mark.usefixtures("one_thread")


def _case():
    """B=1, L=6, Vd=3. Target distribution per position s (the one that predicts token s+1)."""
    p = torch.tensor(
        [
            [1 / 3, 1 / 3, 1 / 3],  # s=0
            [0.50, 0.25, 0.25],  # s=1
            [1 / 3, 1 / 3, 1 / 3],  # s=2: its full-vocab argmax lies outside the draft vocab
            [0.25, 0.50, 0.25],  # s=3
            [0.25, 0.25, 0.50],  # s=4
            [1 / 3, 1 / 3, 1 / 3],  # s=5
        ]
    )
    target_logits = p.log()[None]  # [1, 6, 3]
    target_top = torch.tensor([[0, 0, -1, 1, 2, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    q0 = torch.tensor([0.50, 0.25, 0.25]).log().expand(1, 6, 3).clone().requires_grad_()
    q1 = torch.tensor([0.25, 0.50, 0.25]).log().expand(1, 6, 3).clone().requires_grad_()
    return target_logits, target_top, loss_mask, q0, q1


def test_hand_computed_two_steps():
    target_logits, target_top, loss_mask, q0, q1 = _case()
    out = ttt_loss([q0, q1], target_logits, target_top, loss_mask)
    # step 0 at t uses target s = t+1 and needs token t+2 trainable: t in {0,1,2,3} -> s in {1,2,3,4};
    # s=2 is out of vocab, so the KL covers s in {1,3,4}:
    #   KL(p1||q0) = 0; KL(p3||q0) = .25 ln(.25/.5) + .5 ln(.5/.25) + 0 = 0.25 ln2; KL(p4||q0) = 0.25 ln2
    # step 1 at t uses s = t+2, t in {0,1,2} -> s in {2,3,4}; KL covers {3,4}: 0 and 0.25 ln2
    expected = (0 + 0.25 * LN2 + 0.25 * LN2) / 3 + 0.8 * (0 + 0.25 * LN2) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    assert out.kl_count == [3, 2]
    assert out.kl_sum == pytest.approx([0.5 * LN2, 0.25 * LN2], abs=1e-6)
    # top-1: draft argmax is 0 at step 0 (hit only at s=1), 1 at step 1 (hit only at s=3);
    # the out-of-vocab s=2 counts as a miss in both
    assert out.correct == [1, 1] and out.count == [4, 3]
    assert out.accuracy == pytest.approx([0.25, 1 / 3])
    out.loss.backward()
    # d/dlogits of mean KL = (q - p) / n at counted positions, zero elsewhere
    g = torch.zeros(6, 3)
    for t, s in [(0, 1), (2, 3), (3, 4)]:
        g[t] = (q0[0, t].softmax(-1) - target_logits[0, s].exp()) / 3
    torch.testing.assert_close(q0.grad[0], g, atol=1e-6, rtol=0)


def test_weights_are_configurable():
    target_logits, target_top, loss_mask, q0, q1 = _case()
    out = ttt_loss([q0, q1], target_logits, target_top, loss_mask, weights=[0.0, 1.0])
    assert out.loss.item() == pytest.approx(0.125 * LN2, abs=1e-6)
    assert step_weights(3) == pytest.approx([1.0, 0.8, 0.64])
    with pytest.raises(ValueError, match="2 step weights for 1 steps"):
        ttt_loss([q0], target_logits, target_top, loss_mask, weights=[1.0, 1.0])


def test_document_boundaries():
    target_logits, target_top, loss_mask, q0, q1 = _case()
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out = ttt_loss([q0, q1], target_logits, target_top, loss_mask, doc=doc)
    # step 0 keeps t=0 (s=1) and t=3 (s=4); t=1,2 would predict a token of the next document.
    # step 1 keeps nothing: every t + 3 lies in another document or past the end.
    assert out.count == [2, 0] and out.kl_count == [2, 0]
    assert out.loss.item() == pytest.approx((0 + 0.25 * LN2) / 2, abs=1e-6)
    assert out.correct[0] == 1 and math.isnan(out.accuracy[1])


def test_zero_when_draft_equals_target():
    target_logits, target_top, loss_mask, _, _ = _case()
    top = torch.tensor([[0, 0, 0, 1, 2, 0]])  # everything in vocab, argmax = the logits' argmax
    drafts = [torch.cat([target_logits[:, j + 1 :], target_logits[:, : j + 1]], 1) for j in range(2)]
    out = ttt_loss(drafts, target_logits, top, torch.ones(1, 6, dtype=torch.long))
    assert out.loss.item() == pytest.approx(0.0, abs=1e-7)
    # s=0/2/5 are uniform: argmax 0 matches top 0
    assert out.correct == out.count == [4, 3]


def test_target_head_matches_manual_norm_and_lm_head():
    g = torch.Generator().manual_seed(0)
    V, H = 10, 4
    lm_head = torch.randn(V, H, generator=g)
    norm_w = torch.rand(H, generator=g) + 0.5
    target_ids = torch.tensor([1, 3, 6, 8])
    d2t = target_ids - torch.arange(4)
    final = torch.randn(2, 5, H, generator=g) * 3
    head = TargetHead(norm_w, 1e-5, lm_head, d2t, chunk=3)
    logits, top = head(final)
    normed = final / torch.sqrt(final.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
    torch.testing.assert_close(logits, normed @ lm_head[target_ids].T)
    full_top = (normed @ lm_head.T).argmax(-1)
    expect = torch.tensor([{1: 0, 3: 1, 6: 2, 8: 3}.get(int(i), -1) for i in full_top.flatten()]).view(2, 5)
    assert torch.equal(top, expect)
    assert (expect == -1).any() and (expect >= 0).any()  # the case exercises both branches
    with pytest.raises(ValueError, match="distinct target ids"):
        TargetHead(norm_w, 1e-5, lm_head, torch.tensor([1, 0, 0, 0]))


def test_draft_learns_a_fixed_target_end_to_end():
    # model + blockwise attention + loss in one graph: a few Adam steps on one packed batch must
    # cut the loss and lift top-1 agreement (a broken gradient anywhere stalls this)
    from eagle3.model.attention import doc_ids_from_position_ids
    from eagle3.model.draft import DraftConfig, Eagle3Draft

    torch.manual_seed(0)
    c = DraftConfig(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, intermediate_size=64, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=64, vocab_size=40, draft_vocab_size=16, aux_layer_ids=(1, 2, 3))
    m = Eagle3Draft(c)
    head = TargetHead(torch.ones(32), 1e-5, torch.randn(40, 32), torch.full((16,), 2, dtype=torch.long))
    pos = torch.cat([torch.arange(14), torch.arange(18)])[None]
    ids = torch.randint(0, 40, (1, 32))
    aux = torch.randn(1, 32, 3, 32)
    final = aux[:, :, 2] @ torch.randn(32, 32)  # a learnable function of the inputs
    tl, top = head(final)
    doc = doc_ids_from_position_ids(pos)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(60):
        out = ttt_loss(m.ttt_forward(ids, aux, pos, steps=2, block=8), tl, top, torch.ones(1, 32), doc)
        first = first or (out.loss.item(), out.accuracy[0])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert out.loss.item() < 0.5 * first[0]
    assert out.accuracy[0] > first[1] + 0.2


@pytest.mark.parametrize("loss", ["kl", "lk", "topk"])
@pytest.mark.parametrize("chunk", [3, 512])
def test_fused_loss_equals_autograd_reference(chunk, loss):
    # The trainer's loss (lm_head applied chunk by chunk, gradient formed in forward) against the
    # plain autograd loss on logits: same value, per-step sums and hits, and gradients for the
    # states and the lm_head, on a packed row with out-of-vocab targets and masked tokens.
    from eagle3.train.loss import ttt_loss_fused

    torch.manual_seed(0)
    B, L, H, Vd, k = 2, 11, 8, 6, 3
    states = [torch.randn(B, L, H, dtype=torch.float64).float().requires_grad_() for _ in range(k)]
    w = torch.randn(Vd, H, requires_grad=True)
    tl = torch.randn(B, L, Vd) * 2
    top = torch.randint(-1, Vd, (B, L))
    mask = (torch.rand(B, L) > 0.2).long()
    doc = torch.tensor([[0] * 5 + [1] * 6, [0] * 11])
    ref = ttt_loss([s @ w.T for s in states], tl, top, mask, doc, loss=loss, eta=3.0, topk=3, topk_weight=0.7)
    ref.loss.backward()
    g_ref = [s.grad.clone() for s in states] + [w.grad.clone()]
    for s in states:
        s.grad = None
    w.grad = None
    out = ttt_loss_fused(states, w, tl, top, mask, doc, chunk=chunk, loss=loss, eta=3.0, topk=3, topk_weight=0.7)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.alpha_sum, ref.alpha_sum, atol=1e-5, rtol=1e-6)
    assert out.kl_count == ref.kl_count and out.count == ref.count and out.correct == ref.correct
    assert all(torch.equal(a, b) for a, b in zip(out.hits, ref.hits, strict=True))
    torch.testing.assert_close(out.kl_sum, ref.kl_sum, atol=1e-5, rtol=1e-6)
    for g, r in zip([s.grad for s in states] + [w.grad], g_ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)
    # hits matter for simulated acceptance: both branches occur
    assert 0 < sum(out.correct) < sum(out.count)


def test_lk_loss_hand_computed():
    # one step, two scored rows: p = (.5,.25,.25) vs q = (.25,.5,.25) -> alpha = .25+.25+.25 = .75, KL = .25 ln2;
    # p = q -> alpha = 1, KL = 0. lambda = exp(-3 * mean alpha) = exp(-2.625).
    p = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]).log()[None]  # [1, 3, 3]
    q = torch.tensor([[0.25, 0.5, 0.25], [0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]).log()[None].requires_grad_()
    top = torch.tensor([[0, 1, 0]])
    # step 0 at t scores target s = t + 1 and needs token t + 2: t = 0 only (s = 1); shift so both rows count
    tl = torch.cat([p[:, :1], p], 1)  # s = 1 -> p row 0, s = 2 -> p row 1
    ql = torch.cat([q, q[:, :1]], 1)  # t = 0 -> q row 0, t = 1 -> q row 1
    out = ttt_loss([ql], tl, torch.cat([top, top[:, :1]], 1), torch.ones(1, 4, dtype=torch.long), loss="lk", eta=3.0)
    lam = math.exp(-3 * (0.75 + 1.0) / 2)
    expected = (lam * 0.25 * LN2 + (1 - lam) * 0.25) / 2
    assert out.kl_count == [2] and out.alpha_sum == pytest.approx([1.75], abs=1e-6)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_topk_loss_hand_computed():
    # one scored row: p = (.5, .3, .2), q = (.25, .25, .5); top-2 of p = tokens 0, 1.
    # KL = .5 ln 2 + .3 ln 1.2 + .2 ln .4; top-2 CE = -(.5 ln .25 + .3 ln .25) = .8 ln 4.
    p = torch.tensor([[0.5, 0.3, 0.2]]).log()[None]  # [1, 1, 3]
    q = torch.tensor([[0.25, 0.25, 0.5]]).log()[None]
    tl = torch.cat([p, p, p], 1)  # step 0 at t = 0 scores the target row s = 1
    ql = torch.cat([q, q, q], 1)
    out = ttt_loss([ql], tl, torch.zeros(1, 3, dtype=torch.long), torch.tensor([[0, 0, 1]]), loss="topk", topk=2,
                   topk_weight=0.5)
    kl = 0.5 * LN2 + 0.3 * math.log(1.2) + 0.2 * math.log(0.4)
    assert out.kl_count == [1] and out.kl_sum == pytest.approx([kl], abs=1e-6)
    assert out.loss.item() == pytest.approx(kl + 0.5 * 0.8 * math.log(4), abs=1e-6)


def test_trainer_module_shows_its_loss_to_tree_flatten():
    # FSDP2 hooks its gradient reduction on the output tensors of the wrapped forward, and torch before
    # 2.13 finds them with tree_flatten, which does not open a dataclass: with the loss only inside
    # TTTLossOutput, FSDP2 on torch 2.11 reduced no gradient and never updated a weight (seen on a GPU).
    from torch.utils._pytree import tree_flatten

    from eagle3.model.draft import DraftConfig, Eagle3Draft
    from eagle3.train.loop import TTT
    from eagle3.train.loss import step_weights

    torch.manual_seed(0)
    c = DraftConfig(hidden_size=32, target_hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, intermediate_size=64, rms_norm_eps=1e-5, rope_theta=1e4,
                    max_position_embeddings=64, vocab_size=40, draft_vocab_size=16, aux_layer_ids=(1, 2, 3))
    head = TargetHead(torch.ones(32), 1e-5, torch.randn(40, 32), torch.full((16,), 2, dtype=torch.long))
    pos = torch.arange(12)[None]
    tl, top = head(torch.randn(1, 12, 32))
    out = TTT(Eagle3Draft(c), 2, 8, step_weights(2))(torch.randint(0, 40, (1, 12)), torch.randn(1, 12, 3, 32), pos,
                                                     torch.zeros(1, 12, dtype=torch.long), torch.ones(1, 12), tl, top)
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    assert len(leaves) == 1 and leaves[0] is out[1].loss
