"""Content hashes that tie a feature store to exactly the data and tokenizer that produced it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .records import data_files

_CHUNK = 1 << 20


def _frame(h: Any, data: bytes) -> None:
    """Length-prefixed, so no two different field sequences hash the same bytes."""
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def data_fingerprint(paths: str | Path | Sequence[str | Path], settings: dict[str, Any]) -> str:
    """sha256 over every input file (relative name and bytes, streamed) and the JSON of `settings`
    (e.g. max_length, skip_bad): equal inputs give equal stores, any change gives a new hash."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    h = hashlib.sha256()
    for root in map(Path, paths):
        for file in data_files(root):
            _frame(h, (file.relative_to(root).as_posix() if root.is_dir() else file.name).encode())
            h.update(file.stat().st_size.to_bytes(8, "little"))
            with open(file, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
    _frame(h, json.dumps(settings, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the backend tokenizer JSON (vocab, merges, normalisation, post-processing), the
    chat template and the special tokens: everything that decides ids and loss masks."""
    h = hashlib.sha256()
    _frame(h, tokenizer.backend_tokenizer.to_str().encode())
    _frame(h, json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    specials = {
        "map": tokenizer.special_tokens_map,
        "all": tokenizer.all_special_tokens,
        "ids": tokenizer.all_special_ids,
    }
    _frame(h, json.dumps(specials, sort_keys=True, default=str).encode())
    return h.hexdigest()
