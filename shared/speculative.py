"""DFlash speculative decoding (greedy, batch 1) and the plain target-only baseline.

Each step the drafter drafts one block: position 0 is the last token the target produced, the other
B-1 positions are mask tokens; the drafter sees the target's features of every accepted token
through its context KV cache. The target then verifies the whole block in one forward; the longest
prefix of drafts equal to the target's own argmax is accepted, plus the target's next token. Greedy
output is therefore exactly the target's greedy output (lossless); only the speed changes.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from dflash_pipeline.extract.target import HiddenStateCapture
from dflash_pipeline.shared.drafter import DFlashDrafter, DrafterCache


@dataclass
class Generation:
    tokens: list[int]  # generated ids (prompt excluded)
    seconds: float
    accepted: list[int] = field(default_factory=list)  # tokens produced per target verify step

    @property
    def tau(self) -> float:
        """Mean tokens per target forward in decoding (accepted drafts + the bonus token)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stop_at(tokens: list[int], stop_ids: set[int], limit: int) -> list[int]:
    for i, t in enumerate(tokens[:limit]):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens[:limit]


def _cache_kwarg(target: nn.Module) -> str:
    """Name of the forward's KV-cache argument: `cache` in newer transformers (5.24 warns on
    `past_key_values`, removed in 5.40), `past_key_values` in older ones (5.17 has no `cache`)."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def _truncate_cache(cache: DynamicCache, length: int) -> None:
    """Drop cached positions from `length` on. A negative `crop` argument means "remove this many"
    in every transformers version we support (the meaning of a positive one changed in 5.x)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


@torch.inference_mode()
def target_greedy(target: nn.Module, prompt: torch.Tensor, max_new_tokens: int, stop_ids: set[int]) -> Generation:
    """Target-only greedy decoding with a KV cache: the baseline and the reference output."""
    device = prompt.device
    _sync(device)
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    kv = {_cache_kwarg(target): cache}
    out = target(input_ids=prompt[None], **kv, use_cache=True, logits_to_keep=1)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        out = target(input_ids=torch.tensor([[tokens[-1]]], device=device), **kv, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    _sync(device)
    return Generation(tokens, time.perf_counter() - start)


@torch.inference_mode()
def dflash_generate(
    target: nn.Module,
    drafter: DFlashDrafter,
    capture: HiddenStateCapture,
    prompt: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    block_size: int | None = None,
) -> Generation:
    """Greedy speculative decoding of one prompt; `capture` hooks the drafter's target layers."""
    device = prompt.device
    B = block_size or drafter.config.block_size
    embed = target.get_input_embeddings()
    lm_head = target.get_output_embeddings().weight
    mask_id = drafter.config.mask_token_id
    scale = drafter.config.input_embedding_scale
    _sync(device)
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    kv = {_cache_kwarg(target): cache}
    out = target(input_ids=prompt[None], **kv, use_cache=True, logits_to_keep=1)
    features = torch.cat(capture.take(), dim=-1)  # [1, P, n_layers*H]
    feature_positions = torch.arange(len(prompt), device=device)[None]
    tokens = [int(out.logits[0, -1].argmax())]
    draft_cache = DrafterCache()
    accepted: list[int] = []
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        seen = len(prompt) + len(tokens) - 1  # tokens with target features: all but the last
        block = torch.full((1, B), mask_id, dtype=torch.long, device=device)
        block[0, 0] = tokens[-1]
        positions = torch.arange(seen, seen + B, device=device)[None]
        hidden = drafter.forward_step(features.to(drafter.fc.weight.dtype), feature_positions,
                                      embed(block).to(drafter.fc.weight.dtype) * scale, positions, draft_cache)
        drafts = drafter.compute_logits(hidden[:, 1:], lm_head.to(hidden.dtype)).argmax(-1)
        block[0, 1:] = drafts[0]
        out = target(input_ids=block, **kv, use_cache=True)
        verified = out.logits[0].argmax(-1)  # target's next token after each block position
        match = (block[0, 1:] == verified[:-1]).int().cumprod(0)
        n_ok = int(match.sum())
        new = block[0, 1 : 1 + n_ok].tolist() + [int(verified[n_ok])]
        accepted.append(len(new))
        tokens.extend(new)
        if stop_ids.intersection(new):
            break
        _truncate_cache(cache, seen + 1 + n_ok)  # keep the block positions that were accepted
        step_features = torch.cat(capture.take(), dim=-1)
        features = step_features[:, : 1 + n_ok]
        feature_positions = positions[:, : 1 + n_ok]
    _sync(device)
    tokens = _stop_at(tokens, stop_ids, max_new_tokens)
    return Generation(tokens, time.perf_counter() - start, accepted)
