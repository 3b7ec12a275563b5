"""`spawn_ranks` when one rank fails: its line reaches the user, and the others unwind before they end."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.runtime.launch import RankFailed, spawn_ranks


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
