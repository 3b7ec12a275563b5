"""`--regenerate`: replies are the target's own greedy/sampled output, the same whatever the batching,
worker count or a kill -9 and rerun; cached crash-safely; the store holds prompt + regenerated reply."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_pipeline.data.chat import UNFINISHED, stop_token_ids
from dflash_pipeline.data.records import Record, iter_records
from dflash_pipeline.data.tokens import tokenize_record
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.regenerate import RegenerateSettings, read_cache, regenerate_records
from dflash_pipeline.extract.run import run_extraction
from dflash_pipeline.shared.generation.engine import EngineSettings
from dflash_pipeline.shared.generation.speculative import target_generate
from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.shared.store.manifest import load_manifest
from dflash_pipeline.shared.store.reader import FeatureStore, stores_equal

CONVERSATIONS = [
    [{"role": "user", "content": "What is a mole?"}, {"role": "assistant", "content": "An animal."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Blue."},
    ],
    [
        {"role": "user", "content": "Count to three, please, and explain why numbers exist at all."},
        {"role": "assistant", "content": "1 2 3"},
    ],
]


def records() -> list[tuple[int, Record]]:
    out = [Record(i, f"mem:{i + 1}", messages=m) for i, m in enumerate(CONVERSATIONS)]
    out.append(Record(len(out), f"mem:{len(out) + 1}", text="plain text has no prompt to answer"))
    return [(r.index, r) for r in out]


def replies_of(out: list[tuple[int, Record]]) -> dict[int, list[str]]:
    return {i: [m["content"] for m in r.messages if m["role"] == "assistant"] for i, r in out if r.messages}


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def regenerate(target, tokenizer, tmp_path, settings, loads=None, name="cache.jsonl", max_batch=2):
    def load():
        if loads is not None:
            loads.append(1)
        return target

    out, stats, _ = regenerate_records(
        records(),
        load,
        tokenizer,
        settings,
        max_length=512,
        cache=tmp_path / name,
        engine=EngineSettings(max_batch=max_batch, page_size=8),
    )
    return out, stats


def test_greedy_replies_equal_target_greedy_decoding_turn_by_turn(target, tiny_tokenizer, tmp_path):
    settings = RegenerateSettings(max_new_tokens=12)
    out, stats = regenerate(target, tiny_tokenizer, tmp_path, settings)
    stops = stop_token_ids(tiny_tokenizer, target.generation_config.eos_token_id)
    assert [i for i, _ in out] == [0, 1, 2, 3]
    out = [r for _, r in out]
    assert out[3].text == "plain text has no prompt to answer" and stats.kept == 1
    assert stats.replies == 4 and stats.conversations == 3
    for record in out[:3]:
        history = []
        for m in record.messages:
            if m["role"] == "assistant":  # each reply is what the target says after the new history
                prompt = tiny_tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
                prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
                want = target_generate(target, torch.tensor(prompt), 12, stops).tokens
                body = [t for t in want if t not in stops]
                assert m["content"] == tiny_tokenizer.decode(body, skip_special_tokens=True)
            history.append(m)
    roles = [[m["role"] for m in r.messages] for r in out[:3]]
    assert roles == [[m["role"] for m in c] for c in CONVERSATIONS]
    assert out[1].messages[0] == CONVERSATIONS[1][0] and out[1].messages[3] == CONVERSATIONS[1][3]


def test_a_reply_cut_at_max_new_tokens_is_marked_and_gets_no_end_of_turn_label(target, tiny_tokenizer, tmp_path):
    """The target never wrote an end-of-turn after a cut reply: the template's is context, not a label."""
    out, stats = regenerate(target, tiny_tokenizer, tmp_path, RegenerateSettings(max_new_tokens=6))
    stops = stop_token_ids(tiny_tokenizer, target.generation_config.eos_token_id)
    conversations = [r for _, r in out if r.messages]
    replies = [m for r in conversations for m in r.messages[1:] if m["role"] == "assistant"]
    assert stats.unfinished == sum(m.get(UNFINISHED, False) for m in replies) > 0
    for record in conversations:
        sample = tokenize_record(record, tiny_tokenizer, None)
        unmarked = [{k: v for k, v in m.items() if k != UNFINISHED} for m in record.messages]
        whole = tokenize_record(Record(record.index, record.source, messages=unmarked), tiny_tokenizer, None)
        assert np.array_equal(sample.input_ids, whole.input_ids)
        dropped = whole.loss_mask.astype(bool) & ~sample.loss_mask.astype(bool)
        assert not (sample.loss_mask.astype(bool) & ~whole.loss_mask.astype(bool)).any()
        assert set(sample.input_ids[dropped].tolist()) <= stops
        assert dropped.sum() == sum(m.get(UNFINISHED, False) for m in record.messages)


