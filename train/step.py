"""The drafter's forward on a batch of packs, shared by training and held-out evaluation."""

from __future__ import annotations

import torch

from dflash_pipeline.shared.model.attention import build_block_mask, dense_mask
from dflash_pipeline.shared.model.config import DFlashConfig, LayerAttention
from dflash_pipeline.shared.model.drafter import DFlashDrafter, Mask
from dflash_pipeline.shared.model.loss import SelectorWeights, acceptance_length, dflash_loss, selector_loss
from dflash_pipeline.shared.model.target_head import TargetHead
from dflash_pipeline.shared.store.fp8 import dequantize
from dflash_pipeline.train.metrics import LOSS_TERMS

FLEX_BACKENDS = ("flex_compiled", "flex_eager")


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def attention_masks(batch: dict[str, torch.Tensor], config: DFlashConfig, backend: str) -> dict[LayerAttention, Mask]:
    """One BlockMask (flex) or dense bool mask (SDPA reference) for a batch of packs per kind of layer
    the drafter has (`config.layer_attention`: causal or not, its window)."""
    args = dict(
        anchor_pos=batch["anchor_pos"],
        block_doc=batch["block_doc"],
        block_valid=batch["block_valid"],
        context_doc=batch["context_doc"],
        block_size=config.block_size,
    )
    device = batch["anchor_pos"].device
    masks = {}
    for kind in dict.fromkeys(config.layer_attention):
        if backend in FLEX_BACKENDS:
            masks[kind] = build_block_mask(
                **args, window=kind.window, causal=kind.causal, device=device, compile=device.type == "cuda"
            )
        else:
            masks[kind] = dense_mask(**args, window=kind.window, causal=kind.causal)
    return masks


def compiled_drafter(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (the drafter, or DDP around it) compiled as one graph for `dflash-train --compile-drafter`:
    static shapes, since every training pack has the same tokens and blocks; `pack_loss(compiled=True)`
    compiles the loss beside it."""
    return torch.compile(model, dynamic=False)


def drafter_hidden(model, head: TargetHead, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Drafter output states [b, N*B, H] for the blocks of a batch; the masks are built for the attention
    backend the drafter carries (set once, where the drafter is built)."""
    core: DFlashDrafter = getattr(model, "module", model)
    cfg = core.config
    dtype = core.fc.weight.dtype
    embeds = head.embed(batch["block_ids"], cfg.input_embedding_scale, dtype=dtype)
    masks = attention_masks(batch, cfg, core.attention_backend)
    context = context_states(batch, dtype)
    return model(context, embeds, batch["context_positions"], batch["block_positions"], masks)


def context_states(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The batch's context states in `dtype`; an fp8 store's codes are dequantized here, on the
    training device, so the loader and the host->device copy move half of bf16's bytes."""
    if "context_scales" in batch:
        return dequantize(batch["context_hidden"], batch["context_scales"], dtype)
    return batch["context_hidden"].to(dtype)


# the share of the KL term in the draft loss for each --loss (mix: --kl-weight)
LOSSES = ("ce", "kl", "mix")


def kl_share(loss: str, kl_weight: float) -> float:
    """The weight of the KL term in `(1 - a) * ce + a * kl` for `dflash-train --loss`."""
    return {"ce": 0.0, "kl": 1.0, "mix": kl_weight}[loss]


def pack_loss(
    model,
    head: TargetHead,
    batch: dict[str, torch.Tensor],
    gamma: float,
    selector_loss_weight: float = 1.0,
    kl_weight: float = 0.0,
    compiled: bool = False,
):
    """Weighted CE of a batch: (sum of w*ce, sum of w, per-position stats incl. predictions); for a
    DFlash-2 drafter the CE plus `selector_loss_weight` times its selector's loss (`selector_loss`).
    `kl_weight` > 0 (`kl_share` of --loss kl/mix; the batch then carries `target_topk_ids` /
    `target_topk_logprobs`): the draft CE becomes `(1 - kl_weight) * ce + kl_weight * kl` against the
    target's stored top-K distribution (for DFlash-2 only its draft term; the selector's stays).

    `compiled`: the loss's chunks run compiled (`dflash-train --compile-drafter`, which also compiles `model`).
    The sum (not the mean) is returned so the caller can normalise by the weight of all ranks.
    `stats["pred"]` is the LM head's argmax in both cases (not the selector's choice).
    """
    core: DFlashDrafter = getattr(model, "module", model)
    cfg = core.config
    hidden = drafter_hidden(model, head, batch)
    lm_head = head.lm_head.to(hidden.dtype)
    common = dict(output_multiplier=cfg.output_multiplier, softcap=cfg.final_logit_softcapping, compiled=compiled)
    if kl_weight > 0:
        if "target_topk_ids" not in batch:
            raise ValueError("a kl/mix loss needs batches with the target's top-k (PackSpec.topk)")
        common.update(target_topk=(batch["target_topk_ids"], batch["target_topk_logprobs"]), kl_weight=kl_weight)
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


def loss_term_sums(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The loss's separate terms as sums over rows (term x weight sum), keyed by their metrics names, so
    that summed over ranks and divided by the global weight they are means like the loss. DFlash-2:
    `ce_loss` and the selector's unweighted `selector_loss` (loss = ce_loss + weight x selector_loss);
    DFlash: none, its loss is the CE alone and its records stay as they were."""
    weight = stats["weight_sum"]
    return {key: float(stats[name] * weight) for name, key in LOSS_TERMS.items() if name in stats}


def block_acceptance(batch: dict[str, torch.Tensor], pred: torch.Tensor, block_size: int) -> torch.Tensor:
    """Accepted tokens per valid block (1 + leading correct drafts) against the stored ground truth;
    `pred` is `pack_loss`'s prediction (for DFlash-2 the selector's choice, see `selector_loss`)."""
    labels = batch["labels"].reshape(-1, block_size)
    valid = batch["block_valid"].reshape(-1)
    return acceptance_length(pred.reshape(-1, block_size)[valid], labels[valid]).float()
