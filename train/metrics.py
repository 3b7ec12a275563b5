"""Reading `metrics.jsonl`: one JSON object per line, appended by the trainer's rank 0.

Each record is written by one `write` of the line and its newline, so a crash (kill -9, power loss)
can leave only the last line cut short, without its newline: that line is dropped with a warning,
since its step is redone on resume. Any other line that is not a JSON object is damage the reader
cannot guess around: a `MetricsError` names the file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_pipeline.shared.errors import UserError


class MetricsError(UserError, ValueError):
    """A line of metrics.jsonl is not a JSON object (other than a cut-short last line)."""


def read_records(path: Path) -> tuple[list[dict], str | None]:
    """The records of `path` in order, and a warning when its cut-short last line was dropped."""
    text = path.read_text(errors="replace")
    lines = text.split("\n")  # the last piece is "" when the file ends with its newline
    records, warning = [], None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # no newline after it: the write was cut short
                warning = f"{path}: line {number} is cut short (a crash while it was written?); ignored"
                break
            raise MetricsError(f"{path}: line {number} is not a JSON record ({exc.msg}, column {exc.colno})") from None
        if not isinstance(record, dict):
            raise MetricsError(f"{path}: line {number} is not a JSON object but {type(record).__name__}")
        records.append(record)
    return records, warning
