"""Greedy acceptance (tau) without decoding step by step: the chain of blocks that greedy speculative
decoding takes through the target's own greedy reply.

Greedy speculative decoding outputs the target's greedy reply, and how many drafts a step accepts
depends only on the block the drafter drafts at that step's anchor and on that reply. So the reply
can come first (the generation engine, all prompts batched), then the target's features of the
whole sequence (one forward), the drafter's block at every reply position (a few batched passes of
the training path), and the steps decoding takes are walked through them, counted as
`shared.generation.speculative.dflash_generate` counts them: the last blocks draft only what
`max_new_tokens` leaves, and those shorter blocks are drafted as decoding drafts them. The result
equals decoding's tau where the numerics agree (the online and training paths agree within 1e-4 in
float32); what it saves is the target's forward per step, so tau over replies of thousands of tokens
on many prompts costs seconds, at every shorter `max_new_tokens` too. It measures no speedup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from dflash_pipeline.shared.generation.decoder import GenerationError, check_supported
from dflash_pipeline.shared.generation.engine import EngineSettings, GenerationEngine, Request
from dflash_pipeline.shared.generation.sampling import SamplingParams
from dflash_pipeline.shared.generation.speculative import target_generate
from dflash_pipeline.shared.model.blocks import build_blocks
from dflash_pipeline.shared.model.drafter import DFlashDrafter, DrafterCache
from dflash_pipeline.shared.model.target_head import TargetHead
from dflash_pipeline.shared.target.loading import HiddenStateCapture
from dflash_pipeline.train.step import drafter_hidden

BLOCKS_PER_PASS = 64  # blocks drafted in one pass (their logits: 64 x 15 x vocab floats)


def greedy_replies(
    target: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids
) -> list[list[int]]:
    """The target's greedy reply to each prompt (at most `max_new_tokens`, a stop id included), all
    decoded together by the generation engine (token-identical to HF `generate` in float32), or one
    at a time by HF's forward where the engine cannot run the architecture."""
    settings = EngineSettings(
        max_batch=min(len(prompts), EngineSettings.max_batch),
        max_request_tokens=max(map(len, prompts)) + max_new_tokens,
    )
    try:
        check_supported(target, settings.max_request_tokens)
    except GenerationError:
        device = next(target.parameters()).device
        stops = set(stop_ids)
        return [target_generate(target, torch.tensor(p, device=device), max_new_tokens, stops).tokens for p in prompts]
    engine = GenerationEngine(target, stop_ids=stop_ids, sampling=SamplingParams(), settings=settings)
    replies = engine.generate([Request(list(p), max_new_tokens) for p in prompts])
    return [r.tokens for r in replies]


def sequence_features(target: nn.Module, capture: HiddenStateCapture, sequence: torch.Tensor) -> torch.Tensor:
    """[1, S, n_layers * hidden]: the drafter's context features of every position of `sequence`."""
    with torch.inference_mode():
        target(input_ids=sequence[None], logits_to_keep=1)
    return torch.cat(capture.take(), dim=-1)


def _drafts(
    drafter: DFlashDrafter, hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head: torch.Tensor
) -> torch.Tensor:
    """Greedy drafts [n, L] of blocks whose drafter states after the anchor are `hidden` [n, L, H]:
    each position's argmax, or DFlash-2's selector path (as decoding drafts them)."""
    if drafter.candidate_selector is not None:
        return drafter.propose(hidden, anchor_ids, lm_head.to(hidden.dtype))[0]
    return drafter.compute_logits(hidden, lm_head.to(hidden.dtype)).argmax(-1)