def test_cache_resume_reuses_committed_conversations_and_ignores_a_torn_line(target, tiny_tokenizer, tmp_path):
    settings = RegenerateSettings(max_new_tokens=8, temperature=1.0, seed=3)
    full, _ = regenerate(target, tiny_tokenizer, tmp_path, settings, name="a.jsonl")
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 3  # one per conversation; the plain-text record needs no line
    # a crash after one conversation was committed, in the middle of writing the next
    (tmp_path / "b.jsonl").write_text(lines[0] + lines[1][:9])
    loads: list[int] = []
    resumed, stats = regenerate(target, tiny_tokenizer, tmp_path, settings, loads=loads, name="b.jsonl")
    assert resumed == full and stats.reused == 1 and loads == [1]
    assert sorted(read_cache(tmp_path / "b.jsonl").items()) == sorted(read_cache(tmp_path / "a.jsonl").items())
    again, stats = regenerate(target, tiny_tokenizer, tmp_path, settings, loads=loads, name="b.jsonl")
    assert again == full and stats.reused == 3 and loads == [1]  # nothing left: the model is not loaded


def test_sampled_replies_follow_the_seed_not_the_batch_size(target, tiny_tokenizer, tmp_path):
    def replies(seed, name, max_batch):
        settings = RegenerateSettings(max_new_tokens=16, temperature=1.5, top_k=100, seed=seed)
        return replies_of(regenerate(target, tiny_tokenizer, tmp_path, settings, name=name, max_batch=max_batch)[0])

    assert replies(0, "s0", 1) == replies(0, "s0b", 4)
    assert replies(0, "s0", 1) != replies(1, "s1", 1)


def test_fp8_kv_cache_is_a_setting_of_the_replies(target, tiny_tokenizer, tmp_path):
    """`--kv-cache-dtype float8_e4m3fn` reaches the engine (other replies than the lossless default)
    and the fingerprinted settings; the default leaves them as they were before the option."""
    lossless = RegenerateSettings(max_new_tokens=16)
    fp8 = RegenerateSettings(max_new_tokens=16, kv_cache_dtype="float8_e4m3fn")
    assert "kv_cache_dtype" not in lossless.to_dict() and fp8.to_dict()["kv_cache_dtype"] == "float8_e4m3fn"
    assert RegenerateSettings.from_dict(fp8.to_dict()) == fp8
    assert RegenerateSettings.from_dict(lossless.to_dict()) == lossless
    want = replies_of(regenerate(target, tiny_tokenizer, tmp_path, lossless, name="bf")[0])
    got = replies_of(regenerate(target, tiny_tokenizer, tmp_path, fp8, name="f8")[0])
    assert got.keys() == want.keys() and got != want


def test_samples_per_prompt_gives_n_samples_that_stay_in_one_holdout_group(target, tiny_tokenizer, tmp_path):
    settings = RegenerateSettings(max_new_tokens=10, temperature=1.5, seed=0, samples_per_prompt=3)
    out, stats = regenerate(target, tiny_tokenizer, tmp_path, settings)
    assert [i for i, _ in out] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # record i -> samples 3i..3i+2; plain text once
    assert stats.conversations == 9 and stats.replies == 12 and stats.kept == 1
    replies = replies_of(out)
    assert len({tuple(replies[i]) for i in (0, 1, 2)}) > 1  # other draws, not copies
    assert all(out[3 * c + s][1].messages[0] == CONVERSATIONS[c][0] for c in range(3) for s in range(3))
    # the first sample of each conversation is the same whatever N: its key holds sample 0
    single, _ = regenerate(
        target, tiny_tokenizer, tmp_path, RegenerateSettings(max_new_tokens=10, temperature=1.5), name="single.jsonl"
    )
    assert [replies[3 * c] for c in range(3)] == [replies_of(single)[c] for c in range(3)]


def test_prompt_longer_than_max_length_cuts_the_conversation(target, tiny_tokenizer, tmp_path):
    settings = RegenerateSettings(max_new_tokens=4)
    prompt_two = tiny_tokenizer.apply_chat_template(CONVERSATIONS[1][:3], add_generation_prompt=True, tokenize=True)
    n = len(prompt_two["input_ids"] if hasattr(prompt_two, "keys") else prompt_two)
    out, stats, _ = regenerate_records(
        records()[1:2],
        lambda: target,
        tiny_tokenizer,
        settings,
        max_length=n + 8,
        cache=tmp_path / "c.jsonl",
        engine=EngineSettings(max_batch=2),
    )
    roles = [m["role"] for m in out[0][1].messages]
    assert roles == ["system", "user", "assistant"] and stats.cut == 1 and stats.replies == 1


