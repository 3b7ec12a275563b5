"""Anchors, blocks, labels and the DFlash loss: pure functions, deterministic given a generator.

A block opened at anchor a (an index into the packed context) is what the drafter sees at inference
after accepting the token at a: position 0 holds that token, positions 1..B-1 hold the mask token and
must predict the tokens at a+1..a+B-1. The block attends to context strictly before a (see
`dflash_pipeline.shared.attention`), so the token at a reaches the drafter only as block input, exactly as at
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
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100

# gamma of the position weights, from the paper (sec. 5): B=16 -> 7, B=10 -> 5, B=8 -> 4
_PAPER_GAMMA = ((8, 4.0), (10, 5.0), (16, 7.0))


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


def default_gamma(block_size: int) -> float:
    """The paper's gamma (8 -> 4, 10 -> 5, 16 -> 7), piecewise linear between those points and
    extended with the slope of the nearest segment outside them (floor 0.5): e.g. 4 -> 2, 32 -> 12.33."""
    (b0, g0), (b1, g1), (b2, g2) = _PAPER_GAMMA
    if block_size <= b1:
        gamma = g0 + (block_size - b0) * (g1 - g0) / (b1 - b0)
    else:
        gamma = g1 + (block_size - b1) * (g2 - g1) / (b2 - b1)
    return max(0.5, gamma)


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1 and 0 for the anchor position k = 0 (float32 [B])."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def compute_logits(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    output_multiplier: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Target LM head on drafter states, times `output_multiplier`, then tanh soft-cap if set (> 0),
    as the reference's `compute_logits` does."""
    logits = F.linear(hidden, lm_head_weight)
    if output_multiplier != 1.0:
        logits = logits * output_multiplier
    if softcap is not None and softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _chunk_loss(hidden, labels, weights, lm_head_weight, output_multiplier, softcap):
    logits = compute_logits(hidden, lm_head_weight, output_multiplier=output_multiplier, softcap=softcap).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (ce * weights).sum(), logits.argmax(dim=-1)


def dflash_loss(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head_weight: torch.Tensor,
    block_size: int,
    gamma: float,
    *,
    output_multiplier: float = 1.0,
    softcap: float | None = None,
    chunk_tokens: int = 2048,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Position-weighted CE `sum(ce * w_k) / sum(w_k)` over labeled block positions.

    Only labeled rows get logits, `chunk_tokens` rows at a time; each chunk runs under activation
    checkpointing, so its fp32 [chunk, vocab] logits are freed after forward and recomputed in
    backward: peak memory is one chunk's logits, never [Q, vocab]. The LM head is frozen (no grad).

    stats: `correct` / `total` LongTensor[B] (per block position; k = 0 always 0), `pred`
    LongTensor like `labels` with argmax predictions at labeled positions and -1 elsewhere, and
    `weight_sum` (the denominator, for averaging over ranks).
    """
    if lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight must be frozen (requires_grad=False)")
    batch, Q, H = hidden.shape
    if labels.shape != (batch, Q) or Q % block_size:
        raise ValueError(f"labels {tuple(labels.shape)} must be [{batch}, {Q}] with {Q} a multiple of block_size {block_size}")
    device = hidden.device
    position = (torch.arange(Q, device=device) % block_size).repeat(batch)
    flat_labels = labels.reshape(-1).to(device)
    rows = (flat_labels != IGNORE_INDEX).nonzero().flatten()
    row_position = position[rows]
    row_labels = flat_labels[rows]
    row_weights = loss_weights(block_size, gamma).to(device)[row_position]
    row_hidden = hidden.reshape(-1, H).index_select(0, rows)
    total = hidden.sum() * 0.0  # keeps the graph (and DDP) connected when nothing is labeled
    preds = []
    for start in range(0, len(rows), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        ce_sum, pred = checkpoint(
            _chunk_loss, row_hidden[part], row_labels[part], row_weights[part], lm_head_weight,
            output_multiplier, softcap, use_reentrant=False,
        )
        total = total + ce_sum
        preds.append(pred)
    weight_sum = row_weights.sum()
    loss = total / weight_sum.clamp_min(torch.finfo(torch.float32).tiny)
    row_pred = torch.cat(preds) if preds else row_labels.clone()
    pred = torch.full_like(flat_labels, -1)
    pred[rows] = row_pred
    hit = row_pred == row_labels
    stats = {
        "correct": torch.bincount(row_position[hit], minlength=block_size),
        "total": torch.bincount(row_position, minlength=block_size),
        "pred": pred.view(batch, Q),
        "weight_sum": weight_sum.detach(),
    }
    return loss, stats


def acceptance_length(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Tokens a block would yield under greedy verification: 1 (the target's own token) plus the
    number of leading positions k = 1.. whose prediction equals the label; an unlabeled position
    ends the run. pred, labels: [N, B] -> LongTensor[N]. Exclude invalid blocks before averaging."""
    hit = (pred[:, 1:] == labels[:, 1:]) & (labels[:, 1:] != IGNORE_INDEX)
    return 1 + hit.long().cumprod(dim=1).sum(dim=1)
