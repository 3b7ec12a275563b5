"""Deterministic work plan: which samples a rank owns and how they are batched.

The plan is a pure function of the sample lengths and settings, so a resumed run rebuilds exactly
the batches of the interrupted one and commits continue batch by batch with identical numerics.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchPlan:
    """Batches of positions into the rank's sample list, longest first."""

    batches: list[list[int]]

    @property
    def num_samples(self) -> int:
        return sum(len(b) for b in self.batches)


def owns(sample_index: int, rank: int, world_size: int) -> bool:
    """Round-robin ownership over the global sample index: balanced and independent of lengths."""
    return sample_index % world_size == rank


def plan_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> BatchPlan:
    """Length-sorted batches whose padded size (rows x longest) stays within `batch_tokens`.

    Sorting by length makes neighbours nearly equal in length, so right padding wastes little.
    Longest first, so a batch that does not fit in memory fails at the start, not after hours.
    A sample longer than the budget gets a batch of its own.
    """
    if batch_tokens < 1 or max_batch_size < 1:
        raise ValueError("batch_tokens and max_batch_size must be positive")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        candidate_longest = max(longest, lengths[i])
        if current and ((len(current) + 1) * candidate_longest > batch_tokens or len(current) >= max_batch_size):
            batches.append(current)
            current, candidate_longest = [], lengths[i]
        current.append(i)
        longest = candidate_longest
    if current:
        batches.append(current)
    return BatchPlan(batches)


def padded_fraction(lengths: list[int], plan: BatchPlan) -> float:
    """Share of computed positions that are padding (reported in the summary)."""
    real = sum(lengths)
    computed = sum(len(b) * max(lengths[i] for i in b) for b in plan.batches)
    return 0.0 if computed == 0 else 1.0 - real / computed