def _matching(drafts: torch.Tensor, sequence: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """How many of each block's drafts [n, L] equal the tokens after its anchor (none past the end)."""
    index = anchors[:, None] + 1 + torch.arange(drafts.shape[1], device=anchors.device)[None]
    truth = torch.where(index < len(sequence), sequence[index.clamp(max=len(sequence) - 1)], -1)
    return (drafts == truth).int().cumprod(1).sum(1)


class BlockMatches:
    """`(reply index, block size) -> drafts equal to the reply` for one prompt and its greedy reply:
    full blocks at every reply position drafted in batches up front (the training path), shorter ones
    drafted when asked, one at a time, as decoding drafts them (the online path)."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        head: TargetHead,
        features: torch.Tensor,
        sequence: torch.Tensor,
        prompt_length: int,
    ):
        self.drafter, self.head, self.features, self.sequence = drafter, head, features, sequence
        self.prompt_length = prompt_length
        self.block_size = drafter.config.block_size
        self.full = self._full_blocks()
        self.short: dict[tuple[int, int], int] = {}

    @torch.inference_mode()
    def _full_blocks(self) -> list[int]:
        seq, P, B = self.sequence, self.prompt_length, self.block_size
        S, dev = len(seq), seq.device
        doc = torch.zeros(S, dtype=torch.long)
        reply = torch.arange(S) >= P
        matches: list[int] = []
        for anchors in torch.arange(P, S - 1).split(BLOCKS_PER_PASS):  # the last token opens no block
            blocks = build_blocks(
                seq.cpu(), doc, torch.arange(S), reply, anchors, len(anchors), B, self.drafter.config.mask_token_id
            )
            batch = {
                "context_hidden": self.features[0],
                "context_doc": doc.to(dev),
                "context_positions": torch.arange(S, device=dev),
                **{k: v.to(dev) for k, v in blocks.items()},
            }
            hidden = drafter_hidden(self.drafter, self.head, {k: v[None] for k, v in batch.items()})
            hidden = hidden.reshape(len(anchors), B, -1)[:, 1:]
            anchors = anchors.to(dev)
            drafts = _drafts(self.drafter, hidden, seq[anchors], self.head.lm_head)
            matches += _matching(drafts, seq, anchors).tolist()
        return matches

    @torch.inference_mode()
    def _short_block(self, anchor: int, size: int) -> int:
        drafter, cfg, dev = self.drafter, self.drafter.config, self.sequence.device
        dtype = drafter.fc.weight.dtype
        block = torch.full((1, size), cfg.mask_token_id, dtype=torch.long, device=dev)
        block[0, 0] = self.sequence[anchor]
        hidden = drafter.forward_step(
            self.features[:, :anchor].to(dtype),
            torch.arange(anchor, device=dev)[None],
            self.head.embed(block, cfg.input_embedding_scale, dtype=dtype),
            torch.arange(anchor, anchor + size, device=dev)[None],
            DrafterCache(),
        )
        drafts = _drafts(drafter, hidden[:, 1:], block[:, 0], self.head.lm_head)
        return int(_matching(drafts, self.sequence, torch.tensor([anchor], device=dev))[0])

    def __call__(self, index: int, size: int) -> int:
        if size == self.block_size:
            return self.full[index]
        if (index, size) not in self.short:
            self.short[index, size] = self._short_block(self.prompt_length + index, size)
        return self.short[index, size]


def chain_accepted(
    reply: Sequence[int],
    matches: Callable[[int, int], int],
    max_new_tokens: int,
    block_size: int,
    stop_ids: set[int],
) -> list[int]:
    """Tokens added per verify step when greedy speculative decoding produces `reply` (the target's
    greedy reply up to its first stop id, generated with at least `max_new_tokens`), counted as
    `dflash_generate` counts them; `matches(i, size)`: drafts equal to the reply of the block of
    `size` positions anchored at reply token i."""
    accepted: list[int] = []
    produced = 1  # the prefill's token
    while produced < max_new_tokens and reply[produced - 1] not in stop_ids:
        if produced >= len(reply):
            raise ValueError(f"the reply has {len(reply)} tokens and no stop id: too short for {max_new_tokens}")
        left = max_new_tokens - produced
        size = min(block_size, left + 1)  # the last block drafts only what is left
        n_ok = matches(produced - 1, size)
        # the accepted drafts, then the target's token; none past the limit or the reply's stop id
        new = reply[produced : produced + n_ok + 1][:left]
        accepted.append(len(new))
        produced += len(new)
    return accepted
