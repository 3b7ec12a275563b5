"""Progress bars that stay readable in log files as well as in a terminal."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

LOG_INTERVAL_S = 30.0  # with stderr redirected to a log, one bar line (rate, ETA) per this many seconds


def progress_bar(**kwargs: Any) -> tqdm:
    """A tqdm on stderr. When stderr is not a terminal every refresh is a new log line, so refresh
    only every LOG_INTERVAL_S; tqdm's monitor thread forces a refresh after `maxinterval` (10 s by
    default), so that is raised to match."""
    if not sys.stderr.isatty():
        kwargs = {"mininterval": LOG_INTERVAL_S, "maxinterval": LOG_INTERVAL_S, **kwargs}
    return tqdm(dynamic_ncols=True, **kwargs)


def progress_note(message: str) -> None:
    """One line on stderr for a step no bar measures (starting processes, loading a model), so a
    long silence is explained; written through tqdm so that it does not break a bar in a terminal.
    Each line starts with the local time: the gaps between notes in a log are the steps' durations."""
    tqdm.write(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr)
    sys.stderr.flush()


def close_progress_bars() -> None:
    """End every open bar's line, so that an error printed next starts a line of its own."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def silence_library_bars() -> None:
    """Turn transformers' own bars ("Loading weights") off in this process. Ranks other than 0 call
    it: their bars would share stderr with rank 0's lines and break them mid-line, and rank 0's bar
    already shows the step."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
