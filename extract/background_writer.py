"""Hands finished batches to the store writer on one I/O thread, so compression and disk writes run
while the GPU computes the next batches.

At ~31K tok/s an 8B target produces ~1.3 GB/s of bf16 states per GPU: writing them on the thread that
also launches the forwards would leave the GPU idle for every write. This thread runs no model code
(target compute stays on the process's main thread; that rule is about compiled/model code): it only
calls `StoreWriter.append_batch`, whose codecs and file writes release the GIL. The queue is bounded,
so a disk slower than the GPU slows the forward down (time counted in `blocked_s`) instead of
filling memory. Commit order and crash safety are the writer's own: batches are appended in order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from dflash_pipeline.shared.store.writer import StoreWriter

_STOP = object()


class BackgroundWriter:
    """`submit(batch)` returns at once unless `depth` batches are already waiting; `close()` waits for
    all of them. An error on the I/O thread is raised again by the next `submit` or by `close`."""

    def __init__(self, writer: StoreWriter, depth: int = 2) -> None:
        self.writer = writer
        self.blocked_s = 0.0  # time the caller waited for the queue: the disk was the bottleneck
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="dflash-store-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is _STOP:
                return
            if self._error is None:  # after a failure, drop the rest: nothing after it may commit
                try:
                    self.writer.append_batch(batch)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    self._error = exc

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, batch: Sequence[Sequence[Any]]) -> None:
        self._raise_if_failed()
        started = time.perf_counter()
        self._queue.put(batch)
        self.blocked_s += time.perf_counter() - started

    def close(self) -> None:
        """Wait until every submitted batch is appended; re-raise an I/O-thread error."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_if_failed()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the caller failed: stop after what is queued, keep the caller's exception
            self._queue.put(_STOP)
            self._thread.join()
