"""`--regenerate`: replies are the target's own greedy/sampled output, cached crash-safely, and the
store holds prompt + regenerated reply."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash.data.chat import stop_token_ids
from dflash.data.records import Record, iter_records
from dflash.data.tokenize import tokenize_record
from dflash.extract.config import ExtractConfig
from dflash.extract.regenerate import RegenerateSettings, cache_path, read_cache, regenerate_records
from dflash.extract.run import run_extraction
from dflash.shared.manifest import load_manifest
from dflash.shared.speculative import target_greedy
from dflash.shared.store import FeatureStore

CONVERSATIONS = [
    [{"role": "user", "content": "What is a mole?"}, {"role": "assistant", "content": "An animal."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour"},
     {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another one?"},
     {"role": "assistant", "content": "Blue."}],
    [{"role": "user", "content": "Count to three, please, and explain why numbers exist at all."},
     {"role": "assistant", "content": "1 2 3"}],
]


def records() -> list[Record]:
    out = [Record(i, f"mem:{i + 1}", messages=m) for i, m in enumerate(CONVERSATIONS)]
    return out + [Record(len(out), f"mem:{len(out) + 1}", text="plain text has no prompt to answer")]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def regenerate(target, tokenizer, tmp_path, settings, loads=None, name="cache.jsonl"):
    def load():
        if loads is not None:
            loads.append(1)
        return target

    return regenerate_records(records(), load, tokenizer, settings, max_length=512, cache=tmp_path / name)


def test_greedy_replies_equal_target_greedy_decoding_turn_by_turn(target, tiny_tokenizer, tmp_path):
    settings = RegenerateSettings(max_new_tokens=12, batch_size=2, group_size=2)
    out, stats = regenerate(target, tiny_tokenizer, tmp_path, settings)
    stops = stop_token_ids(tiny_tokenizer, target.generation_config.eos_token_id)
    assert [r.index for r in out] == [0, 1, 2, 3]
    assert out[3].text == "plain text has no prompt to answer" and stats.kept == 1
    assert stats.replies == 4 and stats.conversations == 3
    for record in out[:3]:
        history = []
        for m in record.messages:
            if m["role"] == "assistant":  # each reply is what the target says after the new history
                prompt = tiny_tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
                prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
                want = target_greedy(target, torch.tensor(prompt), 12, stops).tokens
                body = [t for t in want if t not in stops]
                assert m["content"] == tiny_tokenizer.decode(body, skip_special_tokens=True)
            history.append(m)
    roles = [[m["role"] for m in r.messages] for r in out[:3]]
    assert roles == [[m["role"] for m in c] for c in CONVERSATIONS]
    assert out[1].messages[0] == CONVERSATIONS[1][0] and out[1].messages[3] == CONVERSATIONS[1][3]


def test_cache_resume_reuses_committed_groups_and_ignores_a_torn_line(target, tiny_tokenizer, tmp_path):
    settings = RegenerateSettings(max_new_tokens=8, temperature=1.0, seed=3, batch_size=2, group_size=2)
    full, _ = regenerate(target, tiny_tokenizer, tmp_path, settings, name="a.jsonl")
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 4
    # a crash after the first group was committed, in the middle of writing the second
    (tmp_path / "b.jsonl").write_text(lines[0] + lines[1] + lines[2][:9])
    loads: list[int] = []
    resumed, stats = regenerate(target, tiny_tokenizer, tmp_path, settings, loads=loads, name="b.jsonl")
    assert resumed == full and stats.reused == 2 and loads == [1]
    assert (tmp_path / "b.jsonl").read_text() == (tmp_path / "a.jsonl").read_text()
    again, stats = regenerate(target, tiny_tokenizer, tmp_path, settings, loads=loads, name="b.jsonl")
    assert again == full and stats.reused == 4 and loads == [1]  # nothing left: the model is not loaded


def test_sampling_follows_the_seed(target, tiny_tokenizer, tmp_path):
    def replies(seed, name):
        settings = RegenerateSettings(max_new_tokens=16, temperature=1.5, seed=seed, batch_size=4)
        out, _ = regenerate(target, tiny_tokenizer, tmp_path, settings, name=name)
        return [m["content"] for r in out[:3] for m in r.messages if m["role"] == "assistant"]

    assert replies(0, "s0") == replies(0, "s0b")
    assert replies(0, "s0") != replies(1, "s1")


def test_prompt_longer_than_max_length_cuts_the_conversation(target, tiny_tokenizer, tmp_path):
    settings = RegenerateSettings(max_new_tokens=4)
    prompt_two = tiny_tokenizer.apply_chat_template(CONVERSATIONS[1][:3], add_generation_prompt=True, tokenize=True)
    n = len(prompt_two["input_ids"] if hasattr(prompt_two, "keys") else prompt_two)
    out, stats = regenerate_records(records()[1:2], lambda: target, tiny_tokenizer, settings,
                                    max_length=n + 8, cache=tmp_path / "c.jsonl")
    roles = [m["role"] for m in out[0].messages]
    assert roles == ["system", "user", "assistant"] and stats.cut == 1 and stats.replies == 1


def test_extract_with_regenerate_stores_prompt_plus_generated_reply(tiny_target_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 3))
    settings = RegenerateSettings(max_new_tokens=10, batch_size=4).to_dict()
    out = tmp_path / "store"
    cfg = ExtractConfig(target=str(tiny_target_dir), data=(str(data),), out=str(out), device="cpu",
                        workers=2, batch_tokens=512, max_length=256, regenerate=settings, store_dtype="float32")
    summary = run_extraction(cfg)
    manifest = load_manifest(out)
    assert manifest.settings["regenerate"] == settings and settings["method"] == "greedy"
    assert manifest.data["counts"]["regenerated"]["replies"] == 12
    assert summary.regenerated["conversations"] == 9

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    cached = {**read_cache(cache_path(out, 0)), **read_cache(cache_path(out, 1))}
    assert sorted(cached) == list(range(9))
    store = FeatureStore(out)
    originals = {r.index: r for r in iter_records(data)}
    for i in range(len(store)):
        s = store[i]
        entry = cached[s.sample_index]
        want = tokenize_record(Record(s.sample_index, "x", messages=entry["messages"]), tokenizer, 256)
        assert np.array_equal(s.input_ids.numpy(), want.input_ids)
        assert np.array_equal(s.loss_mask.numpy().astype(np.uint8), want.loss_mask)
        user_turns = [m for m in originals[s.sample_index].messages if m["role"] != "assistant"]
        assert [m for m in entry["messages"] if m["role"] != "assistant"] == user_turns

    # a rerun with other generation settings is another store, refused
    other = ExtractConfig(**{**cfg.to_dict(), "regenerate": {**settings, "max_new_tokens": 11}})
    with pytest.raises(Exception, match="other settings"):
        run_extraction(other)
