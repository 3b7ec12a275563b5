"""`spawn_ranks` when one rank fails: its line reaches the user, and the others unwind before they end;
when the ranks stop together, or on Ctrl-C, none is signalled while it unwinds."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.runtime.launch import RankFailed, spawn_ranks
from dflash_pipeline.shared.runtime.stop import StoppedTogether, stopping_gracefully


def _one_fails_the_other_works(rank: int, folder: str, failure: type[Exception]) -> None:
    started = Path(folder) / f"started-{rank}"
    if rank == 0:
        while not (Path(folder) / "started-1").exists():  # rank 1 is at work when rank 0 fails
            time.sleep(0.01)
        raise failure("record 3 is bad")
    try:
        started.touch()
        time.sleep(600)
    finally:  # what a killed rank never runs: its pools, bars and semaphores are closed here
        (Path(folder) / "unwound-1").touch()


@pytest.mark.parametrize("failure, user_error", [(UserError, True), (RuntimeError, False)])
def test_when_a_rank_fails_the_others_unwind_and_the_line_says_what_failed(tmp_path, failure, user_error, capfd):
    with pytest.raises(RankFailed, match=r"^rank 0: record 3 is bad$") as failed:
        spawn_ranks(_one_fails_the_other_works, 2, (str(tmp_path), failure))
    assert failed.value.user_error is user_error  # a UserError's line says itself whether a rerun helps
    assert (tmp_path / "unwound-1").exists()
    assert "rank 1" not in capfd.readouterr().err  # the rank stopped has no line of its own


class _AllStop(UserError, StoppedTogether):
    """As training's stop at a step boundary: every rank raises it after the same step."""


def _stop_together(rank: int, folder: str) -> None:
    try:
        raise _AllStop("stopped after step 3")
    finally:  # rank 1 unwinds slowly (closing its loader's workers): a signal now would cut it short
        if rank == 1:
            time.sleep(1.0)
        (Path(folder) / f"unwound-{rank}").touch()


def test_ranks_that_stop_together_unwind_without_being_signalled(tmp_path, capfd):
    with pytest.raises(RankFailed, match=r"^rank \d: stopped after step 3$") as stopped:
        spawn_ranks(_stop_together, 2, (str(tmp_path),))
    assert stopped.value.user_error
    assert (tmp_path / "unwound-0").exists() and (tmp_path / "unwound-1").exists()
    assert "Traceback" not in capfd.readouterr().err


def _waits_for_a_step_boundary(rank: int, folder: str) -> None:
    """A training rank in a wait that never reaches a step boundary: a Ctrl-C is only recorded."""
    try:
        with stopping_gracefully():
            (Path(folder) / f"started-{rank}").touch()
            deadline = time.monotonic() + 30  # a test that fails ends too
            while time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        (Path(folder) / f"unwound-{rank}").touch()


def test_a_second_ctrl_c_stops_ranks_that_wait_for_a_step_boundary(tmp_path):
    """Sent to the launcher alone (`kill -INT`), which passes each press on; the first is only recorded."""

    after_the_first: list[bool] = []

    def press_twice() -> None:
        while not all((tmp_path / f"started-{rank}").exists() for rank in (0, 1)):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2.0)
        after_the_first.extend((tmp_path / f"unwound-{rank}").exists() for rank in (0, 1))
        os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_twice)
    presser.start()
    with pytest.raises(KeyboardInterrupt):
        spawn_ranks(_waits_for_a_step_boundary, 2, (str(tmp_path),))
    presser.join()
    assert after_the_first == [False, False]  # still waiting for their step boundary
    assert (tmp_path / "unwound-0").exists() and (tmp_path / "unwound-1").exists()


def _unwinds_slowly(rank: int, folder: str) -> None:
    try:
        (Path(folder) / "started").touch()
        time.sleep(30)
    finally:  # closing a pool or a loader takes a while; a second signal must not cut it short
        time.sleep(0.5)
        (Path(folder) / "unwound").touch()


def test_a_rank_unwinds_once_though_a_stop_signal_comes_twice(tmp_path):
    """A terminal's Ctrl-C and the launcher's copy of it (or a group's SIGTERM and its copy) reach a
    rank moments apart: the second must not raise again in the middle of the unwinding the first began."""
    import multiprocessing

    def signal_twice() -> None:
        while not (tmp_path / "started").exists():
            time.sleep(0.01)
        (rank,) = multiprocessing.active_children()
        for _ in range(2):
            os.kill(rank.pid, signal.SIGTERM)
            time.sleep(0.1)

    sender = threading.Thread(target=signal_twice)
    sender.start()
    with pytest.raises(RankFailed, match="^worker rank 0 was stopped by SIGTERM$"):
        spawn_ranks(_unwinds_slowly, 1, (str(tmp_path),))
    sender.join()
    assert (tmp_path / "unwound").exists()
