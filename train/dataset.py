"""Packs read from the feature store, with anchors and blocks, for DataLoader worker processes.

Everything random here (anchor choice) is seeded by (seed, epoch, sample id), so a pack is the same
whichever worker builds it and whether or not the run was resumed.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from dflash_pipeline.shared.model.blocks import IGNORE_INDEX, build_blocks, sample_anchors
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.train.packing import plan_packs, rank_slice

if TYPE_CHECKING:
    from dflash_pipeline.shared.model.config import DFlashConfig
    from dflash_pipeline.train.feed import SlotRing


@dataclass(frozen=True)
class PackSpec:
    """Fixed shapes of one pack: context tokens S and N blocks of B tokens."""

    pack_tokens: int
    num_blocks: int
    block_size: int
    mask_token_id: int
    max_anchors_per_sample: int
    # K of the target's top-K distribution each block token carries (`target_topk_ids` /
    # `target_topk_logprobs`, for --loss kl/mix); 0: none
    topk: int = 0

    @classmethod
    def for_drafter(
        cls, config: DFlashConfig, pack_tokens: int, num_blocks: int, max_anchors_per_sample: int, topk: int = 0
    ) -> PackSpec:
        """Block size and mask token taken from the drafter's config, their one source."""
        return cls(pack_tokens, num_blocks, config.block_size, config.mask_token_id, max_anchors_per_sample, topk)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Which packs rank `rank` trains on at step k of an epoch: a pure function of the seed, so any
    worker process (and a resumed run) rebuilds the same plan."""

    train_ids: np.ndarray
    lengths: np.ndarray
    pack_tokens: int
    seed: int
    rank: int
    world: int
    packs_per_step: int

    def epoch_packs(self, epoch: int) -> list[list[int]]:
        return rank_slice(
            plan_packs(self.train_ids, self.lengths, self.pack_tokens, self.seed, epoch),
            self.rank,
            self.world,
            self.packs_per_step,
        )

    def steps_in(self, epoch: int) -> int:
        return len(self.epoch_packs(epoch)) // self.packs_per_step

    def schedule(self, epochs: int) -> list[tuple[int, int]]:
        """Every (epoch, step) of epochs 0..epochs-1 in training order (epochs differ a little in length)."""
        return [(epoch, k) for epoch in range(epochs) for k in range(self.steps_in(epoch))]


class StepDataset(Dataset):
    """Item (epoch, k, slot) = (epoch, k, the batch of this rank's step k of that epoch).

    One loader serves the whole run (a list of (epoch, k, slot) is its sampler), so its worker
    processes start once instead of at every epoch. Given `slots` (a `train.feed.SlotRing`, shared
    memory that pickles to spawned workers), the whole batch is built in `slots.views(slot)` and the
    item carries only the slot's number: nothing but a few bytes crosses the DataLoader's result pipe,
    which every worker shares and the main process reads between training steps. With slot None the
    batch goes into new tensors.
    """

    def __init__(self, store_root: str, plan: StepPlan, spec: PackSpec, slots: SlotRing | None = None) -> None:
        self.store_root = store_root
        self.plan = plan
        self.spec = spec
        self.slots = slots
        self._store: FeatureStore | None = None  # opened lazily, once per worker process
        self._packs: tuple[int, list[list[int]]] | None = None  # (epoch, its packs), the latest epoch asked for

    def with_slots(self, slots: SlotRing) -> StepDataset:
        """A copy (of the same class, settings kept) that builds its batches into `slots`; this one is unchanged."""
        twin = copy.copy(self)
        twin.slots = slots
        return twin

    @property
    def store(self) -> FeatureStore:
        if self._store is None:
            self._store = FeatureStore(self.store_root)
        return self._store

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_store": None, "_packs": None}

    def __getitem__(self, item: tuple[int, int, int | None]) -> tuple[int, int, dict]:
        epoch, k, slot = item
        if self._packs is None or self._packs[0] != epoch:
            self._packs = (epoch, self.plan.epoch_packs(epoch))
        n = self.plan.packs_per_step
        packs = self._packs[1][k * n : (k + 1) * n]
        if slot is None:
            return epoch, k, build_batch(self.store, packs, self.spec, self.plan.seed, epoch)
        build_batch(self.store, packs, self.spec, self.plan.seed, epoch, out=self.slots.views(slot))
        return epoch, k, {"slot": slot}


def batch_layout(
    spec: PackSpec,
    packs: int,
    hidden_width: int,
    hidden_dtype: torch.dtype,
    scale_groups: int = 0,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every tensor of a batch of `packs` packs: fixed by the spec, so a feed can
    allocate its slots before any batch exists. An fp8 store's batches carry its codes as stored and
    their scales (`context_scales`, `scale_groups` per token), dequantized on the training device. With
    `spec.topk` K each block token carries the target's stored top-K distribution that predicts its
    label (`target_topk_ids` int32, `target_topk_logprobs` float32, [packs, N*B, K]; zero where unlabeled)."""
    S, N, B, K = spec.pack_tokens, spec.num_blocks, spec.block_size, spec.topk
    scales = {"context_scales": ((packs, S, scale_groups), torch.float32)} if scale_groups else {}
    topk = (
        {
            "target_topk_ids": ((packs, N * B, K), torch.int32),
            "target_topk_logprobs": ((packs, N * B, K), torch.float32),
        }
        if K
        else {}
    )
    return {
        "context_hidden": ((packs, S, hidden_width), hidden_dtype),
        **scales,
        "context_doc": ((packs, S), torch.long),
        "context_positions": ((packs, S), torch.long),
        "block_ids": ((packs, N * B), torch.long),
        "labels": ((packs, N * B), torch.long),
        "block_positions": ((packs, N * B), torch.long),
        "anchor_pos": ((packs, N), torch.long),
        "block_doc": ((packs, N), torch.long),
        "block_valid": ((packs, N), torch.bool),
        **topk,
    }


def _empty(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An uninitialised tensor; in shared memory when it will travel to the main process (the stock
    DataLoader path, without slots), so the DataLoader sends a handle instead of copying it."""
    if not shared:
        return torch.empty(shape, dtype=dtype)
    proto = torch.empty(0, dtype=dtype)
    return proto.new(proto._typed_storage()._new_shared(math.prod(shape))).view(shape)


def build_batch(
    store: FeatureStore,
    packs: list[list[int]],
    spec: PackSpec,
    seed: int,
    epoch: int,
    out: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Packs stacked along a leading axis, written into `out` (tensors of `batch_layout`; new ones if
    None), hidden states (and an fp8 store's scales) decoded straight into `out["context_hidden"]`
    (`out["context_scales"]`)."""
    if out is None:
        shared = get_worker_info() is not None
        layout = batch_layout(spec, len(packs), store.hidden_width, store.hidden_dtype, store.scale_groups)
        out = {key: _empty(shape, dtype, shared) for key, (shape, dtype) in layout.items()}
    for j, sample_ids in enumerate(packs):
        scales = out["context_scales"][j] if store.scale_groups else None
        part = build_pack(store, sample_ids, spec, seed, epoch, out["context_hidden"][j], scales)
        for key, value in part.items():
            out[key][j] = value
    return out


@dataclass
class PackContext:
    """One pack's context as read from the store: samples concatenated into `pack_tokens` positions
    (doc -1 past the last one); `spans` holds (sample id, first position, tokens) per sample. The
    hidden states (and an fp8 store's scales) went into the caller's buffers."""

    ids: torch.Tensor
    mask: torch.Tensor
    doc: torch.Tensor
    pos: torch.Tensor
    spans: list[tuple[int, int, int]]
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None

    def blocks(self, anchors: torch.Tensor, spec: PackSpec) -> dict[str, torch.Tensor]:
        """The pack's tensors for these anchors (at most `spec.num_blocks`), as a batch holds them."""
        blocks = build_blocks(
            self.ids, self.doc, self.pos, self.mask, anchors, spec.num_blocks, spec.block_size, spec.mask_token_id
        )
        if spec.topk:
            blocks.update(block_topk(blocks, self.topk_ids, self.topk_logprobs, spec.block_size))
        return {"context_doc": self.doc, "context_positions": self.pos, **blocks}


def read_pack_context(
    store: FeatureStore,
    sample_ids: list[int],
    spec: PackSpec,
    hidden: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> PackContext:
    """Concatenate samples into one context of `pack_tokens` (their hidden states go into `hidden`,
    [S, W], an fp8 store's scales into `scales`, [S, layers], zero past the last sample)."""
    S = spec.pack_tokens
    ctx = PackContext(
        ids=torch.zeros(S, dtype=torch.long),
        mask=torch.zeros(S, dtype=torch.bool),
        doc=torch.full((S,), -1, dtype=torch.long),
        pos=torch.zeros(S, dtype=torch.long),
        spans=[],
    )
    if spec.topk:
        ctx.topk_ids = torch.zeros((S, spec.topk), dtype=torch.int32)
        ctx.topk_logprobs = torch.zeros((S, spec.topk), dtype=torch.float32)
    start = 0
    for d, sid in enumerate(sample_ids):
        shard, first, stop, _ = store.sample_span(sid)
        n = min(stop - first, S - start)
        if n <= 0:
            break
        sl = slice(start, start + n)
        ctx.ids[sl], ctx.mask[sl], _ = store.read_tokens(shard, first, first + n, hidden_out=hidden[sl])
        if scales is not None:
            store.read_scales(shard, first, first + n, out=scales[sl])
        if spec.topk:
            store.read_topk(shard, first, first + n, ids_out=ctx.topk_ids[sl], logprobs_out=ctx.topk_logprobs[sl])
        ctx.doc[sl] = d
        ctx.pos[sl] = torch.arange(n)
        ctx.spans.append((sid, start, n))
        start += n
    hidden[start:] = 0
    if scales is not None:
        scales[start:] = 0
    return ctx


def build_pack(
    store: FeatureStore,
    sample_ids: list[int],
    spec: PackSpec,
    seed: int,
    epoch: int,
    hidden: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """`read_pack_context`, then the blocks of `draw_anchors`."""
    ctx = read_pack_context(store, sample_ids, spec, hidden, scales)
    return ctx.blocks(draw_anchors(ctx, spec, seed, epoch), spec)


def draw_anchors(ctx: PackContext, spec: PackSpec, seed: int, epoch: int) -> torch.Tensor:
    """The pack's anchors: at most `max_anchors_per_sample` drawn per sample, then at most
    `num_blocks` of them, seeded by (seed, epoch, sample id)."""
    anchors = []
    for sid, start, n in ctx.spans:
        gen = torch.Generator().manual_seed(hash_seed(seed, epoch, sid))
        anchors.append(sample_anchors(ctx.mask[start : start + n], spec.max_anchors_per_sample, gen) + start)
    anchors_all = torch.cat(anchors) if anchors else torch.zeros(0, dtype=torch.long)
    if len(anchors_all) > spec.num_blocks:
        gen = torch.Generator().manual_seed(hash_seed(seed, epoch, -1 - ctx.spans[0][0]))
        keep = torch.randperm(len(anchors_all), generator=gen)[: spec.num_blocks]
        anchors_all = anchors_all[keep.sort().values]
    return anchors_all


def block_topk(
    blocks: dict[str, torch.Tensor], topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, block_size: int
) -> dict[str, torch.Tensor]:
    """The stored top-K distribution aligned with the block labels: block token k of anchor a is
    labeled with the token at a+k, which the target predicted at a+k-1, so it gets row a+k-1 of the
    context's [S, K] top-K (the same doc as the label, since a <= a+k-1 < a+k); zero where unlabeled."""
    labeled = blocks["labels"] != IGNORE_INDEX  # [N*B]
    k = torch.arange(block_size).repeat(len(blocks["anchor_pos"]))
    source = (blocks["anchor_pos"].repeat_interleave(block_size) + k - 1).clamp(0, len(topk_ids) - 1)
    ids, logprobs = topk_ids[source], topk_logprobs[source]
    ids[~labeled] = 0
    logprobs[~labeled] = 0
    return {"target_topk_ids": ids, "target_topk_logprobs": logprobs}


def hash_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit seed from three integers (stable across processes, unlike hash())."""
    x = (seed * 1_000_003 + epoch) * 2_147_483_647 + sample_id
    x ^= x >> 31
    x = (x * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    return x >> 1
