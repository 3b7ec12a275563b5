"""Ranks of a process group (torchrun, several nodes) that fail fast and say why instead of hanging.

- Liveness: every rank's watcher thread bumps its heartbeat counter in the group's c10d store every
  few seconds and reads the others'. A counter that stands still for `timeout` seconds (a frozen,
  killed or cut-off node) makes the watcher print which rank(s) did not answer and end the process
  with exit code 1: a rank blocked in any collective (gloo or NCCL) or store wait cannot notice by
  itself. The watcher only talks to the store; it never touches model compute.
- Meeting points (`meet`): where ranks legitimately arrive at very different times (the end of
  extraction waits for the slowest rank's work; rank 0 alone prepares the store or saves a
  checkpoint), ranks poll the store instead of blocking in a collective, so the wait lasts as long
  as the work does while a dead peer is still noticed within `timeout`. A rank that stopped with an
  error is reported at once. Collectives themselves get twice `timeout` as a backstop; one that breaks
  with no rank having reported an error (a peer killed without a word) waits for the watcher's verdict.
- Failing fast (`interrupt_on_failure`, for ranks torchrun started): the watcher also interrupts its
  rank's main thread (`PeerStopped`) once another rank failed or was stopped, instead of letting it work
  on to its next meeting point.
- Shared folders (`require_shared`): rank 0 writes a nonce file, every rank reads it back, and all
  refuse to start unless every rank saw it.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.runtime.stop import StoppedTogether, StopSignal, signal_name, signal_of

_KEY = "dflash/"
_POLL_S = 0.2


class ClusterError(UserError, RuntimeError):
    """The ranks cannot go on together (a rank failed, or a folder is not shared); one line for the user."""


class PeerStopped(BaseException):
    """Raised in a rank's main thread by its watcher when another rank failed or was stopped, so that it
    unwinds now rather than at its next meeting point (hours of extraction away); a BaseException, as
    KeyboardInterrupt is, so that no `except Exception` swallows it."""


PEER_SIGNAL = signal.SIGUSR2  # how the watcher interrupts its main thread (SIGUSR1 is the launcher's)


def group_timeout(timeout_s: float) -> timedelta:
    """Timeout of the process group's collectives: a backstop behind the heartbeat watcher."""
    return timedelta(seconds=2 * timeout_s + 30)


