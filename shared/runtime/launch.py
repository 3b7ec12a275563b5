"""One process per device, started with spawn (never threads), with errors that reach the user.

Both stages start their ranks through `spawn_ranks`: each child runs `fn(rank, *args)`; the parent
collects the return values, turns a child's exception into one line naming the rank, notices a child
that died without a word (SIGKILL, OOM killer), and stops the others instead of hanging. A child dies
with the parent (even by kill -9): the parent holds the output folder's run lock for its children, so
none may go on writing there once the lock is gone.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch.multiprocessing as mp

from dflash_pipeline.shared.runtime.errors import UserError, debugging, first_line, user_line
from dflash_pipeline.shared.runtime.progress import close_progress_bars
from dflash_pipeline.shared.runtime.stop import (
    STOP_SIGNALS,
    StoppedTogether,
    StopSignal,
    signal_exit,
    signal_name,
    signal_of,
    stop_requested,
    stop_signal,
    stopping_gracefully,
)


class RankFailed(RuntimeError):
    """A worker process failed; the message is one line meant for the user. `user_error`: the rank's
    line is a `UserError`'s, which says itself whether a rerun helps (a bad record: it does not)."""

    def __init__(self, line: str, user_error: bool = False) -> None:
        super().__init__(line)
        self.user_error = user_error


# After one rank failed, the others get STOP_SIGNAL, which raises in each and unwinds it (SIGTERM would
# not do: a training rank only notes that and stops at a step boundary, waiting for the failed one), and
# SIGKILL if still running STOP_GRACE_S later (one blocked in a collective does not unwind). Ranks that
# stop together (`StoppedTogether`) or on a signal of their own are not signalled again while they unwind.
STOP_SIGNAL = signal.SIGUSR1
STOP_GRACE_S = 5.0


def free_port() -> int:
    """A free TCP port on loopback for a single-host process group."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal a process gets when its parent dies


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when `parent` dies (Linux); gone at once if it already has.
    Called first thing in every process we spawn, so that none outlives the one that started it."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _raise_stopped(signum: int, frame: Any) -> None:
    """STOP_SIGNAL (another rank failed), SIGTERM or Ctrl-C: this rank stops where it is, once."""
    _on_stop_signals(signal.SIG_IGN)  # a copy (the terminal's and the launcher's) would cut the unwinding
    raise StopSignal(signum)


def _on_stop_signals(handler: Any) -> None:
    for signum in (STOP_SIGNAL, *STOP_SIGNALS):
        signal.signal(signum, handler)


def _child(rank: int, fn: Callable[..., Any], args: tuple, results, parent: int) -> None:
    """One rank. STOP_SIGNAL, SIGTERM and Ctrl-C raise in it, so that it unwinds (closes its pools, bars
    and semaphores) instead of dying where it is; a rank that stops at a step boundary on SIGTERM or
    Ctrl-C (training) puts its own handler in place meanwhile. Before this runs, the defaults end a
    starting rank."""
    die_with_parent(parent)
    _on_stop_signals(_raise_stopped)
    try:
        results.put((rank, "ok", fn(rank, *args)))
    except (StopSignal, KeyboardInterrupt) as stop:  # no line of its own: the launcher knows why
        _on_stop_signals(signal.SIG_IGN)  # a KeyboardInterrupt left the handlers in place
        close_progress_bars()
        signum = signal_of(stop)
        raise SystemExit(1 if signum == STOP_SIGNAL else signal_exit(signum)) from None  # finalizers still run
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent as one line
        _on_stop_signals(signal.SIG_IGN)  # the launcher stopping the others must not cut this
        close_progress_bars()
        line = user_line(exc)
        if debugging() or line is None:
            traceback.print_exc()
        status = (
            "together" if isinstance(exc, StoppedTogether) else "user_error" if isinstance(exc, UserError) else "error"
        )
        results.put((rank, status, line or first_line(exc)))
        raise SystemExit(1) from None


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, args: tuple = (), env: dict[str, str] | None = None
) -> list[Any]:
    """Run `fn(rank, *args)` in `world_size` spawned processes; their results in rank order. SIGTERM
    or Ctrl-C here goes on to the ranks, and this process waits for what they make of it (training ranks
    stop at a step boundary with a checkpoint) instead of dying and taking them with it; after a second
    Ctrl-C it waits STOP_GRACE_S for the ranks, which got it too, and raises KeyboardInterrupt. Ranks
    ended by a stop signal this process got too raise `StopSignal`, as if they had run here."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        procs = [ctx.Process(target=_child, args=(r, fn, args, results, os.getpid())) for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with stopping_gracefully(forward_to=lambda: [p.pid for p in procs if p.is_alive()]):
        try:
            return _collect(procs, results, world_size)
        except KeyboardInterrupt:
            _end_ranks(procs, None, tell=False)
            raise


def _collect(procs: list, results, world_size: int) -> list[Any]:
    """The ranks' results in rank order, or `RankFailed` for the first error or silent death
    (`StopSignal` where they ended by a stop signal that reached this process too)."""
    done: dict[int, Any] = {}
    error, failed, user_error, together, stopped_by = None, None, False, False, None
    while len(done) < world_size and error is None:
        try:
            rank, status, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = [
                r for r, p in enumerate(procs) if r not in done and not p.is_alive() and p.exitcode not in (None, 0)
            ]
            if dead:  # one ended by a stop signal this process got too (and sent on) is no error
                error, stopped_by = f"worker rank {dead[0]} {_how_it_ended(procs[dead[0]].exitcode)}", stop_signal()
            continue
        if status == "ok":
            done[rank] = payload
        else:
            error, failed, user_error = f"rank {rank}: {payload}", rank, status != "error"
            together = status == "together"
    if error is not None:  # a stop signal reached this process: it sent it on to every rank
        _end_ranks(procs, failed, tell=not (together or stop_requested()))
    for p in procs:
        p.join()
    if stopped_by is not None:
        raise StopSignal(stopped_by)
    if error is not None:
        raise RankFailed(error, user_error)
    return [done[r] for r in range(world_size)]


def _how_it_ended(code: int) -> str:
    """A dead rank's exit status in words: a stop signal it unwound on, or else the code."""
    for signum in STOP_SIGNALS:
        if code in (-signum, signal_exit(signum)):
            return f"was stopped by {signal_name(signum)}"
    return f"died (exit code {code})"


def _end_ranks(procs: list, failed: int | None, tell: bool) -> None:
    """End the ranks still running after rank `failed` failed (it ends by itself). `tell`: they do not
    know yet, so send STOP_SIGNAL, which makes each close its pools and bars (a killed one leaves its
    semaphores to the resource tracker, which warns of them below the error line); else they are
    stopping already (a signal reached them all, or they stop together) and a signal would cut their
    unwinding short. Then SIGKILL for those still running after STOP_GRACE_S."""
    for rank, p in enumerate(procs):
        if tell and rank != failed and p.is_alive():
            with suppress(ProcessLookupError):  # it ended since is_alive looked
                os.kill(p.pid, STOP_SIGNAL)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
