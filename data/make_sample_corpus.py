"""Generate the sample corpus in ``data/sample/`` (deterministic; license clean: all text is ours).

Templated, checkable Q&A -- arithmetic, unit conversions, word facts, small Python snippets -- with
some system prompts and a few 2-3 turn dialogs. Replies are formulaic on purpose: a tiny target can
learn them, so a drafter trained against it has something to predict.

    python -m dflash_pipeline.data.make_sample_corpus [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NUM_CONVERSATIONS = 300
NUM_SHAREGPT = 20
SEED = 20260206

Turns = list[tuple[str, str]]  # (role, content)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise math tutor. Show the calculation.",
    "Answer briefly and precisely.",
    "You are a friendly assistant who explains things simply.",
]

CAPITALS = {
    "France": "Paris",
    "Japan": "Tokyo",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Germany": "Berlin",
    "Canada": "Ottawa",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Peru": "Lima",
    "Norway": "Oslo",
    "Portugal": "Lisbon",
    "Greece": "Athens",
}
PLURALS = {
    "box": "boxes",
    "child": "children",
    "mouse": "mice",
    "city": "cities",
    "leaf": "leaves",
    "tooth": "teeth",
    "bus": "buses",
    "person": "people",
    "knife": "knives",
    "foot": "feet",
}
OPPOSITES = {
    "hot": "cold",
    "tall": "short",
    "early": "late",
    "happy": "sad",
    "open": "closed",
    "light": "dark",
    "fast": "slow",
    "full": "empty",
    "strong": "weak",
    "above": "below",
}
WORDS = [
    "banana",
    "garden",
    "river",
    "pencil",
    "orange",
    "window",
    "planet",
    "music",
    "castle",
    "dragon",
    "silver",
    "winter",
    "forest",
    "rocket",
    "candle",
    "bridge",
    "yellow",
    "puzzle",
]


def arithmetic(rng: random.Random) -> Turns:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    question = rng.choice(
        [f"What is {a} {op} {b}?", f"Calculate {a} {op} {b}.", f"Can you compute {a} {op} {b} for me?"]
    )
    turns = [("user", question), ("assistant", f"{a} {op} {b} = {value}.")]
    if rng.random() < 0.25:
        c = rng.randint(2, 20)
        turns += [("user", f"And if you add {c} to that?"), ("assistant", f"{value} + {c} = {value + c}.")]
    return turns


def conversion(rng: random.Random) -> Turns:
    kind = rng.randrange(5)
    if kind == 0:
        km = rng.randint(1, 200)
        return [
            ("user", f"How many miles is {km} km?"),
            ("assistant", f"{km} km is about {km * 0.621371:.2f} miles (1 km = 0.621371 miles)."),
        ]
    if kind == 1:
        c = rng.randint(-30, 100)
        return [
            ("user", f"Convert {c} °C to Fahrenheit."),
            ("assistant", f"{c} °C = {c * 9 / 5 + 32:.1f} °F, using F = C * 9/5 + 32."),
        ]
    if kind == 2:
        kg = rng.randint(1, 150)
        return [("user", f"What is {kg} kg in pounds?"), ("assistant", f"{kg} kg is about {kg * 2.20462:.1f} pounds.")]
    if kind == 3:
        h = rng.randint(1, 48)
        return [
            ("user", f"How many minutes are in {h} hours?"),
            ("assistant", f"{h} hours = {h} * 60 = {h * 60} minutes."),
        ]
    m = rng.randint(1, 500)
    return [("user", f"How many centimeters are in {m} meters?"), ("assistant", f"{m} meters = {m * 100} centimeters.")]


def word_fact(rng: random.Random) -> Turns:
    kind = rng.randrange(6)
    word = rng.choice(WORDS)
    if kind == 0:
        return [
            ("user", f"How many letters are in the word '{word}'?"),
            ("assistant", f"The word '{word}' has {len(word)} letters."),
        ]
    if kind == 1:
        return [("user", f"Spell '{word}' backwards."), ("assistant", f"'{word}' backwards is '{word[::-1]}'.")]
    if kind == 2:
        vowels = sum(ch in "aeiou" for ch in word)
        return [("user", f"How many vowels does '{word}' have?"), ("assistant", f"'{word}' has {vowels} vowels.")]
    if kind == 3:
        country = rng.choice(sorted(CAPITALS))
        turns = [
            ("user", f"What is the capital of {country}?"),
            ("assistant", f"The capital of {country} is {CAPITALS[country]}."),
        ]
        if rng.random() < 0.3:
            other = rng.choice(sorted(set(CAPITALS) - {country}))
            turns += [("user", f"And of {other}?"), ("assistant", f"The capital of {other} is {CAPITALS[other]}.")]
        return turns
    if kind == 4:
        noun = rng.choice(sorted(PLURALS))
        return [
            ("user", f"What is the plural of '{noun}'?"),
            ("assistant", f"The plural of '{noun}' is '{PLURALS[noun]}'."),
        ]
    adjective = rng.choice(sorted(OPPOSITES))
    return [
        ("user", f"What is the opposite of '{adjective}'?"),
        ("assistant", f"The opposite of '{adjective}' is '{OPPOSITES[adjective]}'."),
    ]


CODE_TASKS = [
    ("returns the square of a number", "square", "x", "return x * x"),
    ("returns the cube of a number", "cube", "x", "return x ** 3"),
    ("adds up a list of numbers", "total", "numbers", "return sum(numbers)"),
    ("reverses a string", "reverse", "text", "return text[::-1]"),
    ("checks whether a number is even", "is_even", "n", "return n % 2 == 0"),
    ("returns the largest item of a list", "largest", "items", "return max(items)"),
    ("counts the vowels in a string", "count_vowels", "text", "return sum(ch in 'aeiou' for ch in text.lower())"),
    ("converts Celsius to Fahrenheit", "to_fahrenheit", "celsius", "return celsius * 9 / 5 + 32"),
    ("returns the first character of a string", "first_char", "text", "return text[0]"),
    ("doubles every item of a list", "double_all", "items", "return [2 * x for x in items]"),
]


def coding(rng: random.Random) -> Turns:
    task, name, arg, body = rng.choice(CODE_TASKS)
    intro = rng.choice([f"Here is a Python function that {task}:", f"This function {task}:"])
    reply = f"{intro}\n\n```python\ndef {name}({arg}):\n    {body}\n```"
    turns = [("user", f"Write a Python function that {task}."), ("assistant", reply)]
    if rng.random() < 0.2:
        turns += [
            ("user", "What is the function called?"),
            ("assistant", f"The function is called `{name}` and takes one argument, `{arg}`."),
        ]
    return turns


GENERATORS = [arithmetic, conversion, word_fact, coding]


def conversation(rng: random.Random) -> list[dict[str, str]]:
    turns = rng.choice(GENERATORS)(rng)
    if rng.random() < 0.1:
        turns += [
            ("user", rng.choice(["Thanks!", "Thank you.", "Great, thanks."])),
            ("assistant", rng.choice(["You're welcome!", "Glad to help."])),
        ]
    messages = [{"role": role, "content": content} for role, content in turns]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return messages


def to_sharegpt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]


def write_corpus(out_dir: Path) -> None:
    rng = random.Random(SEED)
    conversations = [conversation(rng) for _ in range(NUM_CONVERSATIONS)]
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "conversations.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for n, messages in enumerate(conversations):
            f.write(json.dumps({"id": f"sample-{n:04d}", "messages": messages}, ensure_ascii=False) + "\n")
    with open(out_dir / "sharegpt_small.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for n, messages in enumerate(conversations[:NUM_SHAREGPT]):
            record = {"id": f"sample-{n:04d}", "conversations": to_sharegpt(messages)}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "sample")
    write_corpus(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()
