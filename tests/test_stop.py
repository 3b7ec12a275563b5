"""shared/runtime/stop.py: SIGTERM recorded for a graceful stop, and raised at once where the work in
progress is dropped rather than waited for."""

from __future__ import annotations

import os
import signal

import pytest

from dflash_pipeline.shared.runtime.stop import (
    Interrupted,
    interrupting_on_sigterm,
    stop_requested,
    stopping_on_sigterm,
)


def test_sigterm_interrupts_inside_and_on_entry_after_one_came_and_is_recorded_around() -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with stopping_on_sigterm():
        with interrupting_on_sigterm():  # nothing came yet: the body runs
            entered = True
        assert entered and not stop_requested()
        with pytest.raises(Interrupted), interrupting_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs as this call returns
            pytest.fail("SIGTERM did not interrupt")
        assert stop_requested()
        with pytest.raises(Interrupted), interrupting_on_sigterm():  # one came before: raised on entry
            pytest.fail("the body ran after SIGTERM")
        os.kill(os.getpid(), signal.SIGTERM)  # outside: recorded only
        assert stop_requested()
    assert signal.getsignal(signal.SIGTERM) == handler and not stop_requested()