def test_extract_with_regenerate_stores_prompt_plus_generated_reply(tiny_target_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 3))
    settings = RegenerateSettings(max_new_tokens=10).to_dict()
    out = tmp_path / "store"
    cfg = ExtractConfig(
        target=str(tiny_target_dir),
        data=(str(data),),
        out=str(out),
        device="cpu",
        workers=2,
        batch_tokens=512,
        max_length=256,
        regenerate=settings,
        store_dtype="float32",
    )
    summary = run_extraction(cfg)
    manifest = load_manifest(out)
    assert manifest.settings["regenerate"] == settings and settings["method"] == "greedy"
    assert manifest.data["counts"]["regenerated"]["replies"] == 12
    assert summary.regenerated["conversations"] == 9
    # two processes generated at once: the line's seconds are the slower one's, not the two added up
    tokens, added_up, wall = summary.generated_tokens, summary.generate_seconds, summary.generate_wall_s
    assert tokens > 0 and added_up / 2 <= wall < added_up
    assert summary.lines()[-1] == (
        f"generation {tokens:,} generated now in {wall:.1f} s ({tokens / added_up:,.0f} tok/s per process, "
        f"{tokens / wall:,.0f} in all)"
    )

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    cached = {**read_cache(StoreLayout(out).regenerated_file(0)), **read_cache(StoreLayout(out).regenerated_file(1))}
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

    # a rerun with other generation settings is another store, refused; the fp8 KV cache is one
    for changed in ({"max_new_tokens": 11}, {"kv_cache_dtype": "float8_e4m3fn"}):
        other = ExtractConfig(**{**cfg.to_dict(), "regenerate": {**settings, **changed}})
        with pytest.raises(Exception, match="other settings"):
            run_extraction(other)


def regenerate_command(target: Path, data: Path, out: Path, workers: int, gen_batch: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dflash_pipeline.extract.cli",
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--workers",
        str(workers),
        "--max-length",
        "160",
        "--store-dtype",
        "float32",
        "--regenerate",
        "--temperature",
        "1.0",
        "--top-p",
        "0.95",
        "--seed",
        "5",
        "--max-new-tokens",
        "24",
        "--gen-batch-size",
        str(gen_batch),
    ]


def regenerated_entries(out: Path) -> dict[int, dict]:
    entries: dict[int, dict] = {}
    for path in sorted((out / "regenerated").glob("rank-*.jsonl")):
        entries.update(read_cache(path))
    return entries


@pytest.mark.slow
def test_sampled_replies_survive_other_worker_counts_and_kill_9(tiny_target_dir, sample_corpus, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(sample_corpus.read_text().splitlines()[:48]) + "\n")
    one = tmp_path / "one"
    first = subprocess.run(regenerate_command(tiny_target_dir, data, one, 1, 5), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert re.search(r"\d\d:\d\d:\d\d regenerate rank 0: generation engine built in \d+\.\d s\n", first.stderr)
    two = tmp_path / "two"
    subprocess.run(regenerate_command(tiny_target_dir, data, two, 2, 3), check=True, capture_output=True)
    want = regenerated_entries(one)
    assert len(want) == 48 and regenerated_entries(two) == want

    killed = tmp_path / "killed"
    cmd = regenerate_command(tiny_target_dir, data, killed, 2, 3)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while not regenerated_entries(killed) if (killed / "regenerated").exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before committing a conversation"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    partial = regenerated_entries(killed)
    assert 0 < len(partial) < 48 and not load_manifest(killed).complete
    rerun = subprocess.run(cmd, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert regenerated_entries(killed) == want
    assert stores_equal(killed, two)


def test_an_architecture_the_engine_cannot_run_is_refused_before_anything_is_written(
    tiny_tokenizer, sample_corpus, tmp_path
):
    from transformers import GPT2Config, GPT2LMHeadModel

    target = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=len(tiny_tokenizer),
            bos_token_id=None,
            eos_token_id=tiny_tokenizer.eos_token_id,
        )
    ).save_pretrained(target)
    tiny_tokenizer.save_pretrained(target)
    out = tmp_path / "store"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_pipeline.extract.cli",
            "--target",
            str(target),
            "--data",
            str(sample_corpus),
            "--out",
            str(out),
            "--device",
            "cpu",
            "--limit",
            "4",
            "--layers",
            "0,1",
            "--regenerate",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "dflash-extract: error: model_type 'gpt2': the generation engine runs llama" in run.stderr
    assert "vLLM or SGLang" in run.stderr and not out.exists()
