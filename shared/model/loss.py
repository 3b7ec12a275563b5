"""The DFlash loss over blocks: position-weighted cross-entropy through the target's frozen LM head,
the logits it is computed from, and the acceptance length it is judged by; and the DFlash-2 objective,
which adds the candidate selector's K-way cross-entropy to that CE."""

from __future__ import annotations

from dataclasses import dataclass

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


def _labeled_rows(hidden: torch.Tensor, labels: torch.Tensor, block_size: int, gamma: float):
    """Flat labels, the indices of labeled rows, their block positions and their position weights."""
    batch, Q, _ = hidden.shape
    if labels.shape != (batch, Q) or Q % block_size:
        raise ValueError(
            f"labels {tuple(labels.shape)} must be [{batch}, {Q}] with {Q} a multiple of block_size {block_size}"
        )
    device = hidden.device
    position = (torch.arange(Q, device=device) % block_size).repeat(batch)
    flat_labels = labels.reshape(-1).to(device)
    rows = (flat_labels != IGNORE_INDEX).nonzero().flatten()
    row_position = position[rows]
    return flat_labels, rows, row_position, loss_weights(block_size, gamma).to(device)[row_position]


def _prediction_stats(
    labels, flat_labels, rows, row_position, preds, block_size, weight_sum
) -> dict[str, torch.Tensor]:
    """`dflash_loss`'s stats from the per-chunk predictions of the labeled rows; `pred` is shaped like `labels`."""
    row_labels = flat_labels[rows]
    row_pred = torch.cat(preds) if preds else row_labels.clone()
    pred = torch.full_like(flat_labels, -1)
    pred[rows] = row_pred
    hit = row_pred == row_labels
    return {
        "correct": torch.bincount(row_position[hit], minlength=block_size),
        "total": torch.bincount(row_position, minlength=block_size),
        "pred": pred.view(labels.shape),
        "weight_sum": weight_sum.detach(),
    }


