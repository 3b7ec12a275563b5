"""`--chat-template-kwargs`: the template's options (Qwen3's enable_thinking) reach every render, the
loss mask, the generation prompt, the manifest and the store's resume check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_data_tokens import QWEN3_STYLE_TEMPLATE
from transformers import AutoTokenizer

from dflash_pipeline.data import sample_corpus_path
from dflash_pipeline.data.chat import generation_prompt_ids
from dflash_pipeline.data.records import Record, iter_records
from dflash_pipeline.data.tokens import tokenize_record
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.run import ExtractError, prepare_store, run_extraction
from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.shared.store.manifest import load_manifest
from dflash_pipeline.shared.store.reader import FeatureStore

# Qwen3's rendering of replies and generation prompt: a reply carries an (empty) think block before
# its content, and enable_thinking=false writes that block into the generation prompt. Unlike the
# real Qwen3 template it keeps the block in earlier turns too, so multi-turn chats stay prefix-stable.
_THINK_PROMPT = "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}"
assert QWEN3_STYLE_TEMPLATE.count(_THINK_PROMPT) == 1
QWEN3_LIKE_TEMPLATE = QWEN3_STYLE_TEMPLATE.replace(
    _THINK_PROMPT,
    (
        "{{- '<|im_start|>assistant\\n' -}}"
        "{%- if enable_thinking is defined and enable_thinking is false -%}"
        "{{- '<think>\\n\\n</think>\\n\\n' -}}"
        "{%- endif -%}"
    ),
)
NO_THINKING = {"enable_thinking": False}
CHAT = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three?"},
    {"role": "assistant", "content": "Five, no, six."},
]


@pytest.fixture(scope="module")
def qwen3_like_dir(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target with `QWEN3_LIKE_TEMPLATE` as its tokenizer's chat template."""
    out = tmp_path_factory.mktemp("qwen3_like")
    shutil.copytree(tiny_target_dir, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    tok.save_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template == QWEN3_LIKE_TEMPLATE
    return out


@pytest.fixture(scope="module")
def tok(qwen3_like_dir: Path):
    return AutoTokenizer.from_pretrained(qwen3_like_dir)


def masked_runs(sample, tok) -> list[str]:
    """The text of each run of loss-1 tokens."""
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [tok.decode(r) for r in runs]


def test_empty_think_block_is_reply_by_default_and_prompt_without_thinking(tok):
    record = Record(0, "chat.jsonl:1", messages=CHAT)
    default = tokenize_record(record, tok, None)
    no_thinking = tokenize_record(record, tok, None, chat_template_kwargs=NO_THINKING)
    # The conversation's text is the same either way (the option only changes the generation
    # prompt, as in Qwen3's template), so are the ids; the spans are not. A reply span starts where
    # the generation prompt ends, i.e. it is what the model generates: by default it writes the
    # empty think block itself (trained on), with enable_thinking=false the prompt already holds it
    # (context, loss 0) -- the reference DFlash recipe's rule, applied by render_with_reply_spans.
    assert np.array_equal(default.input_ids, no_thinking.input_ids)
    assert masked_runs(default, tok) == [
        "<think>\n\n</think>\n\nFour.<|im_end|>",
        "<think>\n\n</think>\n\nFive, no, six.<|im_end|>",
    ]
    assert masked_runs(no_thinking, tok) == ["Four.<|im_end|>", "Five, no, six.<|im_end|>"]


@pytest.mark.parametrize("kwargs", [None, NO_THINKING])
def test_generation_prompt_ids_line_up_with_the_tokenized_conversation(tok, kwargs):
    """A reply generated after `generation_prompt_ids` is what extraction tokenizes right behind them."""
    sample = tokenize_record(Record(0, "chat.jsonl:1", messages=CHAT), tok, None, chat_template_kwargs=kwargs)
    for turn in (1, 3):
        prompt = generation_prompt_ids(tok, CHAT[:turn], template_kwargs=kwargs)
        assert sample.input_ids[: len(prompt)].tolist() == prompt
        assert sample.loss_mask[len(prompt) - 1] == 0 and sample.loss_mask[len(prompt)] == 1
        hf = tok.apply_chat_template(
            CHAT[:turn], add_generation_prompt=True, tokenize=True, return_dict=False, **(kwargs or {})
        )
        assert prompt == list(hf)
    with_block = generation_prompt_ids(tok, CHAT[:1], template_kwargs=NO_THINKING)
    assert tok.decode(with_block[len(generation_prompt_ids(tok, CHAT[:1])) :]) == "<think>\n\n</think>\n\n"


def small_corpus(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(sample_corpus_path().read_text().splitlines()[:n]) + "\n")
    return path


def config(target: Path, data: Path, out: Path, kwargs: dict | None) -> ExtractConfig:
    return ExtractConfig(
        target=str(target),
        data=(str(data),),
        out=str(out),
        device="cpu",
        layers="0,2",
        batch_tokens=512,
        max_length=256,
        chat_template_kwargs=kwargs,
    )


def test_extraction_stores_the_kwargs_tokenization_and_refuses_other_kwargs(qwen3_like_dir, tok, tmp_path):
    data, out = small_corpus(tmp_path, 6), tmp_path / "store"
    run_extraction(config(qwen3_like_dir, data, out, NO_THINKING))

    assert json.loads(StoreLayout(out).manifest.read_text())["data"]["chat_template_kwargs"] == NO_THINKING
    records = list(iter_records(data))
    want = {r.index: tokenize_record(r, tok, 256, chat_template_kwargs=NO_THINKING) for r in records}
    store = FeatureStore(out)
    assert sorted(store[i].sample_index for i in range(len(store))) == sorted(want)
    for i in range(len(store)):
        s = store[i]
        assert np.array_equal(s.input_ids.numpy(), want[s.sample_index].input_ids)
        assert np.array_equal(s.loss_mask.numpy().astype(np.uint8), want[s.sample_index].loss_mask)
    default = tokenize_record(records[0], tok, 256)
    assert not np.array_equal(default.loss_mask, want[0].loss_mask)  # the kwargs did change what is stored

    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    run_extraction(config(qwen3_like_dir, data, out, dict(NO_THINKING)))  # same kwargs: complete, nothing to do
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    for other in ({"enable_thinking": True}, None):
        with pytest.raises(ExtractError, match="other settings.*chat_template_kwargs"):
            run_extraction(config(qwen3_like_dir, data, out, other))


def test_unfinished_store_resumes_with_the_same_kwargs_and_starts_over_with_others_while_empty(
    qwen3_like_dir, tmp_path
):
    """Other kwargs on a store with committed samples are refused (above, on a complete store)."""
    data, out = small_corpus(tmp_path, 2), tmp_path / "store"
    assert prepare_store(config(qwen3_like_dir, data, out, NO_THINKING), 1)[1] is False  # new, incomplete
    assert prepare_store(config(qwen3_like_dir, data, out, NO_THINKING), 1)[1] is False  # resumable
    assert load_manifest(out).data["chat_template_kwargs"] == NO_THINKING
    assert (
        prepare_store(config(qwen3_like_dir, data, out, {"enable_thinking": True}), 1)[1] is False
    )  # nothing committed
    assert load_manifest(out).data["chat_template_kwargs"] == {"enable_thinking": True}


def invoke_extract(monkeypatch, args: list[str]):
    """`dflash-extract ARGS` with run_extraction replaced: (result, the ExtractConfig it got)."""
    import dflash_pipeline.extract.run as run_module
    from dflash_pipeline.extract.cli import main

    seen = {}
    monkeypatch.setattr(run_module, "run_extraction", lambda cfg: seen.setdefault("cfg", cfg) and None)
    result = CliRunner().invoke(main, ["--target", "t", "--data", "d.jsonl", "--out", "o", *args])
    return result, seen.get("cfg")


@pytest.mark.parametrize(
    "toml, flag, want",
    [
        (None, '{"enable_thinking": false}', NO_THINKING),
        ("chat-template-kwargs = {enable_thinking = false}", None, NO_THINKING),  # TOML inline table
        ("chat_template_kwargs = '{\"enable_thinking\": false}'", None, NO_THINKING),  # JSON string
        ("chat-template-kwargs = {enable_thinking = false}", '{"a": [1, 2]}', {"a": [1, 2]}),  # the flag wins
        (None, None, None),
    ],
)
def test_cli_reads_the_kwargs_from_the_flag_or_the_config_file(monkeypatch, tmp_path, toml, flag, want):
    args = []
    if toml is not None:
        (tmp_path / "run.toml").write_text(f"[extract]\n{toml}\n")
        args += ["--config", str(tmp_path / "run.toml")]
    if flag is not None:
        args += ["--chat-template-kwargs", flag]
    result, cfg = invoke_extract(monkeypatch, args)
    assert result.exit_code == 0, result.output
    assert cfg.chat_template_kwargs == want


@pytest.mark.parametrize(
    "value, what",
    [
        ("[1]", "got '[1]'"),
        ('"x"', "got '\"x\"'"),
        ("null", "got 'null'"),
        ("{bad", "got '{bad' (Expecting"),
    ],
)
def test_cli_rejects_anything_but_a_json_object(monkeypatch, value, what):
    result, cfg = invoke_extract(monkeypatch, ["--chat-template-kwargs", value])
    assert_one_error_line(result, cfg, what)


@pytest.mark.parametrize(
    "toml, what",
    [
        ("chat-template-kwargs = [1]", "got [1]"),
        ("chat-template-kwargs = 'true'", "got 'true'"),
        ("chat-template-kwargs = {day = 2024-01-01}", "not JSON serializable"),
    ],
)
def test_cli_rejects_a_config_value_that_is_no_json_object(monkeypatch, tmp_path, toml, what):
    (tmp_path / "run.toml").write_text(f"[extract]\n{toml}\n")
    result, cfg = invoke_extract(monkeypatch, ["--config", str(tmp_path / "run.toml")])
    assert_one_error_line(result, cfg, what)


def assert_one_error_line(result, cfg, what: str) -> None:
    """A usage error (exit 2) before anything ran, told in one line naming the option."""
    assert result.exit_code == 2 and cfg is None, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "'--chat-template-kwargs'" in errors[0], result.output
    assert "expected a JSON object" in errors[0] and what in errors[0], result.output
