"""Anchors, blocks and labels: pure functions, deterministic given a generator.

A block opened at anchor a (an index into the packed context) is what the drafter sees at inference
after accepting the token at a: position 0 holds that token, positions 1..B-1 hold the mask token and
must predict the tokens at a+1..a+B-1. The block attends to context strictly before a (see
`dflash_pipeline.shared.model.attention`), so the token at a reaches the drafter only as block input, exactly as at
inference, where the last accepted token's target features do not exist yet.

Anchor rule (the reference trainers': SpecForge draws anchors among positions whose `loss_mask` is
set; the paper says "positions whose loss_mask is set"): p qualifies iff
    loss_mask[p]  and  p + 1 < S  and  loss_mask[p + 1]  (and doc[p + 1] == doc[p] when docs are given)
i.e. the anchor is a trained (response) token, as every inference anchor is, and its block has at
least one label (a block without labels would be wasted compute). SpecForge also drops anchors
closer than B to the end of the padded batch; we keep them, their labels past the end are -100.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # a label position without loss (torch's cross-entropy default)


def anchor_candidates(loss_mask: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
    """All positions that qualify as anchors (module docstring), ascending."""
    if loss_mask.dim() != 1:
        raise ValueError(f"loss_mask must be 1-D, got shape {tuple(loss_mask.shape)}")
    mask = loss_mask.bool()
    ok = mask[:-1] & mask[1:]
    if doc is not None:
        ok = ok & (doc[:-1] == doc[1:])
    return ok.nonzero().flatten()


def sample_anchors(
    loss_mask: torch.Tensor,
    max_anchors: int,
    generator: torch.Generator,
    *,
    doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Up to `max_anchors` qualifying positions drawn without replacement, sorted (LongTensor[n])."""
    candidates = anchor_candidates(loss_mask, doc)
    if max_anchors <= 0:
        return candidates[:0]
    if len(candidates) > max_anchors:
        pick = torch.randperm(len(candidates), generator=generator)[:max_anchors]
        candidates = candidates[pick].sort().values
    return candidates


def build_blocks(
    context_ids: torch.Tensor,
    context_doc: torch.Tensor,
    context_pos: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    num_blocks: int,
    block_size: int,
    mask_token_id: int,
) -> dict[str, torch.Tensor]:
    """Block tensors of one pack for `anchors` (indices into the pack), padded to `num_blocks`.

    Returns `block_ids`, `labels`, `block_positions` ([N*B], long), `anchor_pos`, `block_doc`
    ([N], long) and `block_valid` ([N], bool). Label of block token k (k >= 1) is
    `context_ids[a+k]` if a+k is inside the pack, in the anchor's document and has `loss_mask`;
    else -100; k = 0 is never labeled. Padding blocks: mask tokens, labels -100, doc -1, invalid.
    """
    S, N, B = len(context_ids), num_blocks, block_size
    anchors = anchors.long()
    n = len(anchors)
    if n > N:
        raise ValueError(f"{n} anchors do not fit in {N} blocks")
    if n and (anchors.min() < 0 or anchors.max() >= S):
        raise ValueError(f"anchor outside the pack of {S} tokens: {anchors.min().item()}..{anchors.max().item()}")
    if n and (context_doc[anchors] < 0).any():
        raise ValueError("anchor on a padding position (doc -1)")
    k = torch.arange(B)
    index = anchors[:, None] + k[None, :]  # [n, B]
    inside = index < S
    safe = index.clamp(max=S - 1)
    labeled = inside & (context_doc[safe] == context_doc[anchors][:, None]) & loss_mask.bool()[safe] & (k[None, :] > 0)
    labels = torch.full((N, B), IGNORE_INDEX, dtype=torch.long)
    labels[:n] = torch.where(labeled, context_ids[safe].long(), IGNORE_INDEX)
    block_ids = torch.full((N, B), mask_token_id, dtype=torch.long)
    block_ids[:n, 0] = context_ids[anchors].long()
    block_positions = k.repeat(N, 1)
    block_positions[:n] = context_pos[anchors].long()[:, None] + k[None, :]
    anchor_pos = torch.zeros(N, dtype=torch.long)
    anchor_pos[:n] = anchors
    block_doc = torch.full((N,), -1, dtype=torch.long)
    block_doc[:n] = context_doc[anchors].long()
    block_valid = torch.zeros(N, dtype=torch.bool)
    block_valid[:n] = True
    return {
        "block_ids": block_ids.flatten(),
        "labels": labels.flatten(),
        "block_positions": block_positions.flatten(),
        "anchor_pos": anchor_pos,
        "block_doc": block_doc,
        "block_valid": block_valid,
    }
