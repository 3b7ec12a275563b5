"""One run per output folder (`shared/runtime/run_lock.py`): a second run on a folder in use is refused
in one line naming the holder's pid, by both CLIs; a holder killed with SIGKILL frees the folder."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_extract_resume import process_stats
from test_train import TRAIN_ARGS, losses, train_cmd

from dflash_pipeline.extract import run as extract_run
from dflash_pipeline.extract.cli import main as extract_main
from dflash_pipeline.shared.runtime.run_lock import LOCK_NAME, RunLockError, empty_locked_folder, run_lock
from dflash_pipeline.shared.store.manifest import load_manifest
from dflash_pipeline.train.cli import main as train_main


def in_use(folder: Path, pid: int) -> str:
    return (
        f"{folder}: another run is using this folder (pid {pid} on {socket.gethostname()}); "
        "wait for it to end or stop it, or choose another --out"
    )


def refusal(result, cli: str) -> str:
    """The one line a refused CLI run wrote after the device it would run on; fails on any other output."""
    assert result.exit_code == 1
    device, *rest = result.output.splitlines()
    assert device.startswith(f"{cli}: running on ") and len(rest) == 1, result.output
    return rest[0]


def refused_here(folder: Path) -> bool:
    """True when this process cannot take `folder`'s lock now (its own open of the file: refused
    like any other run's while the lock is held)."""
    try:
        with run_lock(folder, "test"):
            return False
    except RunLockError:
        return True


def test_a_second_run_is_refused_until_the_holder_is_killed(lock_holder, tmp_path):
    out = tmp_path / "out"
    holder = lock_holder(out)
    with pytest.raises(RunLockError) as refused:
        with run_lock(out, "test"):
            pass
    assert str(refused.value) == in_use(out, holder.pid)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (out / LOCK_NAME).exists()  # the killed holder could not remove it
    with run_lock(out, "test"):
        assert (out / LOCK_NAME).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    assert out.is_dir() and not any(out.iterdir())


def test_a_run_leaves_its_folder_as_it_would_without_the_lock(tmp_path):
    new = tmp_path / "new"
    with run_lock(new, "test"):
        assert refused_here(new)
    assert not new.exists()  # made for the lock and left empty: a failed start leaves no folder
    with run_lock(new, "test"):
        (new / "result").write_text("x")
    assert [p.name for p in new.iterdir()] == ["result"]
    existing = tmp_path / "existing"
    existing.mkdir()
    with run_lock(existing, "test"):
        pass
    assert existing.is_dir() and not any(existing.iterdir())


def test_emptying_a_locked_folder_keeps_the_lock(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "elsewhere").mkdir()
    with run_lock(out, "test"):
        (out / "shards").mkdir()
        (out / "shards" / "rank-0").write_text("x")
        (out / "manifest.json").write_text("{}")
        (out / "link").symlink_to(tmp_path / "elsewhere")
        empty_locked_folder(out)
        assert [p.name for p in out.iterdir()] == [LOCK_NAME]
        assert refused_here(out)
    assert (tmp_path / "elsewhere").is_dir()


def test_a_lock_file_removed_between_open_and_flock_is_taken_anew(tmp_path, monkeypatch):
    """The last holder removes the file as it ends: a run that opened it just before then holds a lock
    on a removed file, which would not keep out a third run; it must lock the file there now."""
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text("pid 1 on a host that just ended its run\n")
    real_flock, calls = fcntl.flock, []

    def flock_as_the_holder_ends(fd: int, operation: int) -> None:
        if not calls:
            (out / LOCK_NAME).unlink()
        calls.append(fd)
        real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_as_the_holder_ends)
    with run_lock(out, "test"):
        assert len(calls) == 2 and refused_here(out)


def test_a_filesystem_without_locks_runs_with_a_warning(tmp_path, monkeypatch, capsys):
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    out = tmp_path / "out"
    with run_lock(out, "dflash-test"):
        (out / "result").write_text("x")
    assert capsys.readouterr().err == (
        f"dflash-test: warning: {out}: its filesystem has no file locks (No locks available); "
        "a second run on this folder would not be refused\n"
    )
    assert [p.name for p in out.iterdir()] == ["result"]


def test_an_out_that_is_a_file_is_refused_in_one_line(tmp_path):
    out = tmp_path / "file"
    out.write_text("")
    with pytest.raises(RunLockError) as refused:
        with run_lock(out, "test"):
            pass
    assert str(refused.value) == f"{out / LOCK_NAME}: cannot create the run lock (File exists)"


