"""The held-out acceptance that greedy speculative decoding would measure (`tau_decode`).

The trainer's `tau` is the mean acceptance length over anchors drawn uniformly from the reply
positions. Decoding draws no anchors: after a block yields `a` tokens the next block opens `a`
positions on, so a long accepted run is one step and a stretch of rejections is one step per token.
Its tau (tokens per step along that chain) is close to the harmonic mean of the acceptance lengths,
not their mean, and lower wherever they vary: lengths of 1 at 90% of the positions and 3.7 at 10%
average 1.27 over anchors but give ~1.08 per decoding step. Here every position of each held-out
reply is an anchor, and the chain a decoder would take is walked through their acceptance lengths,
so the number compares with `dflash-eval`'s greedy tau on the same kind of text.
"""

from __future__ import annotations

import torch

from dflash_pipeline.shared.model.blocks import anchor_candidates


def every_anchor(mask: torch.Tensor, doc: torch.Tensor, per_chunk: int) -> list[torch.Tensor]:
    """All of a pack's anchors (`anchor_candidates`), in chunks of at most `per_chunk` (one batch each)."""
    return list(anchor_candidates(mask, doc).split(per_chunk))


def decode_chain(accepted: torch.Tensor, mask: torch.Tensor, doc: torch.Tensor) -> tuple[int, int]:
    """(tokens, steps) of greedy decoding through every reply of a pack: `accepted[p]` is the
    acceptance length of the block opened at anchor p (other positions are not read). A reply is a
    run of loss-masked positions of one document; decoding starts at its first token (the one the
    prefill produced) and opens blocks until the anchor reaches the reply's last token."""
    in_reply = mask.bool()
    new_doc = torch.ones(len(doc), dtype=torch.bool)
    new_doc[1:] = doc[1:] != doc[:-1]
    starts = in_reply & (new_doc | ~torch.cat([torch.zeros(1, dtype=torch.bool), in_reply[:-1]]))
    ends = in_reply & (new_doc.roll(-1) | ~torch.cat([in_reply[1:], torch.zeros(1, dtype=torch.bool)]))
    ends[-1] = bool(in_reply[-1])
    length = accepted.tolist()
    tokens = steps = 0
    for first, last in zip(starts.nonzero().flatten().tolist(), ends.nonzero().flatten().tolist()):
        p = first
        while p < last:  # the reply's last token opens no block: nothing is left to draft
            if length[p] < 1:
                raise ValueError(f"anchor {p} has no acceptance length (each is >= 1)")
            tokens += length[p]
            steps += 1
            p += length[p]
    return tokens, steps
