"""The DFlash loss over blocks: position-weighted cross-entropy through the target's frozen LM head,
the logits it is computed from, and the acceptance length it is judged by."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_pipeline.shared.model.blocks import IGNORE_INDEX

# gamma of the position weights, from the paper (sec. 5): B=16 -> 7, B=10 -> 5, B=8 -> 4
_PAPER_GAMMA = ((8, 4.0), (10, 5.0), (16, 7.0))


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
        raise ValueError(
            f"labels {tuple(labels.shape)} must be [{batch}, {Q}] with {Q} a multiple of block_size {block_size}"
        )
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
            _chunk_loss,
            row_hidden[part],
            row_labels[part],
            row_weights[part],
            lm_head_weight,
            output_multiplier,
            softcap,
            use_reentrant=False,
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
