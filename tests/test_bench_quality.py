"""bench/quality.py's prompt selection: no prompt twice, so no held-out prompt equals a training one."""

from __future__ import annotations

import json
from pathlib import Path

from bench.quality import first_turn_prompts, normalised


def conversation(user: str) -> dict:
    return {"id": user[:8], "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "ok"}]}


def prompts(path: Path) -> list[str]:
    return [json.loads(line)["conversations"][0]["value"] for line in path.read_text().splitlines()]


def test_first_turn_prompts_drop_normalised_duplicates(tmp_path: Path) -> None:
    users = [
        "continue",
        "Explain DNS",
        "  Continue\n",
        "explain   dns",
        "write a haiku",
        "CONTINUE",
        "short",
        "Sort a list in Python",
        "write a haiku ",
        "What is 2+2?",
        "Name three rivers",
    ]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps([conversation(u) for u in users]))
    train, held = first_turn_prompts(tmp_path, 3, 2, source)
    got_train, got_held = prompts(train), prompts(held)
    assert got_train == ["continue", "Explain DNS", "write a haiku"]
    assert got_held == ["Sort a list in Python", "What is 2+2?"]
    keys = [normalised(p) for p in got_train + got_held]
    assert len(set(keys)) == len(keys)


def test_normalised() -> None:
    assert normalised("  Please\tCONTINUE \n now ") == "please continue now"
