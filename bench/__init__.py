"""Benchmarks: each prints ratios against a baseline measured in the same run (see RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, json_path: str | None) -> None:
    """Print a benchmark's result as JSON and, if asked, write the same text to `json_path`."""
    text = json.dumps(result, indent=1)
    print(text)
    if json_path:
        Path(json_path).write_text(text)
