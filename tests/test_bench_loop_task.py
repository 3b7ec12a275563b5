"""bench/loop_task.py: replies that only repeat a phrase, and the copy drafter's tau on a store of them."""

from __future__ import annotations

import json
from pathlib import Path

from bench.loop_task import WORDS, loop_conversations, main


def test_replies_repeat_the_asked_phrase_and_the_seed_decides_them() -> None:
    rows = loop_conversations(20, seed=3)
    assert rows == loop_conversations(20, seed=3) and rows != loop_conversations(20, seed=4)
    for row in rows:
        user, reply = (m["content"] for m in row["messages"])
        phrase = user.removeprefix("Say '").removesuffix("' again and again.")
        assert 3 <= len(phrase.split()) <= 10 and set(phrase.split()) <= set(WORDS)
        parts = reply.split(", ")
        assert len(parts) >= 2 and set(parts) == {phrase}


def test_copy_tau_on_a_store_of_loops_is_far_above_one(tiny_target_dir, tmp_path: Path) -> None:
    """Through the real extraction: the copy drafter accepts most of every reply after the prompt."""
    from dflash_pipeline.extract.config import ExtractConfig
    from dflash_pipeline.extract.run import run_extraction

    data = tmp_path / "loops.jsonl"
    main(["write", "--out", str(data), "--conversations", "6"])
    assert len(data.read_text().splitlines()) == 6
    cfg = ExtractConfig(
        target=str(tiny_target_dir), data=(str(data),), out=str(tmp_path / "store"), device="cpu", max_length=512
    )
    run_extraction(cfg)
    result = main(["copy-tau", "--store", str(tmp_path / "store"), "--json", str(tmp_path / "tau.json")])
    assert result["samples"] == 6 and result["tau"] > 4
    assert json.loads((tmp_path / "tau.json").read_text()) == result


def test_copy_tau_of_a_folder_that_is_no_store_is_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "bench.loop_task", "copy-tau", "--store", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"bench.loop_task: {tmp_path / 'none'}: no manifest.json (not a feature store, or extraction never started)"
    ]
