"""The DFlash-2 selector objective against a loop-by-loop reference written out here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_pipeline.shared.model.loss import SelectorWeights, dflash_loss, selector_loss

X = -100
V, H, R, K, B = 50, 8, 3, 4, 4


class Selector(nn.Module):
    """The reference's CandidateSelector layout (two codebooks, a bias-free projection)."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.predecessor_codebook = nn.Embedding(V, R)
        self.successor_codebook = nn.Embedding(V, R)
        self.hidden_projection = nn.Linear(H, R, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))


def dense_reference(sel, hidden, labels, anchors, head, gamma, weight, position_weights=None):
    """Loops over every row; predecessor = anchor at k = 1, else the label at k - 1 (none if unlabeled)."""
    P, S, W = sel.predecessor_codebook.weight, sel.successor_codebook.weight, sel.hidden_projection.weight
    b, Q, _ = hidden.shape
    ce_sum, sel_sum, den = 0.0, 0.0, 0.0
    for i in range(b):
        for q in range(Q):
            y, k = int(labels[i, q]), q % B
            if y == X:
                continue
            w = position_weights[k] if position_weights else (0.0 if k == 0 else math.exp(-(k - 1) / gamma))
            den += w
            logits = head @ hidden[i, q]
            ce_sum = ce_sum - w * torch.log_softmax(logits, 0)[y]
            prev = int(anchors[(i * Q + q) // B]) if k == 1 else int(labels[i, q - 1])
            if prev == X:
                continue
            cand = logits.topk(K).indices.tolist()
            if y not in cand:
                cand[-1] = y
            h = W @ hidden[i, q]
            scores = torch.stack([logits[c] + sum(P[prev, d] * h[d] * S[c, d] for d in range(R)) for c in cand])
            sel_sum = sel_sum - w * torch.log_softmax(scores, 0)[cand.index(y)]
    return (ce_sum + weight * sel_sum) / den


def example(seed=0):
    g = torch.Generator().manual_seed(seed)
    sel = Selector(g)
    hidden = torch.randn(1, 2 * B, H, generator=g, requires_grad=True)
    head = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (1, 2 * B), generator=g)
    labels[:, ::B] = X  # anchors
    labels[0, 6] = X  # so position 7 has no known predecessor
    labels[0, 2] = (head @ hidden[0, 2]).argmax()  # one label inside the top-K
    anchors = torch.randint(0, V, (2,), generator=g)
    return sel, hidden, head, labels, anchors


@pytest.mark.parametrize("layout", ["packed", "blocks"])
def test_selector_loss_matches_dense_reference_value_and_gradients(layout):
    sel, hidden, head, labels, anchors = example()
    if layout == "blocks":  # [N, B, H]
        hidden = hidden.detach().view(2, B, H).requires_grad_(True)
        labels = labels.view(2, B)
    params = [hidden, *sel.parameters()]
    loss, stats = selector_loss(
        SelectorWeights.of(sel), hidden, labels, anchors, head, B, 2.0, K, selector_loss_weight=0.7, chunk_tokens=3
    )
    grads = torch.autograd.grad(loss, params)
    ref = dense_reference(sel, hidden, labels, anchors, head, 2.0, 0.7)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(loss, ref)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert all(g.abs().sum() > 0 for g in grads)
    torch.testing.assert_close(loss, stats["ce"] + 0.7 * stats["selector"])


def test_injected_label_has_finite_loss_and_gradient_on_its_successor_row():
    sel, hidden, head, _, anchors = example(1)
    labels = torch.full((1, B), X)
    logits = head @ hidden[0, 1].detach()
    labels[0, 1] = logits.argmin()  # far outside the top-K
    top = logits.topk(K).indices
    loss, _ = selector_loss(SelectorWeights.of(sel), hidden[:, :B], labels, anchors[:1], head, B, 2.0, K)
    (succ_grad,) = torch.autograd.grad(loss, [sel.successor_codebook.weight])
    assert torch.isfinite(loss)
    assert succ_grad[labels[0, 1]].abs().sum() > 0  # the label is a candidate
    assert succ_grad[top[-1]].abs().sum() == 0  # ... in place of the lowest of the top-K
    assert all(succ_grad[t].abs().sum() > 0 for t in top[:-1])
    assert int((succ_grad.abs().sum(1) > 0).sum()) == K


def test_top1_label_and_zero_pairwise_term_is_ce_of_top_k_logits():
    sel, hidden, head, _, anchors = example(2)
    with torch.no_grad():
        sel.successor_codebook.weight.zero_()
    logits = hidden.detach() @ head.T  # [1, 8, V]
    labels = logits.argmax(-1)
    labels[:, ::B] = X
    loss, stats = selector_loss(
        SelectorWeights.of(sel), hidden, labels, anchors, head, B, 3.0, K, selector_loss_weight=0.3
    )
    w = torch.tensor([0.0, 1.0, math.exp(-1 / 3), math.exp(-2 / 3)]).repeat(2)
    top_ce = F.cross_entropy(logits[0].topk(K).values, torch.zeros(2 * B, dtype=torch.long), reduction="none")
    torch.testing.assert_close(stats["selector"], (w * top_ce).sum() / w.sum())
    ce, _ = dflash_loss(hidden, labels, head, B, 3.0)
    torch.testing.assert_close(stats["ce"], ce.detach())
    torch.testing.assert_close(loss, ce + 0.3 * stats["selector"])


@pytest.mark.parametrize("gamma", [1.0, 3.0])
def test_position_weights_follow_loss_weights(gamma):
    sel, hidden, head, labels, anchors = example(3)
    loss, _ = selector_loss(SelectorWeights.of(sel), hidden, labels, anchors, head, B, gamma, K)
    weights = [0.0, 1.0, math.exp(-1 / gamma), math.exp(-2 / gamma)]
    torch.testing.assert_close(loss, dense_reference(sel, hidden, labels, anchors, head, gamma, 1.0, weights))
    uniform = dense_reference(sel, hidden, labels, anchors, head, gamma, 1.0, [0.0, 1.0, 1.0, 1.0])
    assert not torch.isclose(loss, uniform)


def test_selector_loss_without_labels_is_zero_and_connected():
    sel, hidden, head, _, anchors = example()
    loss, stats = selector_loss(SelectorWeights.of(sel), hidden, torch.full((1, 2 * B), X), anchors, head, B, 2.0, K)
    grads = torch.autograd.grad(loss, [hidden, *sel.parameters()])
    assert loss.item() == 0.0 and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    assert stats["total"].sum() == 0


def test_selector_weights_of_takes_embeddings_or_bare_codebooks():
    sel = Selector(torch.Generator().manual_seed(0))
    bare = nn.Module()
    bare.predecessor_codebook = nn.Parameter(torch.zeros(V, R))
    bare.successor_codebook = nn.Parameter(torch.zeros(V, R))
    bare.hidden_projection = sel.hidden_projection
    of_sel, of_bare = SelectorWeights.of(sel), SelectorWeights.of(bare)
    assert of_sel.predecessor_codebook is sel.predecessor_codebook.weight
    assert of_sel.successor_codebook is sel.successor_codebook.weight
    assert of_bare.predecessor_codebook is bare.predecessor_codebook
    assert of_bare.successor_codebook is bare.successor_codebook
    assert of_sel.hidden_projection is of_bare.hidden_projection is sel.hidden_projection.weight


def test_selector_loss_refuses_bad_arguments():
    sel, hidden, head, labels, anchors = example()
    weights = SelectorWeights.of(sel)
    with pytest.raises(ValueError, match="frozen"):
        selector_loss(weights, hidden, labels, anchors, head.requires_grad_(), B, 2.0, K)
    head.requires_grad_(False)
    with pytest.raises(ValueError, match="top_k"):
        selector_loss(weights, hidden, labels, anchors, head, B, 2.0, V + 1)
    with pytest.raises(ValueError, match="anchor_ids"):
        selector_loss(weights, hidden, labels, anchors[:1], head, B, 2.0, K)


def test_pred_is_the_selectors_own_choice_among_the_top_k_without_the_label():
    """What acceptance is counted from: the selector's argmax over the real top-K after the
    teacher-forced predecessor, which is what it drafts along an accepted run."""
    sel, hidden, head, labels, anchors = example()
    with torch.no_grad():
        sel.successor_codebook.weight.mul_(5.0)  # a pairwise term that re-ranks
    _, stats = selector_loss(SelectorWeights.of(sel), hidden, labels, anchors, head, B, 2.0, K)
    P, S, W = sel.predecessor_codebook.weight, sel.successor_codebook.weight, sel.hidden_projection.weight
    reranked = 0
    for q in range(labels.shape[1]):
        k = q % B
        prev = int(anchors[q // B]) if k == 1 else int(labels[0, q - 1])
        if labels[0, q] == X or prev == X:
            continue
        logits = head @ hidden[0, q]
        cand = logits.topk(K).indices
        scores = logits[cand] + ((P[prev] * (W @ hidden[0, q]))[None] * S[cand]).sum(-1)
        assert int(stats["pred"][0, q]) == int(cand[scores.argmax()]), q
        reranked += int(cand[scores.argmax()]) != int(logits.argmax())
    assert reranked > 0
