"""A graceful stop on SIGTERM (what a scheduler's preemption, `timeout` or `kill` sends before SIGKILL)
or Ctrl-C (SIGINT, what a user at the terminal presses).

The handler only records the signal; the training loop looks at step boundaries, where every rank can
agree to stop at the same step and write its checkpoint, so a stopped run resumes without losing steps.
Work too long to wait for and cheap to redo (one prompt's decoding) runs inside `interrupting_on_stop`,
where the signal also raises `Interrupted` at once; work that resumes wherever it stops (extraction)
runs inside `stopping_at_once`, where it raises `StopSignal`. A second Ctrl-C stops at once (KeyboardInterrupt):
the way out of a wait that reaches no step boundary. A terminal's Ctrl-C reaches every process of its
group and a launcher forwards it too, so copies that arrive within REPEAT_GAP_S of the first are one press.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_GAP_S = 1.0
_received: list[tuple[int, float]] = []  # (signal, monotonic time) of each stop signal that came


class Interrupted(Exception):
    """A stop signal arrived inside `interrupting_on_stop`."""


class StopSignal(BaseException):
    """SIGTERM or Ctrl-C where work stops where it is (`stopping_at_once`) and unwinds, closing what it
    holds; a BaseException, as KeyboardInterrupt is, so that no `except Exception` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def signal_of(stop: BaseException) -> int:
    """The signal a `StopSignal` or KeyboardInterrupt stands for."""
    return stop.signum if isinstance(stop, StopSignal) else signal.SIGINT


class StoppedTogether(Exception):
    """Raised by every rank at the same point after they agreed to stop (training at a step boundary):
    the launcher lets each unwind by itself instead of stopping the others as after a failure."""


def stop_requested() -> bool:
    """Whether this process got a stop signal since `stopping_gracefully` began."""
    return bool(_received)


def signal_name(signum: int) -> str:
    """How a stop is named to the user: SIGINT is what their Ctrl-C sent."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def signal_exit(signum: int) -> int:
    """A process's exit status after it stopped on `signum`, as a shell's (143 for SIGTERM, 130 for Ctrl-C)."""
    return 128 + signum


def stop_signal() -> int | None:
    """The first stop signal that came since `stopping_gracefully` began, if any."""
    return _received[0][0] if _received else None


def stop_cause() -> str:
    """The first stop signal's name, for the line that says why a run stopped."""
    return signal_name(stop_signal() or signal.SIGTERM)


def stop_votes() -> list[float]:
    """This process's stop signals as 0/1 per STOP_SIGNALS entry, for ranks to sum: a rank stopped by
    another's signal learns which one it was (`cause_of`)."""
    got = {signum for signum, _ in _received}
    return [float(signum in got) for signum in STOP_SIGNALS]


def cause_of(votes: list[float]) -> str | None:
    """The stop signals that summed `stop_votes` name ("SIGTERM", "Ctrl-C", both); None if none came."""
    return " and ".join(signal_name(signum) for signum, n in zip(STOP_SIGNALS, votes) if n > 0) or None


def _record(signum: int) -> None:
    """Note a stop signal; a Ctrl-C pressed again (not a copy of the first press) raises KeyboardInterrupt."""
    now = time.monotonic()
    again = signum == signal.SIGINT and any(s == signal.SIGINT and now - t >= REPEAT_GAP_S for s, t in _received)
    _received.append((signum, now))
    if again:
        raise KeyboardInterrupt


def _set_handlers(handler) -> dict[int, object]:
    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def _restore(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@contextmanager
def stopping_gracefully(
    forward_to: Callable[[], Iterable[int]] = tuple, announce: Callable[[int], str] | None = None
) -> Iterator[None]:
    """Record SIGTERM and Ctrl-C instead of dying by them, for the duration, and send them on to the
    processes `forward_to()` names (children that stop themselves, which this one then waits for).
    `announce(signal)`: a line for stderr at the first signal, saying what happens now (the stop can
    wait for a long step: a first compile takes minutes). Main thread only: elsewhere signals cannot
    be handled, and the defaults stay."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signum, frame) -> None:
        for pid in forward_to():
            with suppress(ProcessLookupError):  # it ended since `forward_to` looked
                os.kill(pid, signum)
        first = not _received
        _record(signum)
        if first and announce is not None:  # os.write: the handler may have cut a print to stderr short
            os.write(2, f"\n{announce(signum)}\n".encode())

    _received.clear()
    previous = _set_handlers(record)
    try:
        yield
    finally:
        _restore(previous)
        _received.clear()


def _raise_stop_signal(signum: int, frame: object = None) -> None:
    """A signal handler: ignore further stop signals (a terminal's Ctrl-C and a launcher's copy of it
    arrive moments apart, and a second would cut the unwinding short), then raise `StopSignal`."""
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise StopSignal(signum)


@contextmanager
def stopping_at_once() -> Iterator[None]:
    """SIGTERM and Ctrl-C raise `StopSignal` for the duration: for work that resumes wherever it stops
    (extraction keeps its committed batches). Main thread only, as `stopping_gracefully`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = _set_handlers(_raise_stop_signal)
    try:
        yield
    finally:
        _restore(previous)


@contextmanager
def interrupting_on_stop() -> Iterator[None]:
    """Inside `stopping_gracefully`: a stop signal, recorded as there, also raises `Interrupted` here at
    once (on entry too, if one came before), for work whose partial result is dropped, not waited for."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        _record(signum)
        raise Interrupted

    previous = _set_handlers(interrupt)
    try:
        if _received:
            raise Interrupted
        yield
    finally:
        _restore(previous)
