"""What a user can cause - bad data, a missing or foreign store, a wrong target or drafter, settings
that do not fit - raises a `UserError`: its message is one complete line naming the path or option
and what is wrong. Every CLI catches it once (`cli_errors`) and prints that line without a traceback;
anything else is a bug and keeps its traceback. `--debug` or DFLASH_DEBUG=1 shows tracebacks always."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import click

DEBUG_ENV = "DFLASH_DEBUG"


class UserError(Exception):
    """Base of every error a user can cause and fix; the message is complete for the user."""


def debugging() -> bool:
    """True when tracebacks are wanted for user errors too (`--debug` or DFLASH_DEBUG=1)."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def cli_errors(cli: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a click command's function (below its options): adds `--debug`, and prints a
    `UserError` (or a failed worker rank) as `<cli>: error: <line>` with exit code 1. Usage errors
    stay click's (exit code 2)."""
    from dflash_pipeline.shared.runtime.launch import RankFailed
    from dflash_pipeline.shared.runtime.progress import close_progress_bars

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def main(*args: Any, debug: bool = False, **kwargs: Any) -> Any:
            if debug:
                os.environ[DEBUG_ENV] = "1"  # worker processes inherit it
            try:
                return fn(*args, **kwargs)
            except (UserError, RankFailed) as exc:
                if debugging():
                    raise
                close_progress_bars()
                click.echo(f"{cli}: error: {first_line(exc)}", err=True)
                sys.exit(1)

        return click.option("--debug", is_flag=True, help=f"Show tracebacks (also: {DEBUG_ENV}=1).")(main)

    return decorate
