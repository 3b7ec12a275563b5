"""`tau_decode`: the chain of anchors greedy decoding takes through a held-out reply, walked over the
acceptance length of a block at every anchor."""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.shared.model.blocks import anchor_candidates
from dflash_pipeline.train.decode_tau import decode_chain, every_anchor

F, T = False, True


def test_chains_follow_each_reply_and_never_cross_into_the_next():
    # doc 0: prompt, reply 2..4, a user turn at 5, reply 6..7; doc 1: reply 8..11 straight after it
    mask = torch.tensor([F, F, T, T, T, F, T, T, T, T, T, T])
    doc = torch.tensor([0] * 8 + [1] * 4)
    accepted = torch.zeros(12, dtype=torch.long)
    accepted[[2, 3, 6, 8, 9, 10]] = torch.tensor([2, 1, 2, 1, 2, 1])
    # 2 -> 4 (the reply's last token): 1 step; 6 -> 8, which starts doc 1's reply: 1 step, not more;
    # 8 -> 9 -> 11: 2 steps
    assert decode_chain(accepted, mask, doc) == (2 + 2 + 1 + 2, 4)
    # 6 -> 7, doc 0's last token (no anchor: its next token is another document's), where the chain ends
    accepted[6] = 1
    assert decode_chain(accepted, mask, doc) == (2 + 1 + 1 + 2, 4)
    assert anchor_candidates(mask, doc).tolist() == [2, 3, 6, 8, 9, 10]  # every anchor the chains may need


def test_uniform_acceptance_gives_its_own_length_and_varied_acceptance_the_decoding_rate():
    mask, doc = torch.ones(1001, dtype=torch.bool), torch.zeros(1001, dtype=torch.long)
    assert decode_chain(torch.full((1001,), 4), mask, doc) == (1000, 250)
    # per 100 positions: 90 the drafter misses (1 each), then 10 it knows, the block at each of them
    # accepting the rest of the stretch (10, 9, ..., 1): decoding takes 91 steps for 100 tokens, while
    # the mean over anchors counts the easy stretch's lengths once per position
    accepted = torch.ones(1001, dtype=torch.long)
    for start in range(0, 1000, 100):
        accepted[start + 90 : start + 100] = torch.arange(10, 0, -1)
    assert accepted[:-1].float().mean() == pytest.approx(1.45)
    assert decode_chain(accepted, mask, doc) == (1000, 910)


def test_a_missing_acceptance_length_is_an_error_not_a_hang():
    with pytest.raises(ValueError, match="anchor 1"):
        decode_chain(torch.tensor([1, 0, 1]), torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long))


def test_every_anchor_comes_in_chunks_of_one_batch():
    mask = torch.tensor([F] + [T] * 10)
    chunks = every_anchor(mask, torch.zeros(11, dtype=torch.long), 4)
    assert [c.tolist() for c in chunks] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]


def test_the_head_counts_only_the_steps_opened_in_each_replys_first_tokens():
    # doc 0: prompt 0..1, reply 2..9; doc 1: reply 10..15; the chain: 2 -> 5 -> 6 -> 9 and 10 -> 14 -> 15
    mask = torch.tensor([F, F] + [T] * 14)
    doc = torch.tensor([0] * 10 + [1] * 6)
    accepted = torch.ones(16, dtype=torch.long)
    accepted[[2, 5, 6, 10, 14]] = torch.tensor([3, 1, 3, 4, 1])
    assert decode_chain(accepted, mask, doc) == (3 + 1 + 3 + 4 + 1, 5)
    # within 4 tokens of each reply's start: anchors 2 and 5 (not 6), 10 (not 14)
    assert decode_chain(accepted, mask, doc, within=4) == (3 + 1 + 4, 3)
    assert decode_chain(accepted, mask, doc, within=100) == decode_chain(accepted, mask, doc)
