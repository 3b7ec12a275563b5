"""bench/copy_regions.py: a drafter's steps split by where the copy drafter accepts long blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.copy_regions import copyable_positions, main, split, step_starts


def test_steps_begin_after_the_prefills_token_and_long_copy_steps_mark_their_positions() -> None:
    assert step_starts([1, 3, 2]) == [1, 2, 5]
    # copy steps at 1 (1 token), 2..6 (5 tokens), 7..8 (2 tokens): only the 5-token step is long
    assert copyable_positions([1, 5, 2], min_copy=4) == {2, 3, 4, 5, 6}
    assert copyable_positions([1, 5, 2], min_copy=2) == {2, 3, 4, 5, 6, 7, 8}


def test_the_drafters_steps_are_counted_on_the_side_where_they_begin(tmp_path: Path) -> None:
    copy = [{"accepted": [1, 5, 2]}, {"accepted": [6, 1, 1]}]  # copyable: {2..6} and {1..6}
    drafter = [{"accepted": [1, 1, 3, 2, 1]}, {"accepted": [2, 2, 1, 2, 1]}]  # 8 tokens each, as the copy's
    # prompt 0 starts 1 2 3 6 8 -> copyable 2 (1), 3 (3), 6 (2); elsewhere 1 (1), 8 (1)
    # prompt 1 starts 1 3 5 6 8 -> copyable 1 (2), 3 (2), 5 (1), 6 (2); elsewhere 8 (1)
    result = split(drafter, copy, min_copy=4)
    assert (result["drafter_steps_copyable"], result["drafter_steps_elsewhere"]) == (7, 3)
    assert result["drafter_tau_copyable"] == pytest.approx(13 / 7)
    assert result["drafter_tau_elsewhere"] == pytest.approx(1.0)
    assert result["copyable_share"] == pytest.approx(11 / 16) and result["copy_tau_copyable"] == pytest.approx(5.5)

    paths = []
    for name, rows in (("d", drafter), ("c", copy)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"per_prompt": rows}))
    assert main(["--drafter", str(paths[0]), "--copy", str(paths[1])]) == result


def test_other_replies_are_refused_with_the_prompt() -> None:
    with pytest.raises(ValueError, match="prompt 1: the drafter's steps cover 7 reply tokens and the copy drafter's 8"):
        split([{"accepted": [8]}, {"accepted": [7]}], [{"accepted": [8]}, {"accepted": [8]}], min_copy=4)
    with pytest.raises(ValueError, match="prompt 0: the two reports hold different replies of the same length"):
        split([{"accepted": [2], "target_tokens": [5, 6, 7]}], [{"accepted": [2], "target_tokens": [5, 6, 8]}], 4)
    with pytest.raises(ValueError, match="2 prompts, the copy report 1"):
        split([{"accepted": [8]}, {"accepted": [8]}], [{"accepted": [8]}], min_copy=4)


def test_without_a_copy_report_the_copy_drafter_runs_on_the_drafter_reports_replies(
    tiny_target_dir: Path, tmp_path: Path, capsys
) -> None:
    from bench.ngram_baseline import copy_accepted
    from dflash_pipeline.shared.target.assets import load_tokenizer
    from dflash_pipeline.train.eval_cli import prompts_from

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("say it again and again", "count on")))
    ids = prompts_from(str(prompts), load_tokenizer(tiny_target_dir), 2, 1024)
    # a reply that repeats a 5-token phrase (the copy drafter accepts long steps once it has seen it) and
    # one of distinct tokens found nowhere earlier (it drafts nothing)
    replies = [[101, 102, 103, 104, 105] * 8, list(range(300, 340))]
    copy = [copy_accepted(p, r, 40, 8, set()) for p, r in zip(ids, replies)]
    assert copy[1] == [1] * 39 and max(copy[0]) >= 4  # the phrase copied, the distinct tokens not
    drafter = [
        {"prompt_tokens": len(p), "target_tokens": r, "accepted": [1] * sum(c)} for p, r, c in zip(ids, replies, copy)
    ]
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"max_new_tokens": 40, "block_size": 8, "per_prompt": drafter}))
    args = ["--drafter", str(report), "--prompts", str(prompts), "--target", str(tiny_target_dir)]
    result = main(args)
    assert result == split(drafter, [{"accepted": c} for c in copy], min_copy=4)
    assert 0 < result["copyable_share"] < 0.5 and result["drafter_tau_copyable"] == 1.0

    prompts.write_text(json.dumps({"prompt": "say it again and again"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(SystemExit, match="prompt 1: .* tokens with .*'s tokenizer, .* in the drafter report"):
        main(args)
    with pytest.raises(SystemExit):
        main(["--drafter", str(report), "--target", str(tiny_target_dir)])  # no prompts: nothing to tokenize
    assert "give --copy, or --target and --prompts" in capsys.readouterr().err
