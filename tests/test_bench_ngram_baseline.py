"""bench/ngram_baseline.py: the copy drafter's blocks and the steps decoding takes with them."""

from __future__ import annotations

from bench.ngram_baseline import copy_sources, main, ngram_matches
from dflash_pipeline.train.chain_tau import chain_accepted


def copied(text: list[int], count: int, max_ngram: int, min_ngram: int) -> list[int]:
    start = copy_sources(text, max_ngram, min_ngram)[len(text)]
    return [] if start < 0 else text[start : start + count]


def test_copies_follow_the_most_recent_earlier_occurrence_of_the_longest_suffix() -> None:
    assert copied([5, 1, 2, 7, 1, 2, 8, 1, 2], 3, 4, 2) == [8, 1, 2]  # [1, 2] last seen before 8
    assert copied([1, 2, 3, 9, 2, 3, 1, 2, 3], 2, 4, 2) == [9, 2]  # [1, 2, 3] beats the nearer [2, 3]
    assert copied([1, 2, 3, 4], 3, 4, 2) == []  # no suffix occurs earlier
    assert copied([4, 5, 4], 3, 4, 1) == [5, 4]  # n = 1 allowed: after the earlier 4
    assert copy_sources([7, 7, 7], 2, 1) == [-1, -1, 1, 2]  # [7, 7] at end 3 last ended at 2


def test_a_loop_is_copied_once_it_has_been_seen() -> None:
    """Reply 1 2 3 repeated: nothing to copy until [1, 2] recurs, then whole blocks (4 of 4, and the
    last block drafts only the 3 tokens the limit leaves)."""
    prompt, reply = [9], [1, 2, 3] * 4
    assert chain_accepted(reply, ngram_matches(prompt, reply, 4, 2), 12, 4, set()) == [1, 1, 1, 1, 4, 3]


def test_ngram_baseline_runs_on_the_tiny_target(tiny_target_dir, sample_corpus, tmp_path) -> None:
    args = ["--target", str(tiny_target_dir), "--prompts", str(sample_corpus), "--limit", "3", "--device", "cpu"]
    result = main([*args, "--max-new-tokens", "24", "--windows", "8", "--block-size", "8"])
    assert result["prompts"] == 3 and set(result["windows"]) == {"24", "8"}
    assert all(w["tau"] >= 1 for w in result["windows"].values())
