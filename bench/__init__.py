"""Benchmarks: each prints ratios against a baseline measured in the same run (see RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, json_path: str | None) -> None:
    """Print a benchmark's result as JSON and, if asked, write the same text to `json_path`."""
    print(json.dumps(result, indent=1))
    keep(result, json_path)


def keep(result: dict, json_path: str | None) -> None:
    """`result` as JSON in `json_path`, if asked; also what a long benchmark has measured so far, so a call
    cut by the lent machine's limit still returns it (`emit` rewrites it whole at the end)."""
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
