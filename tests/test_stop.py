"""shared/runtime/stop.py: SIGTERM and Ctrl-C recorded for a graceful stop, raised at once where the work
in progress is dropped rather than waited for, and a second Ctrl-C that stops at once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dflash_pipeline.shared.runtime import stop
from dflash_pipeline.shared.runtime.stop import (
    Interrupted,
    interrupting_on_stop,
    stop_cause,
    stop_requested,
    stopping_gracefully,
)


@pytest.mark.parametrize("signum, cause", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "Ctrl-C")])
def test_a_stop_signal_interrupts_inside_and_on_entry_after_one_came_and_is_recorded_around(signum, cause) -> None:
    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    with stopping_gracefully():
        with interrupting_on_stop():  # nothing came yet: the body runs
            entered = True
        assert entered and not stop_requested()
        with pytest.raises(Interrupted), interrupting_on_stop():
            os.kill(os.getpid(), signum)  # the handler runs as this call returns
            pytest.fail("the signal did not interrupt")
        assert stop_requested() and stop_cause() == cause
        with pytest.raises(Interrupted), interrupting_on_stop():  # one came before: raised on entry
            pytest.fail("the body ran after the signal")
        os.kill(os.getpid(), signum)  # outside, and within the first's moment: recorded only
        assert stop_requested()
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers and not stop_requested()


def test_a_second_ctrl_c_stops_at_once_while_copies_of_the_first_and_sigterms_are_only_recorded(monkeypatch) -> None:
    monkeypatch.setattr(stop, "REPEAT_GAP_S", 0.3)
    with stopping_gracefully():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy of the terminal's press
        time.sleep(0.4)
        os.kill(os.getpid(), signal.SIGTERM)  # not a Ctrl-C: recorded only
        assert stop_cause() == "Ctrl-C"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("a second Ctrl-C did not stop at once")


def test_a_stop_signal_raises_once_inside_stopping_at_once_and_the_handlers_come_back() -> None:
    from dflash_pipeline.shared.runtime.stop import StopSignal, signal_of, stopping_at_once

    handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    with pytest.raises(StopSignal) as stopped, stopping_at_once():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            pytest.fail("SIGTERM did not stop")
        finally:  # the unwinding: a copy of the signal must not raise again here
            os.kill(os.getpid(), signal.SIGINT)
    assert signal_of(stopped.value) == signal.SIGTERM
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == handlers
