"""Fingerprints change exactly when the data, the settings or the tokenizer change."""

from __future__ import annotations

import shutil

from transformers import AutoTokenizer

from dflash_pipeline.data import data_fingerprint, tokenizer_fingerprint


def test_data_fingerprint_follows_content_names_and_settings(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.jsonl").write_text('{"text": "hello"}\n')
    (one / "b.jsonl").write_text('{"text": "world"}\n')
    settings = {"max_length": 128, "skip_bad": False}
    base = data_fingerprint(one, settings)
    assert len(base) == 64
    shutil.copytree(one, tmp_path / "two")  # same files elsewhere: same data
    assert data_fingerprint(tmp_path / "two", {"skip_bad": False, "max_length": 128}) == base
    assert data_fingerprint([one], settings) == base
    assert data_fingerprint(one, {"max_length": 64, "skip_bad": False}) != base
    (tmp_path / "two" / "b.jsonl").write_text('{"text": "worle"}\n')
    assert data_fingerprint(tmp_path / "two", settings) != base
    (one / "b.jsonl").rename(one / "c.jsonl")  # a file's name decides record order in a directory
    assert data_fingerprint(one, settings) != base
    # the split between files is part of the data, not only the concatenated bytes
    (tmp_path / "x.jsonl").write_text('{"text": "hello"}\n{"text": "world"}\n')
    (tmp_path / "y.jsonl").write_text("")
    assert data_fingerprint([tmp_path / "x.jsonl", tmp_path / "y.jsonl"], settings) != data_fingerprint(
        [one / "a.jsonl", one / "c.jsonl"], settings
    )


def test_data_fingerprint_ignores_how_the_path_is_typed(tmp_path, monkeypatch):
    """Relative, `./`, absolute and through a symlinked folder: the same files, the same data."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "link").symlink_to(tmp_path / "d")
    monkeypatch.chdir(tmp_path)
    for root in ("d", "d/a.jsonl"):
        spellings = [
            root,
            f"./{root}",
            str(tmp_path / root),
            str(tmp_path / root.replace("d", "link", 1)),
            f"link/../{root}",
        ]
        assert len({data_fingerprint(p, {}) for p in spellings}) == 1, root


def test_tokenizer_fingerprint(tiny_target_dir, tmp_path):
    base = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_target_dir))
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_target_dir)) == base
    changed = AutoTokenizer.from_pretrained(tiny_target_dir)
    changed.chat_template = changed.chat_template.replace("assistant", "bot")
    assert tokenizer_fingerprint(changed) != base
    extra = AutoTokenizer.from_pretrained(tiny_target_dir)
    extra.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert tokenizer_fingerprint(extra) != base
    extra.save_pretrained(tmp_path)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path)) == tokenizer_fingerprint(extra)
