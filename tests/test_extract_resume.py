"""kill -9 during extraction, rerun the same command: the store ends identical to an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import pytest

from dflash_pipeline.shared.store.manifest import load_manifest
from dflash_pipeline.shared.store.reader import stores_equal

pytestmark = pytest.mark.slow


# small batches in small shards, so a run commits many batches a kill can land between
SMALL_BATCHES = ["--max-length", "96", "--batch-tokens", "96", "--max-batch-size", "2", "--chunk-tokens", "16",
                 "--shard-tokens", "64", "--layers", "0,1,3"]  # fmt: skip


def command(target: Path, data: Path, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "dflash_pipeline.extract.cli", "--target", str(target), "--data", str(data),
        "--out", str(out), "--device", "cpu", "--workers", "2", *SMALL_BATCHES,
    ]  # fmt: skip


def rank_progress(out: Path) -> dict[int, dict]:
    """Each rank's progress record as far as it is written yet (batches committed, done)."""
    records = {}
    for p in (out / "shards").glob("rank-*.progress.json"):
        try:
            record = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        records[record["rank"]] = record
    return records


def committed_batches(out: Path) -> int:
    return sum(r.get("batches", 0) for r in rank_progress(out).values())


def process_stats() -> list[tuple[int, list[str]]]:
    """(pid, the fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ...) of
    every process that can still be read."""
    stats = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats.append((int(stat.parent.name), stat.read_text().rsplit(")", 1)[1].split()))
        except (OSError, ValueError):
            continue
    return stats


def children_of(pid: int) -> list[int]:
    return [child for child, fields in process_stats() if int(fields[1]) == pid]


def spawned_children(pid: int) -> list[int]:
    """The processes `pid` started with multiprocessing's spawn, in start order: the ranks, not the
    resource tracker, nor a short-lived helper process of the parent (a library calling a shell tool),
    whose kill would leave the run to finish normally."""
    return sorted(p for p in children_of(pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text())


def run_until_killed(cmd: list[str], out: Path, min_batches: int, kill: str) -> int:
    """Start `cmd`, and once `min_batches` are committed: SIGKILL its process group or one of its
    ranks, SIGTERM the process that started the ranks (which passes it on), or press Ctrl-C (SIGINT
    to the group, as a terminal sends it); -> batches committed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 240
    if kill == "rank":
        kill_a_rank_with_work_left(proc, out, min_batches, deadline)
    while committed_batches(out) < min_batches:
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        assert time.time() < deadline, "no progress"
        time.sleep(0.05)
    if kill in ("group", "ctrl-c"):
        os.killpg(proc.pid, signal.SIGINT if kill == "ctrl-c" else signal.SIGKILL)
    elif kill == "sigterm":
        proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    if kill in ("ctrl-c", "sigterm"):  # the ranks unwound (bars ended, no semaphore left to warn of); one line
        stderr = proc.stderr.read().decode()
        name, code = ("Ctrl-C", 130) if kill == "ctrl-c" else ("SIGTERM", 143)
        want = f"dflash-extract: stopped by {name}; rerun the same command to resume from the last committed batch"
        assert proc.returncode == code and stderr.strip().splitlines()[-1] == want, stderr[-2000:]
        assert "Traceback" not in stderr and "Aborted" not in stderr, stderr[-2000:]
    elif kill == "rank":  # the parent notices, stops the other rank and says how to go on
        stderr = proc.stderr.read().decode()
        assert proc.returncode == 1 and "rerun the same command" in stderr, stderr[-2000:]
    return committed_batches(out)


def kill_a_rank_with_work_left(proc: subprocess.Popen, out: Path, min_batches: int, deadline: float) -> None:
    """Once `min_batches` are committed, SIGKILL a rank with work left: one that already finished
    reported its result, and the run would rightly complete without it (seen under CI load, where one
    rank ran far ahead). The ranks are frozen (SIGSTOP) while their progress is read, so that none
    finishes between that look and the kill (the rest of the run takes under a second here; under CI
    load both ranks had finished by the time of the kill)."""
    while True:
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        assert time.time() < deadline, "no progress"
        workers = spawned_children(proc.pid)  # in rank order
        if len(workers) == 2:
            for pid in workers:
                os.kill(pid, signal.SIGSTOP)
            try:
                if committed_batches(out) >= min_batches:
                    progress = rank_progress(out)
                    busy = [r for r in range(2) if not progress.get(r, {}).get("done")]
                    assert busy, "both ranks finished before the kill"
                    os.kill(workers[min(busy, key=lambda r: progress.get(r, {}).get("batches", 0))], signal.SIGKILL)
                    return
            finally:
                for pid in workers:
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference_store(tiny_target_dir, small_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "store"
    subprocess.run(command(tiny_target_dir, small_corpus, out), check=True, capture_output=True)
    return out


@pytest.mark.parametrize("kill,min_batches", [("group", 3), ("rank", 6), ("sigterm", 3), ("ctrl-c", 3)])
def test_killed_or_stopped_run_then_rerun_is_identical(
    tiny_target_dir, small_corpus, reference_store, tmp_path, kill, min_batches
):
    out = tmp_path / "store"
    cmd = command(tiny_target_dir, small_corpus, out)
    committed = run_until_killed(cmd, out, min_batches, kill)
    assert not load_manifest(out).complete
    assert committed >= min_batches
    rerun = subprocess.run(cmd, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resumed" in rerun.stdout
    assert load_manifest(out).complete
    assert stores_equal(out, reference_store)
