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


def test_conversation_prompts_keep_every_turn_and_hold_out_unseen_first_turns_by_domain(tmp_path: Path) -> None:
    import lzma

    from bench.quality_scale import DOMAINS_FILE, EVAL_FILE, TRAIN_FILE, conversation_prompts, domain_of

    def chat(*users: str) -> dict:
        turns = [t for u in users for t in ({"from": "human", "value": u}, {"from": "gpt", "value": "a reply"})]
        return {"id": users[0][:8], "conversations": turns}

    records = [
        chat("Write a python function that sorts a list", "Now make it faster please, in place"),
        chat("Tell me about the history of the Roman empire"),
        # held-out candidates: a repeat of a training turn (any turn) is never held out
        chat("now make it FASTER please,   in place"),
        chat("Solve the equation 3x + 4 = 19 for x, step by step"),
        chat("Write a short poem about autumn leaves falling"),
        chat("What should I pack for a week of hiking in the Alps?"),
        chat("Debug this javascript code that throws a TypeError"),
        chat("ok"),  # too short to be a prompt
        chat("Calculate the probability of two sixes with two dice"),
    ]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(records))
    counts = conversation_prompts(tmp_path, 2, 1, source)
    assert counts == {"conversations": 2, "eval_prompts": {"code": 1, "math": 1, "writing": 1, "other": 1}}
    train = [json.loads(line) for line in lzma.decompress((tmp_path / TRAIN_FILE).read_bytes()).decode().splitlines()]
    assert [[m["from"] for m in r["conversations"]] for r in train] == [
        ["human", "gpt", "human", "gpt"],
        ["human", "gpt"],
    ]
    assert train[0]["conversations"][2]["value"] == "Now make it faster please, in place"
    assert {m["value"] for r in train for m in r["conversations"] if m["from"] == "gpt"} == {"-"}
    held = prompts(tmp_path / EVAL_FILE)
    domains = json.loads((tmp_path / DOMAINS_FILE).read_text())
    assert domains == ["code", "math", "writing", "other"]  # round robin: any first n stay balanced
    assert held == [
        "Debug this javascript code that throws a TypeError",
        "Solve the equation 3x + 4 = 19 for x, step by step",
        "Write a short poem about autumn leaves falling",
        "What should I pack for a week of hiking in the Alps?",
    ]
    assert [domain_of(p) for p in held] == domains
