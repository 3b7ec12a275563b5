"""Prompt groups of a feature store, so the held-out split never shares a prompt with training.

With `--regenerate` (greedy) a repeated prompt gets the same reply, so two samples with the same
prompt tokens are the same sample: one in training and one held out would measure memorisation.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dflash_pipeline.shared.store.reader import FeatureStore


def prompt_key(input_ids: np.ndarray, loss_mask: np.ndarray) -> bytes:
    """Digest of the tokens before the first loss-masked (reply) token; the whole sequence when
    nothing is masked (plain text)."""
    reply = np.flatnonzero(loss_mask)
    prompt = input_ids[: reply[0]] if len(reply) else input_ids
    return hashlib.blake2b(np.ascontiguousarray(prompt, dtype=np.int64).tobytes(), digest_size=16).digest()


def prompt_groups(store: FeatureStore, window_tokens: int = 1 << 24) -> np.ndarray:
    """One group id per global sample (int64): equal ids exactly when the prompt tokens are equal.
    Reads only input_ids and loss_mask, in contiguous windows of about `window_tokens` per shard
    (one read per window, not per sample; memory stays one window)."""
    keys: dict[bytes, int] = {}
    out = np.empty(len(store), dtype=np.int64)
    i = 0
    while i < len(store):
        shard, base, stop, _ = store.sample_span(i)
        end = i + 1  # extend the window over the following samples of the same shard
        while end < len(store) and (span := store.sample_span(end))[0] == shard and span[2] - base <= window_tokens:
            stop = span[2]
            end += 1
        ids, mask = store.read_ids_and_mask(shard, base, stop)
        for j in range(i, end):
            _, first, last, _ = store.sample_span(j)
            out[j] = keys.setdefault(
                prompt_key(ids[first - base : last - base], mask[first - base : last - base]), len(keys)
            )
        i = end
    return out
