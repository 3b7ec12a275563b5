"""The drafter's forward on a batch of packs, shared by training and held-out evaluation."""

from __future__ import annotations

import torch

from dflash_pipeline.shared.model.attention import build_block_mask, dense_mask
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.shared.model.loss import SelectorWeights, acceptance_length, dflash_loss, selector_loss
from dflash_pipeline.shared.model.target_head import TargetHead

FLEX_BACKENDS = ("flex_compiled", "flex_eager")


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def attention_mask(batch: dict[str, torch.Tensor], block_size: int, backend: str, window: int | None):
    """The BlockMask (flex) or dense bool mask (SDPA reference) for a batch of packs."""
    args = dict(
        anchor_pos=batch["anchor_pos"],
        block_doc=batch["block_doc"],
        block_valid=batch["block_valid"],
        context_doc=batch["context_doc"],
        block_size=block_size,
        window=window,
    )
    if backend in FLEX_BACKENDS:
        device = batch["anchor_pos"].device
        return build_block_mask(**args, device=device, compile=device.type == "cuda")
    return dense_mask(**args)


def drafter_hidden(model, head: TargetHead, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Drafter output states [b, N*B, H] for the blocks of a batch; the mask is built for the attention
    backend the drafter carries (set once, where the drafter is built)."""
    core: DFlashDrafter = getattr(model, "module", model)
    cfg = core.config
    dtype = core.fc.weight.dtype
    embeds = head.embed(batch["block_ids"], cfg.input_embedding_scale, dtype=dtype)
    mask = attention_mask(batch, cfg.block_size, core.attention_backend, cfg.sliding_window)
    context = batch["context_hidden"].to(dtype)
    return model(context, embeds, batch["context_positions"], batch["block_positions"], mask)


def pack_loss(model, head: TargetHead, batch: dict[str, torch.Tensor], gamma: float, selector_loss_weight: float = 1.0):
    """Weighted CE of a batch: (sum of w*ce, sum of w, per-position stats incl. predictions); for a
    DFlash-2 drafter the CE plus `selector_loss_weight` times its selector's loss (`selector_loss`).

    The sum (not the mean) is returned so the caller can normalise by the weight of all ranks.
    `stats["pred"]` is the LM head's argmax in both cases (not the selector's choice).
    """
    core: DFlashDrafter = getattr(model, "module", model)
    cfg = core.config
    hidden = drafter_hidden(model, head, batch)
    lm_head = head.lm_head.to(hidden.dtype)
    common = dict(output_multiplier=cfg.output_multiplier, softcap=cfg.final_logit_softcapping)
    if cfg.arch == "dflash2":
        # the anchor token opens each block: it is the selector's teacher-forced predecessor at k = 1
        anchor_ids = batch["block_ids"].reshape(-1, cfg.block_size)[:, 0]
        mean, stats = selector_loss(
            SelectorWeights.of(core.candidate_selector),
            hidden,
            batch["labels"],
            anchor_ids,
            lm_head,
            cfg.block_size,
            gamma,
            cfg.selector_top_k,
            selector_loss_weight=selector_loss_weight,
            **common,
        )
    else:
        mean, stats = dflash_loss(hidden, batch["labels"], lm_head, cfg.block_size, gamma, **common)
    return mean * stats["weight_sum"], stats["weight_sum"], stats


def block_acceptance(batch: dict[str, torch.Tensor], pred: torch.Tensor, block_size: int) -> torch.Tensor:
    """Accepted tokens per valid block (1 + leading correct drafts) against the stored ground truth;
    `pred` is `pack_loss`'s prediction (for DFlash-2 the selector's choice, see `selector_loss`)."""
    labels = batch["labels"].reshape(-1, block_size)
    valid = batch["block_valid"].reshape(-1)
    return acceptance_length(pred.reshape(-1, block_size)[valid], labels[valid]).float()
