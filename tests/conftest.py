"""Shared pytest fixtures.

Models and tokenizers here are tiny and built locally (never downloaded); session-scoped so the
whole suite builds each once. Add new shared fixtures below with a docstring saying what they give.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random Qwen3 target (4 layers, hidden 64, vocab 768) + ChatML tokenizer,
    loadable with AutoModelForCausalLM / AutoTokenizer.from_pretrained. Treat it as read-only."""
    from dflash_pipeline.data.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like `tiny_target_dir`, with the Llama architecture. Treat it as read-only."""
    from dflash_pipeline.data.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_target_dir: Path):
    """The tiny target's tokenizer, loaded through AutoTokenizer (shared: do not modify it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def sample_corpus() -> Path:
    """Path of the packaged sample corpus (300 OpenAI-format conversations, JSONL)."""
    from dflash_pipeline.data import sample_corpus_path

    return sample_corpus_path()


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory: pytest.TempPathFactory, sample_corpus: Path) -> Path:
    """The first 40 conversations of the sample corpus as a JSONL file: a store of it extracts in seconds."""
    path = tmp_path_factory.mktemp("small_corpus") / "corpus.jsonl"
    path.write_text("\n".join(sample_corpus.read_text().splitlines()[:40]) + "\n")
    return path


@pytest.fixture(scope="session")
def extract_cpu_store(tiny_target_dir: Path):
    """`extract(data, out, **settings) -> out`: the tiny target's store of a JSONL file, extracted on CPU
    in one process (max_length 256, 2048-token batches, unless `settings` say otherwise)."""
    from dflash_pipeline.extract.config import ExtractConfig
    from dflash_pipeline.extract.run import run_extraction

    def extract(data: Path, out: Path, **settings) -> Path:
        settings = {"max_length": 256, "batch_tokens": 2048, **settings}
        run_extraction(
            ExtractConfig(target=str(tiny_target_dir), data=(str(data),), out=str(out), device="cpu", **settings)
        )
        return out

    return extract


@pytest.fixture(scope="module")
def store(extract_cpu_store, small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target's store of the small corpus, one per test module that asks for it."""
    return extract_cpu_store(small_corpus, tmp_path_factory.mktemp("store") / "store")


@pytest.fixture
def lock_holder():
    """`hold(folder) -> Popen`: a child process that holds `folder`'s run lock (as a running
    dflash-extract or dflash-train does) until it is killed; killed at the end of the test."""
    import subprocess
    import sys

    holders: list[subprocess.Popen] = []
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from dflash_pipeline.shared.runtime.run_lock import run_lock\n"
        "with run_lock(Path(sys.argv[1]), 'holder'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n"
    )

    def hold(folder: Path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
        holders.append(proc)
        assert proc.stdout.readline() == "held\n"
        return proc

    yield hold
    for proc in holders:
        proc.kill()
        proc.wait()