def topk_kl(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, p the target's stored top-K distribution renormalised over its K tokens
    (softmax of the stored log-probs), q the drafter's softmax over the whole vocabulary:
    sum_i p_i (log p_i - log q(id_i)). logits [R, V] float32, topk_ids / topk_logprobs [R, K] -> [R]."""
    log_q = torch.log_softmax(logits, dim=-1).gather(1, topk_ids.long())
    log_p = torch.log_softmax(topk_logprobs.float(), dim=-1)
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(dim=-1)


def draft_term(
    logits: torch.Tensor,
    labels: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
    kl_weight: float = 0.0,
) -> torch.Tensor:
    """The per-row loss of the draft tokens: CE on the stored tokens (no top-K given), or
    `(1 - kl_weight) * ce + kl_weight * topk_kl` (kl_weight 1: the KL alone, no CE computed)."""
    if topk_ids is None or kl_weight == 0.0:
        return F.cross_entropy(logits, labels, reduction="none")
    kl = topk_kl(logits, topk_ids, topk_logprobs)
    if kl_weight == 1.0:
        return kl
    return (1.0 - kl_weight) * F.cross_entropy(logits, labels, reduction="none") + kl_weight * kl


def _chunk_loss(
    hidden,
    labels,
    weights,
    lm_head_weight,
    output_multiplier,
    softcap,
    topk_ids=None,
    topk_logprobs=None,
    kl_weight=0.0,
):
    logits = compute_logits(hidden, lm_head_weight, output_multiplier=output_multiplier, softcap=softcap).float()
    ce = draft_term(logits, labels, topk_ids, topk_logprobs, kl_weight)
    return (ce * weights).sum(), logits.argmax(dim=-1)


_compiled_chunks: dict = {}


def _chunk_fn(fn, compiled: bool):
    """`fn`, or `torch.compile(fn, dynamic=True)` made once per process: the rows of a chunk vary with
    the batch's labels, so one graph serves every row count (fused casts, log-softmax and argmax)."""
    if not compiled:
        return fn
    if fn not in _compiled_chunks:
        _compiled_chunks[fn] = torch.compile(fn, dynamic=True)
    return _compiled_chunks[fn]


def _target_rows(target_topk, rows: torch.Tensor, labels_shape) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The labeled rows' stored top-K (ids, log-probs), each [b, Q, K] aligned with the labels."""
    if target_topk is None:
        return None, None
    ids, logprobs = target_topk
    if ids.shape[:-1] != tuple(labels_shape) or logprobs.shape != ids.shape:
        raise ValueError(f"target top-k {tuple(ids.shape)} / {tuple(logprobs.shape)} must be [*labels, K]")
    K = ids.shape[-1]
    return ids.reshape(-1, K).index_select(0, rows), logprobs.reshape(-1, K).index_select(0, rows)


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
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    kl_weight: float = 1.0,
    compiled: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Position-weighted CE `sum(ce * w_k) / sum(w_k)` over labeled block positions.

    With `target_topk` (ids, log-probs), each [b, Q, K] aligned with `labels` (row of block position k
    of anchor a: the target's distribution at context position a+k-1, the one that predicts the label
    a+k), `ce` is replaced by `draft_term`: `(1 - kl_weight) * ce + kl_weight * KL(target top-K
    renormalised || drafter)`, same position weights (`--loss kl`: kl_weight 1, `--loss mix`: between).

    Only labeled rows get logits, `chunk_tokens` rows at a time; each chunk runs under activation
    checkpointing, so its fp32 [chunk, vocab] logits are freed after forward and recomputed in
    backward: peak memory is one chunk's logits, never [Q, vocab]. The LM head is frozen (no grad).
    `compiled`: each chunk runs compiled (`_chunk_fn`), the same sums to float rounding.

    stats: `correct` / `total` LongTensor[B] (per block position; k = 0 always 0), `pred`
    LongTensor like `labels` with argmax predictions at labeled positions and -1 elsewhere, and
    `weight_sum` (the denominator, for averaging over ranks).
    """
    if lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight must be frozen (requires_grad=False)")
    H = hidden.shape[-1]
    flat_labels, rows, row_position, row_weights = _labeled_rows(hidden, labels, block_size, gamma)
    row_labels = flat_labels[rows]
    row_hidden = hidden.reshape(-1, H).index_select(0, rows)
    row_ids, row_logprobs = _target_rows(target_topk, rows.to(hidden.device), labels.shape)
    total = hidden.sum() * 0.0  # keeps the graph (and DDP) connected when nothing is labeled
    preds = []
    for start in range(0, len(rows), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        ce_sum, pred = checkpoint(
            _chunk_fn(_chunk_loss, compiled),
            row_hidden[part],
            row_labels[part],
            row_weights[part],
            lm_head_weight,
            output_multiplier,
            softcap,
            *(() if row_ids is None else (row_ids[part], row_logprobs[part], kl_weight)),
            use_reentrant=False,
        )
        total = total + ce_sum
        preds.append(pred)
    weight_sum = row_weights.sum()
    loss = total / weight_sum.clamp_min(torch.finfo(torch.float32).tiny)
    stats = _prediction_stats(labels, flat_labels, rows, row_position, preds, block_size, weight_sum)
    return loss, stats


@dataclass(frozen=True)
class SelectorWeights:
    """The DFlash-2 candidate selector's parameters as tensors, so the loss does not depend on the module
    holding them: codebooks [vocab, rank], hidden projection [rank, H] (the nn.Linear weight layout)."""

    predecessor_codebook: torch.Tensor
    successor_codebook: torch.Tensor
    hidden_projection: torch.Tensor

    @classmethod
    def of(cls, selector: torch.nn.Module) -> SelectorWeights:
        """From a module laid out like the reference's `CandidateSelector`; a codebook may be an
        nn.Embedding or a bare parameter (as the released checkpoints name them)."""

        def tensor(part):
            return part if isinstance(part, torch.Tensor) else part.weight

        return cls(
            tensor(selector.predecessor_codebook),
            tensor(selector.successor_codebook),
            selector.hidden_projection.weight,
        )


def selector_scores(
    weights: SelectorWeights,
    hidden: torch.Tensor,
    unary: torch.Tensor,
    candidates: torch.Tensor,
    predecessors: torch.Tensor,
) -> torch.Tensor:
    """The reference's candidate score (`CandidateSelector.select`), in fp32:
    scores[r, k] = unary[r, k] + <P[predecessors[r]] * (W hidden[r]), S[candidates[r, k]]>.
    hidden [R, H], unary and candidates [R, K], predecessors [R] -> [R, K]."""
    projected = F.linear(hidden, weights.hidden_projection).float()
    left = F.embedding(predecessors, weights.predecessor_codebook).float() * projected
    right = F.embedding(candidates, weights.successor_codebook).float()
    return unary.float() + torch.einsum("rd,rkd->rk", left, right)


def _chunk_selector_loss(
    hidden,
    labels,
    predecessors,
    weights,
    selector_weights,
    lm_head_weight,
    predecessor_codebook,
    successor_codebook,
    hidden_projection,
    output_multiplier,
    softcap,
    top_k,
    topk_ids=None,
    topk_logprobs=None,
    kl_weight=0.0,
):
    logits = compute_logits(hidden, lm_head_weight, output_multiplier=output_multiplier, softcap=softcap).float()
    ce = draft_term(logits, labels, topk_ids, topk_logprobs, kl_weight)
    top = logits.topk(top_k, dim=-1).indices  # sorted: the last one scores lowest
    selector = SelectorWeights(predecessor_codebook, successor_codebook, hidden_projection)
    with torch.no_grad():  # the selector's own choice, blind to the label: what it would draft
        honest = selector_scores(selector, hidden, logits.gather(1, top), top, predecessors)
        choice = top.gather(1, honest.argmax(dim=-1, keepdim=True))[:, 0]
    missing = (top != labels[:, None]).all(dim=-1)
    last = torch.where(missing, labels, top[:, -1])
    candidates = torch.cat([top[:, :-1], last[:, None]], dim=1)  # label injection
    target = (candidates == labels[:, None]).long().argmax(dim=-1)
    scores = selector_scores(selector, hidden, logits.gather(1, candidates), candidates, predecessors)
    selector_ce = F.cross_entropy(scores, target, reduction="none")
    return (ce * weights).sum(), (selector_ce * selector_weights).sum(), choice


def selector_loss(
    selector: SelectorWeights,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    anchor_ids: torch.Tensor,
    lm_head_weight: torch.Tensor,
    block_size: int,
    gamma: float,
    top_k: int,
    *,
    selector_loss_weight: float = 1.0,
    output_multiplier: float = 1.0,
    softcap: float | None = None,
    chunk_tokens: int = 2048,
    target_topk: tuple[torch.Tensor, torch.Tensor] | None = None,
    kl_weight: float = 1.0,
    compiled: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DFlash-2 objective `(sum(w_k * ce) + selector_loss_weight * sum(w_k * sel)) / sum(w_k)`.

    `ce` is `dflash_loss`'s CE and `w_k` its position weights. `sel` is the K-way CE of the selector's
    scores (`selector_scores`) over the top-`top_k` draft tokens of the row, the label replacing the
    lowest of them when it is missing (so it always has a target), with the teacher-forced predecessor:
    the anchor token (`anchor_ids`, one per block) at k = 1, the label at k - 1 after. A row whose
    previous position is unlabeled has no known predecessor and only the CE term. Both terms share
    the denominator, so `loss * weight_sum` is a sum over rows, as `pack_loss` needs for DDP.

    hidden [b, Q, H] (drafter states; [N, B, H] is b = N, Q = B), labels [b, Q], anchor_ids
    [b * Q / B]. The logits are made `chunk_tokens` rows at a time under checkpointing, as in
    `dflash_loss`, and serve both terms. The LM head is frozen. stats: `dflash_loss`'s, plus `ce` and
    `selector` (the two terms, each over `weight_sum`, detached: loss = ce + weight * selector);
    `pred` is the selector's own greedy choice among the top-`top_k` (no label injected) after the
    teacher-forced predecessor, which along an accepted run is the token it drafts at inference, so
    the acceptance counted from it is the selector's. `target_topk` / `kl_weight` replace the draft
    CE term only, as in `dflash_loss` (`draft_term`); the selector's term always learns to pick the
    stored token among the candidates (stats `ce` is then that draft term). `compiled` as in `dflash_loss`.
    """
    if lm_head_weight.requires_grad:
        raise ValueError("lm_head_weight must be frozen (requires_grad=False)")
    if not 1 <= top_k <= lm_head_weight.shape[0]:
        raise ValueError(f"top_k {top_k} must be in [1, vocab {lm_head_weight.shape[0]}]")
    batch, Q, H = hidden.shape
    flat_labels, rows, row_position, row_weights = _labeled_rows(hidden, labels, block_size, gamma)
    anchor_ids = anchor_ids.reshape(-1).to(hidden.device)
    if anchor_ids.numel() != batch * Q // block_size:
        raise ValueError(f"anchor_ids has {anchor_ids.numel()} tokens for {batch * Q // block_size} blocks")
    row_labels = flat_labels[rows]
    previous = torch.where(row_position <= 1, anchor_ids[rows // block_size], flat_labels[(rows - 1).clamp_min(0)])
    known = previous != IGNORE_INDEX
    predecessors = torch.where(known, previous, 0)
    row_hidden = hidden.reshape(-1, H).index_select(0, rows)
    row_ids, row_logprobs = _target_rows(target_topk, rows.to(hidden.device), labels.shape)
    params = (selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection)
    # zero terms keep the graph (and DDP) connected to every input when nothing is labeled
    ce_total = hidden.sum() * 0.0
    selector_total = sum(p.sum() for p in params) * 0.0
    preds = []
    for start in range(0, len(rows), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        ce_sum, selector_sum, pred = checkpoint(
            _chunk_fn(_chunk_selector_loss, compiled),
            row_hidden[part],
            row_labels[part],
            predecessors[part],
            row_weights[part],
            (row_weights * known)[part],
            lm_head_weight,
            *params,
            output_multiplier,
            softcap,
            top_k,
            *(() if row_ids is None else (row_ids[part], row_logprobs[part], kl_weight)),
            use_reentrant=False,
        )
        ce_total = ce_total + ce_sum
        selector_total = selector_total + selector_sum
        preds.append(pred)
    weight_sum = row_weights.sum()
    denominator = weight_sum.clamp_min(torch.finfo(torch.float32).tiny)
    ce, selector_term = ce_total / denominator, selector_total / denominator
    stats = _prediction_stats(labels, flat_labels, rows, row_position, preds, block_size, weight_sum)
    stats.update(ce=ce.detach(), selector=selector_term.detach())
    return ce + selector_loss_weight * selector_term, stats


def acceptance_length(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Tokens a block would yield under greedy verification: 1 (the target's own token) plus the
    number of leading positions k = 1.. whose prediction equals the label; an unlabeled position
    ends the run. pred, labels: [N, B] -> LongTensor[N]. Exclude invalid blocks before averaging."""
    hit = (pred[:, 1:] == labels[:, 1:]) & (labels[:, 1:] != IGNORE_INDEX)
    return 1 + hit.long().cumprod(dim=1).sum(dim=1)
