"""Progress bars refresh rarely when stderr is a log file, and as usual in a terminal."""

import io
import sys

import pytest
import tqdm.std

from dflash_pipeline.shared.runtime.progress import LOG_INTERVAL_S, progress_bar


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def refreshes(tty: bool, monkeypatch: pytest.MonkeyPatch, seconds: int = 300) -> int:
    """Bar lines written for one update per (fake) second over `seconds`."""
    clock = [0.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])
    stream = Stream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    bar = progress_bar(total=seconds, unit="step", desc="t", disable=False)
    for _ in range(seconds):
        clock[0] += 1.0
        bar.update(1)
    bar.close()
    return stream.getvalue().count("\r")


def test_log_gets_one_line_per_interval(monkeypatch):
    assert refreshes(False, monkeypatch) <= 300 / LOG_INTERVAL_S + 2  # + the opening and closing lines


def test_terminal_refreshes_every_update(monkeypatch):
    assert refreshes(True, monkeypatch) >= 300
