"""A graceful stop on SIGTERM: what a scheduler's preemption, `timeout` or `kill` sends before SIGKILL.

The handler only records the signal; the training loop looks at step boundaries, where every rank can
agree to stop at the same step and write its checkpoint, so a stopped run resumes without losing steps.
Work too long to wait for and cheap to redo (one prompt's decoding) runs inside `interrupting_on_sigterm`,
where the signal also raises `Interrupted` at once.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress

_received: list[int] = []


class Interrupted(Exception):
    """SIGTERM arrived inside `interrupting_on_sigterm`."""


def stop_requested() -> bool:
    """Whether this process got SIGTERM since `stopping_on_sigterm` began."""
    return bool(_received)


@contextmanager
def stopping_on_sigterm(forward_to: Callable[[], Iterable[int]] = tuple) -> Iterator[None]:
    """Record SIGTERM instead of dying by it, for the duration, and send it on to the processes
    `forward_to()` names (children that stop themselves, which this one then waits for). Main thread
    only: elsewhere signals cannot be handled, and the default stays."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signum, frame) -> None:
        _received.append(signum)
        for pid in forward_to():
            with suppress(ProcessLookupError):  # it ended since `forward_to` looked
                os.kill(pid, signal.SIGTERM)

    _received.clear()
    previous = signal.signal(signal.SIGTERM, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _received.clear()


@contextmanager
def interrupting_on_sigterm() -> Iterator[None]:
    """Inside `stopping_on_sigterm`: SIGTERM, recorded as there, also raises `Interrupted` here at once
    (on entry too, if one came before), for work whose partial result is dropped, not waited for."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        _received.append(signum)
        raise Interrupted

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        if _received:
            raise Interrupted
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
