"""Packs read from the feature store, with anchors and blocks, for DataLoader worker processes.

Everything random here (anchor choice) is seeded by (seed, epoch, sample id), so a pack is the same
whichever worker builds it and whether or not the run was resumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from dflash.shared.blocks import build_blocks, sample_anchors
from dflash.shared.store import FeatureStore


@dataclass(frozen=True)
class PackSpec:
    """Fixed shapes of one pack: context tokens S and N blocks of B tokens."""

    pack_tokens: int
    num_blocks: int
    block_size: int
    mask_token_id: int
    max_anchors_per_sample: int


class PackDataset(Dataset):
    """Item j = pack j of this rank's epoch plan, as fixed-shape tensors."""

    def __init__(self, store_root: str, packs: list[list[int]], spec: PackSpec, seed: int, epoch: int):
        self.store_root = store_root
        self.packs = packs
        self.spec = spec
        self.seed = seed
        self.epoch = epoch
        self._store: FeatureStore | None = None  # opened lazily, once per worker process

    def __len__(self) -> int:
        return len(self.packs)

    @property
    def store(self) -> FeatureStore:
        if self._store is None:
            self._store = FeatureStore(self.store_root)
        return self._store

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_store"] = None
        return state

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        return build_pack(self.store, self.packs[j], self.spec, self.seed, self.epoch)


def build_pack(store: FeatureStore, sample_ids: list[int], spec: PackSpec, seed: int, epoch: int) -> dict[str, torch.Tensor]:
    """Concatenate samples into one context of `pack_tokens`, draw anchors per sample, build blocks."""
    S = spec.pack_tokens
    width = store.hidden_width
    hidden = torch.zeros(S, width, dtype=store.hidden_dtype)
    ids = torch.zeros(S, dtype=torch.long)
    mask = torch.zeros(S, dtype=torch.bool)
    doc = torch.full((S,), -1, dtype=torch.long)
    pos = torch.zeros(S, dtype=torch.long)
    anchors = []
    start = 0
    for d, sid in enumerate(sample_ids):
        sample = store[sid]
        n = min(len(sample.input_ids), S - start)
        if n <= 0:
            break
        sl = slice(start, start + n)
        ids[sl] = sample.input_ids[:n]
        mask[sl] = sample.loss_mask[:n]
        hidden[sl] = sample.hidden_states[:n]
        doc[sl] = d
        pos[sl] = torch.arange(n)
        gen = torch.Generator().manual_seed(hash_seed(seed, epoch, sid))
        anchors.append(sample_anchors(mask[sl], spec.max_anchors_per_sample, gen) + start)
        start += n
    anchors_all = torch.cat(anchors) if anchors else torch.zeros(0, dtype=torch.long)
    if len(anchors_all) > spec.num_blocks:
        gen = torch.Generator().manual_seed(hash_seed(seed, epoch, -1 - sample_ids[0]))
        keep = torch.randperm(len(anchors_all), generator=gen)[: spec.num_blocks]
        anchors_all = anchors_all[keep.sort().values]
    blocks = build_blocks(ids, doc, pos, mask, anchors_all, spec.num_blocks, spec.block_size, spec.mask_token_id)
    return {"context_hidden": hidden, "context_doc": doc, "context_positions": pos, **blocks}


def hash_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit seed from three integers (stable across processes, unlike hash())."""
    x = (seed * 1_000_003 + epoch) * 2_147_483_647 + sample_id
    x ^= x >> 31
    x = (x * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    return x >> 1


def make_loader(dataset: PackDataset, packs_per_step: int, start_step: int, workers: int, pin: bool, prefetch: int = 4) -> DataLoader:
    """Batches of `packs_per_step` packs from step `start_step` on (resume skips without reading)."""
    indices = list(range(start_step * packs_per_step, len(dataset)))
    return DataLoader(
        torch.utils.data.Subset(dataset, indices),
        batch_size=packs_per_step,
        shuffle=False,
        drop_last=True,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=prefetch if workers > 0 else None,
        persistent_workers=False,
        multiprocessing_context="spawn" if workers > 0 else None,
    )
