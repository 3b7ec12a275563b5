"""`metrics.jsonl`: one JSON object per line, appended by the trainer's rank 0 (`MetricsLog`).

Each record is written by one `write` of the line and its newline, so a crash (kill -9, power loss)
can leave only the last line cut short, without its newline: that line is dropped with a warning,
since its step is redone on resume. Any other line that is not a JSON object is damage the reader
cannot guess around: a `MetricsError` names the file and line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dflash_pipeline.shared.runtime.durable import write_bytes_durably
from dflash_pipeline.shared.runtime.errors import UserError

# DFlash-2's loss terms: `pack_loss`'s stats keys -> the keys of training and eval records that hold them
LOSS_TERMS = {"ce": "ce_loss", "selector": "selector_loss"}


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


class MetricsLog:
    """metrics.jsonl on rank 0; on resume, lines after the resumed step are dropped first. A new
    run's log is started by its first record, so a run that fails before its first step leaves none."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None) -> None:
        self.path = path
        self.enabled = enabled
        self.mode = "w" if resume_step is None else "a"
        self.kept: list[dict] = []  # the records up to the resumed step, which a resumed run reports from
        if enabled and resume_step is not None and path.exists():
            records, warning = read_records(path)  # a line cut short by the crash is dropped
            if warning:
                print(f"dflash-train: warning: {warning}", file=sys.stderr)
            self.kept = [r for r in records if r.get("step", 0) <= resume_step]
            write_bytes_durably(
                path, "".join(json.dumps(r) + "\n" for r in self.kept).encode()
            )  # a crash keeps the old log

    def kept_results(self) -> tuple[float | None, float]:
        """(last tau, last logged tokens/s) of the kept records: what a resumed run that trains no
        further still reports."""
        tau, rate = None, 0.0
        for record in self.kept:
            tau = record["tau"] if record.get("type") == "eval" else tau
            rate = record.get("tokens_per_s", rate)
        return tau, rate

    def has_evaluation(self, step: int) -> bool:
        """Whether the kept records hold the evaluation of `step`."""
        return any(r.get("type") == "eval" and r.get("step") == step for r in self.kept)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, self.mode) as f:
                f.write(json.dumps(record) + "\n")
            self.mode = "a"


class Throughput:
    """Tokens per second over the window since the last `rate()` call (the window a log line covers)."""

    def __init__(self) -> None:
        self.tokens, self.start = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def rate(self) -> float:
        """The window's rate; a new window starts."""
        elapsed = time.perf_counter() - self.start
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        self.tokens, self.start = 0, time.perf_counter()
        return rate
