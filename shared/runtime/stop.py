"""A graceful stop on SIGTERM: what a scheduler's preemption, `timeout` or `kill` sends before SIGKILL.

The handler only records the signal; the training loop looks at step boundaries, where every rank can
agree to stop at the same step and write its checkpoint, so a stopped run resumes without losing steps.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_received: list[int] = []


def stop_requested() -> bool:
    """Whether this process got SIGTERM since `stopping_on_sigterm` began."""
    return bool(_received)


@contextmanager
def stopping_on_sigterm() -> Iterator[None]:
    """Record SIGTERM instead of dying by it, for the duration (main thread only: elsewhere signals
    cannot be handled, and the default stays)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _received.clear()
