"""What a user can cause - bad data, a missing or foreign store, a wrong target or drafter, settings
that do not fit - raises a `UserError`: its message is one complete line naming the path or option
and what is wrong. Every CLI catches it once (`cli_errors`) and prints that line without a traceback;
anything else is a bug and keeps its traceback, except a write that failed for a full disk (`DiskFull` where
the write site names it, else recognised by `is_disk_full`). `--debug` or DFLASH_DEBUG=1 shows tracebacks always."""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import click

from dflash_pipeline.shared.runtime.stop import StopSignal, signal_exit, signal_name, signal_of

DEBUG_ENV = "DFLASH_DEBUG"
TORCHRUN_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torchrun's agent reads why a worker failed


class UserError(Exception):
    """Base of every error a user can cause and fix; the message is complete for the user."""


class DiskFull(UserError):
    """A write failed because its disk (or quota) is full; the message says what, where and what to do."""


NEARLY_FULL_BYTES = 64 * 2**20  # a failed write with less free than this is taken for a full disk


def is_disk_full(exc: BaseException, free_bytes: int | None = None) -> bool:
    """Whether `exc` is a write that failed for space: ENOSPC/EDQUOT or its text anywhere in its chain
    (safetensors keeps only the text), or, given the free bytes measured after it, an I/O error with
    almost nothing left (torch.save's writer drops the errno: it says `unexpected pos`)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, DiskFull):
            return True
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return free_bytes is not None and free_bytes < NEARLY_FULL_BYTES and isinstance(exc, (OSError, RuntimeError))


def user_line(exc: BaseException) -> str | None:
    """The one line a user gets for `exc`: a `UserError`'s, or a full disk's wherever no write site named
    it; None for anything else (a bug keeps its traceback)."""
    if isinstance(exc, UserError):
        return first_line(exc)
    return f"the disk is full: {first_line(exc)}" if is_disk_full(exc) else None


def debugging() -> bool:
    """True when tracebacks are wanted for user errors too (`--debug` or DFLASH_DEBUG=1)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def cli_errors(cli: str, stopped_hint: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a click command's function (below its options): adds `--debug`, and prints a
    `UserError` (or a failed worker rank) as `<cli>: error: <line>` with exit code 1, and a Ctrl-C or
    SIGTERM that stopped it at once as `<cli>: stopped by Ctrl-C; <stopped_hint>` with a shell's exit
    code for the signal (130, 143). Usage errors stay click's (exit code 2)."""
    from dflash_pipeline.shared.runtime.launch import RankFailed
    from dflash_pipeline.shared.runtime.progress import close_progress_bars

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def main(*args: Any, debug: bool = False, **kwargs: Any) -> Any:
            if debug:
                os.environ[DEBUG_ENV] = "1"  # worker processes inherit it
            try:
                return fn(*args, **kwargs)
            except (KeyboardInterrupt, StopSignal) as stop:
                if debugging():
                    raise
                close_progress_bars()
                how = f"stopped by {signal_name(signal_of(stop))}"
                said = f"{cli}: {how}" + (f"; {stopped_hint}" if stopped_hint else "")
                click.echo(said, err=True)
                tell_torchrun(said)
                sys.exit(signal_exit(signal_of(stop)))
            except Exception as exc:
                line = first_line(exc) if isinstance(exc, RankFailed) else user_line(exc)
                if line is None or debugging():
                    tell_torchrun(traceback.format_exc().rstrip())
                    raise
                close_progress_bars()
                said = f"{cli}: error: {line}"
                click.echo(said, err=True)
                tell_torchrun(said)
                sys.exit(1)

        return click.option("--debug", is_flag=True, help=f"Show tracebacks (also: {DEBUG_ENV}=1).")(main)

    return decorate


def tell_torchrun(why: str) -> None:
    """Under torchrun, write why this worker ends into the error file its agent reads: the agent's
    failure summary then shows this line (or traceback) instead of "error_file: <N/A>"."""
    path = os.environ.get(TORCHRUN_ERROR_FILE_ENV)
    if not path:
        return
    record = {"message": {"message": why, "extraInfo": {"py_callstack": why, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass  # the summary is the agent's extra: the worker's own output says it already
