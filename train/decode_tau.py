"""The held-out acceptance that greedy speculative decoding would measure (`tau_decode`).

The trainer's `tau` is the mean acceptance length over anchors drawn uniformly from the reply
positions. Decoding draws no anchors: after a block yields `a` tokens the next block opens `a`
positions on, so a long accepted run is one step and a stretch of rejections is one step per token.
Where the lengths vary the two differ, in either direction: a stretch the drafter knows counts once per
position in the mean (10, 9, ..., 1) but is a single decoding step, and a jump skips the positions it
covers. Here every position of each held-out reply is an anchor, and the chain a decoder would take
is walked through their acceptance lengths, so the number compares with `dflash-eval`'s greedy tau
on the same kind of text.
"""

from __future__ import annotations

import torch

from dflash_pipeline.shared.model.blocks import anchor_candidates


def every_anchor(mask: torch.Tensor, doc: torch.Tensor, per_chunk: int) -> list[torch.Tensor]:
    """All of a pack's anchors (`anchor_candidates`), in chunks of at most `per_chunk` (one batch each)."""
    return list(anchor_candidates(mask, doc).split(per_chunk))


def decode_chain(
    accepted: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor, within: int | None = None
) -> tuple[int, int]:
    """(tokens, steps) of greedy decoding through every reply of a pack: `accepted[p]` is the
    acceptance length of the block opened at anchor p (other positions are not read). A reply is a
    run of loss-masked positions of one document; decoding starts at its first token (the one the
    prefill produced) and opens blocks until the anchor reaches the reply's last token. With
    `within`, only the steps opened within a reply's first `within` positions count: what an online
    evaluation of that many new tokens decodes (a reply the pack cut counts from the pack's start)."""
    in_reply = mask.bool()
    # boundary[i]: a new run of positions begins at i (the document or the loss mask changes there)
    boundary = torch.ones(len(mask) + 1, dtype=torch.bool)
    boundary[1:-1] = (doc[1:] != doc[:-1]) | (in_reply[1:] != in_reply[:-1])
    firsts = (boundary[:-1] & in_reply).nonzero().flatten().tolist()
    lasts = (boundary[1:] & in_reply).nonzero().flatten().tolist()
    length = accepted.tolist()
    tokens = steps = 0
    for first, last in zip(firsts, lasts):
        p = first
        end = last if within is None else min(last, first + within)
        while p < end:  # the reply's last token opens no block: nothing is left to draft
            if length[p] < 1:
                raise ValueError(f"anchor {p} has no acceptance length (each is >= 1)")
            tokens += length[p]
            steps += 1
            p += length[p]
    return tokens, steps
