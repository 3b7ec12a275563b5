"""Which samples go into which fixed-size pack, per epoch and rank: a pure function of the seed.

Packs have a fixed token budget so every step has the same tensor shapes (no recompiles); the
shuffle depends only on (seed, epoch), and ranks take disjoint, equally long slices of the packs.
"""

from __future__ import annotations

import numpy as np

from dflash_pipeline.shared.runtime.config import ConfigError


def split_holdout(
    num_samples: int, holdout: int, seed: int, groups: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic (train, held-out) sample ids; held-out samples never enter training.

    `groups` (one id per sample; equal ids = same prompt, so the same greedy reply) keeps every
    group on one side: a held-out sample never has a copy in training. Whole groups are taken in
    the seeded sample order while they fit the `holdout` budget, so with all-distinct groups (or
    None) the split is exactly the ungrouped one.
    """
    if holdout >= num_samples:
        raise ConfigError(
            f"--eval-samples {holdout} leaves no training samples: the store has {num_samples}; lower --eval-samples"
        )
    order = np.random.default_rng([seed, 7919]).permutation(num_samples)
    if groups is None:
        return np.sort(order[holdout:]), np.sort(order[:holdout])
    groups = np.asarray(groups)
    if groups.shape != (num_samples,):
        raise ValueError(f"groups has shape {groups.shape}, expected ({num_samples},)")
    _, labels, sizes = np.unique(groups, return_inverse=True, return_counts=True)
    taken = np.zeros(len(sizes), dtype=bool)
    left = holdout
    for i in order:
        if left == 0:
            break
        g = labels[i]
        if not taken[g] and sizes[g] <= left:
            taken[g] = True
            left -= sizes[g]
    held = taken[labels]
    ids = np.arange(num_samples)
    return ids[~held], ids[held]


def plan_packs(sample_ids: np.ndarray, lengths: np.ndarray, pack_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Shuffle the samples for this epoch and fill packs first-come; returns lists of sample ids.

    A sample longer than a pack is cut to the pack (its tail is not trained on this epoch).
    """
    order = np.random.default_rng([seed, epoch]).permutation(len(sample_ids))
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for j in order:
        sid = int(sample_ids[j])
        n = min(int(lengths[sid]), pack_tokens)
        if current and used + n > pack_tokens:
            packs.append(current)
            current, used = [], 0
        current.append(sid)
        used += n
    if current:
        packs.append(current)
    return packs


def rank_slice(packs: list[list[int]], rank: int, world_size: int, packs_per_step: int) -> list[list[int]]:
    """This rank's packs: every world_size-th, cut so all ranks run the same number of full steps."""
    steps = len(packs) // (world_size * packs_per_step)
    mine = packs[rank::world_size]
    return mine[: steps * packs_per_step]
