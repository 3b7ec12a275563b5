"""Anchors, blocks, labels, loss weights, the chunked loss and acceptance length."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_pipeline.shared.model.blocks import IGNORE_INDEX, anchor_candidates, build_blocks, sample_anchors
from dflash_pipeline.shared.model.loss import (
    acceptance_length,
    compute_logits,
    default_gamma,
    dflash_loss,
    loss_weights,
)

X = IGNORE_INDEX


def two_doc_pack():
    """doc 0 = ids 10..14 (mask 0 0 1 1 1), doc 1 = ids 20..23 (mask 0 1 1 1), one padding token."""
    ids = torch.tensor([10, 11, 12, 13, 14, 20, 21, 22, 23, 0])
    doc = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1, -1])
    pos = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 0])
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    return ids, doc, pos, mask


def test_anchor_candidates_follow_the_rule():
    _, doc, _, mask = two_doc_pack()
    # p=4 (last of doc 0: next token is doc 1's unmasked first token) and p=8 (next is padding) fail
    assert anchor_candidates(mask, doc).tolist() == [2, 3, 6, 7]
    # without doc ids the rule only looks at the mask
    assert anchor_candidates(torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)).tolist() == [0, 3, 4]
    # the anchor itself must be a trained token
    assert anchor_candidates(torch.tensor([0, 1, 1], dtype=torch.bool)).tolist() == [1]


def test_sample_anchors_is_seeded_sorted_and_without_replacement():
    mask = torch.rand(200, generator=torch.Generator().manual_seed(1)) > 0.2
    cands = set(anchor_candidates(mask).tolist())
    a = sample_anchors(mask, 30, torch.Generator().manual_seed(5))
    b = sample_anchors(mask, 30, torch.Generator().manual_seed(5))
    c = sample_anchors(mask, 30, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(a) == 30 and len(set(a.tolist())) == 30 and set(a.tolist()) <= cands
    assert torch.equal(a, a.sort().values)
    assert sample_anchors(mask, 10_000, torch.Generator()).tolist() == sorted(cands)
    assert sample_anchors(mask, 0, torch.Generator()).numel() == 0
    assert sample_anchors(torch.zeros(5, dtype=torch.bool), 3, torch.Generator()).numel() == 0


def test_build_blocks_hand_example():
    ids, doc, pos, mask = two_doc_pack()
    out = build_blocks(ids, doc, pos, mask, torch.tensor([3, 6]), num_blocks=3, block_size=4, mask_token_id=99)
    # block 0: anchor 3 (token 13, doc 0): k=1 -> token 14; k=2,3 leave doc 0 -> no label
    # block 1: anchor 6 (token 21, doc 1): k=1,2 -> 22, 23; k=3 is padding -> no label
    # block 2: padding
    assert out["block_ids"].tolist() == [13, 99, 99, 99, 21, 99, 99, 99, 99, 99, 99, 99]
    assert out["labels"].tolist() == [X, 14, X, X, X, 22, 23, X, X, X, X, X]
    assert out["block_positions"].tolist() == [3, 4, 5, 6, 1, 2, 3, 4, 0, 1, 2, 3]
    assert out["anchor_pos"].tolist() == [3, 6, 0]
    assert out["block_doc"].tolist() == [0, 1, -1]
    assert out["block_valid"].tolist() == [True, True, False]


def test_build_blocks_labels_respect_loss_mask_and_pack_end():
    ids = torch.arange(100, 108)
    doc = torch.zeros(8, dtype=torch.long)
    pos = torch.arange(8)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1], dtype=torch.bool)
    out = build_blocks(ids, doc, pos, mask, torch.tensor([1, 5]), num_blocks=2, block_size=4, mask_token_id=7)
    assert out["labels"].tolist() == [X, X, 103, 104, X, 106, 107, X]
    assert out["block_ids"].tolist() == [101, 7, 7, 7, 105, 7, 7, 7]


def test_build_blocks_rejects_bad_anchors():
    ids, doc, pos, mask = two_doc_pack()
    with pytest.raises(ValueError, match="do not fit"):
        build_blocks(ids, doc, pos, mask, torch.tensor([2, 3, 6]), 2, 4, 99)
    with pytest.raises(ValueError, match="outside the pack"):
        build_blocks(ids, doc, pos, mask, torch.tensor([10]), 2, 4, 99)
    with pytest.raises(ValueError, match="padding"):
        build_blocks(ids, doc, pos, mask, torch.tensor([9]), 2, 4, 99)


def test_loss_weights_and_default_gamma():
    w = loss_weights(4, 2.0)
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-0.5), math.exp(-1.0)])
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(4) == pytest.approx(2.0)
    assert default_gamma(32) == pytest.approx(7 + 16 / 3)
    assert default_gamma(12) == pytest.approx(5 + 2 / 3)


def naive_loss(hidden, labels, weight, B, gamma, mult, cap):
    logits = compute_logits(hidden, weight, output_multiplier=mult, softcap=cap).float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=X)
    w = loss_weights(B, gamma).repeat(labels.shape[1] // B).repeat(labels.shape[0]) * (labels.flatten() != X)
    return (ce * w).sum() / w.sum(), logits.argmax(-1)


@pytest.mark.parametrize("mult,cap", [(1.0, None), (0.7, 5.0)])
def test_dflash_loss_matches_naive_value_gradient_and_stats(mult, cap):
    g = torch.Generator().manual_seed(0)
    b, N, B, H, V = 2, 3, 4, 8, 50
    hidden = torch.randn(b, N * B, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (b, N * B), generator=g)
    labels[:, ::B] = X  # anchors
    labels[0, 5] = X
    labels[1, 8:] = X  # a padding block
    loss, stats = dflash_loss(hidden, labels, weight, B, 2.0, output_multiplier=mult, softcap=cap, chunk_tokens=3)
    (grad,) = torch.autograd.grad(loss, hidden)
    h2 = hidden.detach().clone().requires_grad_(True)
    ref, ref_pred = naive_loss(h2, labels, weight, B, 2.0, mult, cap)
    (ref_grad,) = torch.autograd.grad(ref, h2)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad, ref_grad)
    labeled = labels != X
    assert torch.equal(stats["pred"][labeled], ref_pred[labeled]) and (stats["pred"][~labeled] == -1).all()
    k = torch.arange(N * B).repeat(b, 1) % B
    for pos in range(B):
        sel = labeled & (k == pos)
        assert stats["total"][pos] == sel.sum()
        assert stats["correct"][pos] == (sel & (ref_pred == labels)).sum()
    assert stats["total"][0] == 0


def test_dflash_loss_without_labels_is_zero_and_connected():
    hidden = torch.randn(1, 8, 4, requires_grad=True)
    loss, stats = dflash_loss(hidden, torch.full((1, 8), X), torch.randn(10, 4), 4, 2.0)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert stats["total"].sum() == 0


def test_dflash_loss_refuses_trainable_head():
    with pytest.raises(ValueError, match="frozen"):
        dflash_loss(
            torch.randn(1, 4, 4), torch.zeros(1, 4, dtype=torch.long), torch.randn(5, 4, requires_grad=True), 4, 2.0
        )


def test_acceptance_length_hand_cases():
    labels = torch.tensor(
        [
            [X, 1, 2, 3, 4],
            [X, 1, 2, 3, 4],
            [X, 1, 2, 3, 4],
            [X, 1, 2, X, 4],  # the unlabeled position ends the run even though later ones match
            [X, X, X, X, X],  # a padding block
        ]
    )
    pred = torch.tensor(
        [
            [0, 1, 2, 3, 4],
            [0, 1, 9, 3, 4],
            [0, 5, 2, 3, 4],
            [0, 1, 2, X, 4],
            [0, X, X, X, X],
        ]
    )
    assert acceptance_length(pred, labels).tolist() == [5, 2, 1, 3, 1]
