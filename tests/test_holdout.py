"""Held-out split of dflash-train: samples with the same prompt (so, regenerated greedily, the same
reply) never straddle train and held-out, on a real extracted store with repeated records."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_pipeline.data import sample_corpus_path
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.train.holdout import prompt_groups, prompt_key
from dflash_pipeline.train.packing import split_holdout

# record k of the corpus file below is sample-corpus line SOURCE[k]: line 0 six times, line 1 three times
SOURCE = [0, 1, 2, 0, 3, 4, 0, 1, 5, 6, 0, 7, 8, 0, 1, 9, 10, 0, 11, 12]


@pytest.fixture(scope="module")
def dup_store(extract_cpu_store, tmp_path_factory) -> FeatureStore:
    lines = sample_corpus_path().read_text().splitlines()
    data = tmp_path_factory.mktemp("dup_data") / "corpus.jsonl"
    data.write_text("".join(lines[k] + "\n" for k in SOURCE))
    return FeatureStore(extract_cpu_store(data, tmp_path_factory.mktemp("dup_store") / "store"))


@pytest.mark.parametrize("window_tokens", [1, 100, 1 << 24])  # a read per sample, a few, one per shard
def test_prompt_groups_equal_exactly_for_equal_prompts(dup_store: FeatureStore, window_tokens: int) -> None:
    groups = prompt_groups(dup_store, window_tokens)
    records = [SOURCE[dup_store.sample_span(i)[3]] for i in range(len(dup_store))]
    assert len(records) == len(SOURCE)
    for i in range(len(records)):
        for j in range(len(records)):
            assert (groups[i] == groups[j]) == (records[i] == records[j]), (i, j)


def test_prompt_key_ignores_the_reply() -> None:
    ids, mask = np.array([5, 6, 7, 8, 9]), np.array([0, 0, 1, 1, 1])
    assert prompt_key(ids, mask) == prompt_key(np.array([5, 6, 1, 2]), np.array([0, 0, 1, 1]))
    assert prompt_key(ids, mask) != prompt_key(np.array([5, 7, 7, 8, 9]), mask)
    assert prompt_key(ids, np.zeros(5)) != prompt_key(ids[:4], np.zeros(4))  # unmasked: whole sequence


@pytest.mark.parametrize("seed", range(20))
def test_grouped_split_keeps_every_prompt_on_one_side(dup_store: FeatureStore, seed: int) -> None:
    groups = prompt_groups(dup_store)
    train, held = split_holdout(len(dup_store), 4, seed, groups)
    assert len(held) == 4 and len(train) + len(held) == len(dup_store)
    assert not set(groups[train].tolist()) & set(groups[held].tolist())
    assert sorted(np.concatenate([train, held]).tolist()) == list(range(len(dup_store)))


def test_ungrouped_split_leaks_duplicates_on_this_store(dup_store: FeatureStore) -> None:
    """Why groups are needed: the plain split puts a copy of a training prompt in held-out."""
    groups = prompt_groups(dup_store)
    leaks = [
        seed
        for seed in range(20)
        if set(groups[split_holdout(len(dup_store), 4, seed)[1]].tolist())
        & set(groups[split_holdout(len(dup_store), 4, seed)[0]].tolist())
    ]
    assert leaks


def test_distinct_groups_give_the_ungrouped_split() -> None:
    for seed in range(5):
        plain = split_holdout(100, 7, seed)
        grouped = split_holdout(100, 7, seed, np.arange(100)[::-1])
        assert all(np.array_equal(a, b) for a, b in zip(plain, grouped))


def test_a_group_larger_than_the_budget_stays_in_training() -> None:
    groups = np.array([0] * 10 + list(range(1, 11)))
    for seed in range(10):
        train, held = split_holdout(20, 3, seed, groups)
        assert len(held) == 3 and not (held < 10).any()
    with pytest.raises(ValueError, match="shape"):
        split_holdout(20, 3, 0, groups[:5])
