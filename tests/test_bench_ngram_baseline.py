"""bench/ngram_baseline.py: the copy drafter's blocks and the steps decoding takes with them."""

from __future__ import annotations

import torch
from test_speculative import B, prompts, random_drafter

from bench.ngram_baseline import copy_sources, main, ngram_matches
from dflash_pipeline.shared.generation.speculative import dflash_generate, target_generate
from dflash_pipeline.shared.target.loading import HiddenStateCapture, load_full_target
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


def test_the_copy_drafters_chain_counts_what_decoding_with_its_drafts_counts(tiny_target_dir, monkeypatch) -> None:
    """Real greedy speculative decoding (`dflash_generate`) whose drafter proposes the copied drafts
    (a token the reply never holds where there are none), against `chain_accepted` over
    `ngram_matches`: the same steps, on the tiny target's looping replies, where copying pays."""
    from dflash_pipeline.shared.target.assets import load_tokenizer

    target = load_full_target(tiny_target_dir, device=torch.device("cpu"), dtype=torch.float32)
    drafter = random_drafter(target)
    vocab = target.config.vocab_size
    steps = []
    for prompt in prompts(load_tokenizer(tiny_target_dir), 3):
        reply = target_generate(target, prompt, 120, set()).tokens
        sequence = [*prompt.tolist(), *reply]
        absent = next(t for t in range(vocab) if t not in sequence)
        source = copy_sources(sequence, 4, 2)
        anchor = {}
        real_step = drafter.forward_step

        def spy_step(ctx, ctx_pos, emb, positions, cache, anchor=anchor, real_step=real_step):
            anchor["end"] = int(positions[0, 0]) + 1  # the text up to and including the block's first token
            return real_step(ctx, ctx_pos, emb, positions, cache)

        def copy_logits(hidden, _weight, anchor=anchor, source=source, sequence=sequence, absent=absent):
            end, n = anchor["end"], hidden.shape[1]
            start = source[end]
            drafts = [] if start < 0 else sequence[start : min(start + n, end)]
            want = drafts + [absent] * (n - len(drafts))
            logits = torch.zeros(1, n, vocab)
            logits[0, torch.arange(n), torch.tensor(want)] = 1.0
            return logits

        monkeypatch.setattr(drafter, "forward_step", spy_step)
        monkeypatch.setattr(drafter, "compute_logits", copy_logits)
        capture = HiddenStateCapture(target, drafter.config.target_layer_ids)
        try:
            for max_new in (120, 23):
                decoded = dflash_generate(target, drafter, capture, prompt, max_new, set())
                assert decoded.tokens == reply[:max_new]
                assert decoded.accepted == chain_accepted(
                    reply, ngram_matches(prompt.tolist(), reply, 4, 2), max_new, B, set()
                )
                steps += decoded.accepted
        finally:
            capture.close()
    assert max(steps) > 3 and min(steps) == 1  # runs copied from the loops, single tokens elsewhere


def test_ngram_baseline_runs_on_the_tiny_target(tiny_target_dir, sample_corpus, tmp_path) -> None:
    args = ["--target", str(tiny_target_dir), "--prompts", str(sample_corpus), "--limit", "3", "--device", "cpu"]
    result = main([*args, "--max-new-tokens", "24", "--windows", "8", "--block-size", "8"])
    assert result["prompts"] == 3 and set(result["windows"]) == {"24", "8"}
    assert all(w["tau"] >= 1 for w in result["windows"].values())