def torchrun_refusal(gpus: tuple[int, ...], workers: int) -> str | None:
    """Why `--gpus`/`--workers` cannot apply under torchrun (it starts the processes); None if unused."""
    if not gpus and workers == 1:
        return None
    return (
        f"{'--gpus' if gpus else '--workers'} cannot be used under torchrun: torchrun owns the processes "
        "(one per --nproc-per-node; GPU = LOCAL_RANK, choose GPUs with CUDA_VISIBLE_DEVICES)"
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


_STOPPED_BY = "stopped by "  # how a rank that a stop signal ended left (then the signal's name)


def _how_they_ended(failed: dict[int, str]) -> str:
    """What the ranks that failed or were stopped did, for the others' line."""
    errors = [r for r, how in failed.items() if how == "error"]
    stops = {how: [r for r, h in failed.items() if h == how] for how in failed.values() if how != "error"}
    parts = [f"{_ranks(errors)} stopped with an error (see its output)"] if errors else []
    parts += [f"{_ranks(ranks)} {'was' if len(ranks) == 1 else 'were'} {how}" for how, ranks in stops.items()]
    return "; ".join(parts)


class Cluster:
    """Heartbeats, meeting points and the shared-folder check of an initialized process group;
    use as a context manager around the rank's work (stops the watcher, tells the others how it ended)."""

    def __init__(self, cli: str, timeout_s: float, hint: str, interrupt_on_failure: bool = False):
        """`interrupt_on_failure`: raise `PeerStopped` in this rank as soon as another failed (for ranks
        that torchrun started: spawned ones have a launcher of ours that stops the others itself)."""
        self.cli, self.timeout_s, self.hint = cli, timeout_s, hint
        self.interrupt = interrupt_on_failure and threading.current_thread() is threading.main_thread()
        self._exiting = False
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = dist.distributed_c10d._get_default_store()
        self.period = max(0.2, min(5.0, timeout_s / 10))
        self._stop = threading.Event()
        self._beats = {r: 0 for r in range(self.world) if r != self.rank}  # heartbeats the watcher saw, per rank
        self._watcher = threading.Thread(target=self._watch, name="dflash-heartbeat", daemon=True)

    def __enter__(self) -> Cluster:
        if self.interrupt:
            self._previous = signal.signal(PEER_SIGNAL, self._peer_stopped)
        self._watcher.start()
        return self

    def _peer_stopped(self, signum: int, frame: object) -> None:
        """PEER_SIGNAL's handler; none once this rank unwinds (one sent just before __exit__ stopped the watcher)."""
        if not self._exiting:
            self._exiting = True
            raise PeerStopped

    def __exit__(self, exc_type, exc, tb) -> None:
        self._exiting = True
        if isinstance(exc, RuntimeError) and not isinstance(exc, UserError) and not self._failed_ranks():
            self._await_watcher()
        self._stop.set()
        self._watcher.join()
        if self.interrupt:
            signal.signal(PEER_SIGNAL, self._previous)
        # not a cause: gave up because of another rank, or stopped with every rank (training's stop signal)
        cause = exc is not None and not isinstance(exc, (ClusterError, PeerStopped, StoppedTogether))
        how = "ok" if exc is None else "gave up" if not cause else "error"
        if isinstance(exc, StoppedTogether):
            how = "stopped together"
        elif isinstance(exc, (StopSignal, KeyboardInterrupt)):
            how = f"{_STOPPED_BY}{signal_name(signal_of(exc))}"
        try:
            self.store.set(f"{_KEY}left/{self.rank}", how)
            if cause:
                self.store.add(f"{_KEY}failed", 1)
            else:
                self.store.add(f"{_KEY}leaving", 1)
            if exc is None and self.rank == 0:  # spawned ranks keep the store in rank 0's process: keep it
                deadline = time.monotonic() + self.timeout_s  # until the others are done with it
                while self.store.add(f"{_KEY}leaving", 0) < self.world and time.monotonic() < deadline:
                    time.sleep(_POLL_S)
        except Exception:  # noqa: BLE001 - the store's host may be gone; the original error matters
            pass
        if isinstance(exc, PeerStopped):
            how = _how_they_ended(self._failed_ranks()) or "another rank stopped"  # or the store went meanwhile
            raise ClusterError(f"{how}; {self.hint}") from None
        if exc is not None and not isinstance(exc, UserError) and isinstance(exc, RuntimeError):
            failed = self._failed_ranks()  # a collective broke because another rank stopped
            if failed:
                raise ClusterError(f"{_how_they_ended(failed)}; {self.hint}") from exc

    def _await_watcher(self) -> None:
        """A collective broke and no rank said why: a peer may have vanished without a word (SIGKILL, a
        lost node), and only the watcher can name it, which takes `timeout`. Wait for its verdict (it
        ends the process); stop waiting once every other rank has beaten twice since, so that an error
        of this rank's own is not held up (the first may be one from before a rank died, seen late)."""
        beats = dict(self._beats)
        deadline = time.monotonic() + self.timeout_s + 3 * self.period
        while self._watcher.is_alive() and time.monotonic() < deadline:
            if all(self._beats[r] >= beats[r] + 2 for r in beats):
                return
            time.sleep(_POLL_S)

    def _failed_ranks(self, store: dist.Store | None = None) -> dict[int, str]:
        """The other ranks that left with an error or stopped by a signal: how each left (read through
        `store`, the watcher's own connection, else the main thread's)."""
        store = store or self.store
        failed = {}
        try:
            for r in range(self.world):
                if r != self.rank and store.check([f"{_KEY}left/{r}"]):
                    how = store.get(f"{_KEY}left/{r}").decode()
                    if how == "error" or how.startswith(_STOPPED_BY):
                        failed[r] = how
        except Exception:  # noqa: BLE001
            return {}
        return failed

    def _die(self, why: str) -> None:
        print(f"{self.cli}: error: rank {self.rank}: {why}; {self.hint}", file=sys.stderr, flush=True)
        os._exit(1)

    def _watch(self) -> None:
        """The watcher thread: own store connection, so a blocked main thread cannot hold it up."""
        try:
            store = self.store.clone()
            store.set_timeout(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001
            self._die(f"cannot reach the c10d store ({exc})")
        others = [r for r in range(self.world) if r != self.rank]
        keys = [f"{_KEY}hb/{r}" for r in others]
        counts, heard = dict.fromkeys(others, b""), dict.fromkeys(others, time.monotonic())
        created, seen, told = False, False, False
        while not self._stop.wait(self.period):
            try:
                store.add(f"{_KEY}hb/{self.rank}", 1)
                if not created:  # then one request reads them all
                    for key in keys:
                        store.add(key, 0)
                    created = True
                now = time.monotonic()
                for r, count in zip(others, store.multi_get(keys)):
                    if count != counts[r]:
                        counts[r], heard[r] = count, now
                        self._beats[r] += 1
                silent = [r for r in others if now - heard[r] > self.timeout_s and not store.check([f"{_KEY}left/{r}"])]
                if self.interrupt and not told and store.add(f"{_KEY}failed", 0) and self._failed_ranks(store):
                    # one period's grace first: a rank failing with the others (the same bad loss) is
                    # unwinding by itself, and an interrupt would cut that short
                    told = seen and not self._exiting
                    if told:
                        signal.pthread_kill(threading.main_thread().ident, PEER_SIGNAL)
                    seen = True
            except Exception:  # noqa: BLE001 - the store itself did not answer
                if self._stop.is_set():
                    return
                self._die(
                    f"the c10d store ({os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}, "
                    "kept by the node of rank 0) stopped answering: that node ended, or this one is cut off from it"
                )
            if silent and not self._stop.is_set():
                self._die(
                    f"{_ranks(silent)} did not answer for {self.timeout_s:g} s "
                    "(node frozen, killed or cut off from this one)"
                )

    def meet(self, name: str) -> None:
        """Wait until every rank reached the meeting point `name` (unique per meeting), however long
        their work takes; a rank that stopped with an error ends the wait at once."""
        key = f"{_KEY}meet/{name}"
        self.store.add(key, 1)
        while self.store.add(key, 0) < self.world:
            if self.store.add(f"{_KEY}failed", 0) and (failed := self._failed_ranks()):
                raise ClusterError(f"{_how_they_ended(failed)}; {self.hint}")
            time.sleep(_POLL_S)

    def require_shared(self, folder: Path, option: str) -> None:
        """Refuse to start unless every rank sees the file rank 0 writes into `folder` (created here)."""
        marker_key = f"{_KEY}shared{option}"
        if self.rank == 0:
            nonce = secrets.token_hex(8)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f".dflash-shared-{nonce}").write_text(nonce)
            self.store.set(marker_key, nonce)
        self.meet(f"{option}-written")
        nonce = self.store.get(marker_key).decode()
        try:
            seen = (folder / f".dflash-shared-{nonce}").read_text() == nonce
        except OSError:
            seen = False
        self.store.set(f"{marker_key}/{self.rank}", "1" if seen else "0")
        self.meet(f"{option}-read")
        if self.rank == 0:
            (folder / f".dflash-shared-{nonce}").unlink()
        blind = [r for r in range(self.world) if self.store.get(f"{marker_key}/{r}") != b"1"]
        if blind:
            raise ClusterError(
                f"{option} {folder}: {_ranks(blind)} cannot see the files rank 0 writes there; "
                f"{option} must be one folder shared by every node, at the same path on each"
            )