def training_with_a_checkpoint(store: Path, run: Path, *extra: str) -> subprocess.Popen:
    """A long `dflash-train` (in a session of its own) that has written its first checkpoint."""
    first = subprocess.Popen(
        train_cmd(store, run, "--checkpoint-every", "2", *extra, "--max-steps", "1000", "--epochs", "1000"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 300
    while not (run / "checkpoints" / "latest").exists():
        assert first.poll() is None and time.time() < deadline
        time.sleep(0.05)
    return first


@pytest.mark.slow
def test_train_refuses_a_resume_while_the_run_trains_and_resumes_after_kill_9(store, tmp_path):
    run = tmp_path / "run"
    args = ["--store", str(store), "--out", str(run), *TRAIN_ARGS, "--checkpoint-every", "2"]
    first = training_with_a_checkpoint(store, run)
    second = CliRunner().invoke(train_main, [*args, "--max-steps", "1000", "--resume"])
    assert refusal(second, "dflash-train") == f"dflash-train: error: {in_use(run, first.pid)}"
    assert first.poll() is None  # still training, undisturbed
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    done = max(losses(run))
    resumed = CliRunner().invoke(train_main, [*args, "--max-steps", str(done + 2), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert max(losses(run)) == done + 2 and (run / "drafter" / "model.safetensors").exists()
    assert not (run / LOCK_NAME).exists()


def session_processes(session: int) -> list[int]:
    """The processes still alive (not zombies) in the session `session` (a run started with start_new_session)."""
    return [pid for pid, fields in process_stats() if int(fields[3]) == session and fields[0] != "Z"]


@pytest.mark.slow
def test_killing_the_pid_a_refusal_names_stops_every_rank_of_the_run(store, tmp_path):
    """The launcher of spawned ranks holds the lock for them: killed with SIGKILL, it must take its
    ranks along, or they would go on writing checkpoints into a folder whose lock is gone."""
    run = tmp_path / "run"
    args = ["--store", str(store), "--out", str(run), *TRAIN_ARGS, "--checkpoint-every", "2", "--workers", "2"]
    first = training_with_a_checkpoint(store, run, "--workers", "2")
    assert len(session_processes(first.pid)) >= 3  # the launcher and its two ranks
    second = CliRunner().invoke(train_main, [*args, "--resume"])
    assert refusal(second, "dflash-train") == f"dflash-train: error: {in_use(run, first.pid)}"
    first.send_signal(signal.SIGKILL)
    first.wait()
    deadline = time.time() + 30
    while session_processes(first.pid):
        assert time.time() < deadline, "ranks outlived their launcher"
        time.sleep(0.1)
    done = max(losses(run))
    resumed = CliRunner().invoke(train_main, [*args, "--max-steps", str(done + 2), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert max(losses(run)) == done + 2


def test_extract_refuses_a_second_run_on_its_store_until_the_first_is_killed(
    lock_holder, tiny_target_dir, small_corpus, tmp_path
):
    out = tmp_path / "store"
    args = ["--target", str(tiny_target_dir), "--data", str(small_corpus), "--out", str(out)]
    args += ["--device", "cpu", "--max-length", "64", "--limit", "4"]
    holder = lock_holder(out)
    refused = CliRunner().invoke(extract_main, args)
    assert refusal(refused, "dflash-extract") == f"dflash-extract: error: {in_use(out, holder.pid)}"
    assert [p.name for p in out.iterdir()] == [LOCK_NAME]  # nothing written
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    done = CliRunner().invoke(extract_main, args)
    assert done.exit_code == 0, done.output
    assert load_manifest(out).complete and not (out / LOCK_NAME).exists()
    again = CliRunner().invoke(extract_main, args)
    assert again.exit_code == 0 and "already complete" in again.output


def test_extract_holds_the_lock_through_overwrite(tiny_target_dir, small_corpus, tmp_path, monkeypatch):
    """--overwrite empties the store before writing it anew: the lock file it holds stays."""
    out = tmp_path / "store"
    args = ["--target", str(tiny_target_dir), "--data", str(small_corpus), "--out", str(out)]
    args += ["--device", "cpu", "--max-length", "64", "--limit", "4"]
    assert CliRunner().invoke(extract_main, args).exit_code == 0
    real_run_rank, seen = extract_run.run_rank, []

    def run_rank_in_a_held_folder(*rank_args, **kwargs):
        seen.append(refused_here(out))
        return real_run_rank(*rank_args, **kwargs)

    monkeypatch.setattr(extract_run, "run_rank", run_rank_in_a_held_folder)
    rewritten = CliRunner().invoke(extract_main, [*args, "--overwrite"])
    assert rewritten.exit_code == 0, rewritten.output
    assert seen == [True] and load_manifest(out).complete
