"""Batches from DataLoader worker processes onto the training device, through a ring of slots.

A 4096-token pack of an 8B target's states is ~168 MB. The stock path (a fresh shared-memory tensor
per batch, then the main process's single pin-memory thread copying it into pinned memory, then the
device copy) moves every byte three times on the main process and measured below the rate the GPU
consumes. Here the main process allocates `slots` shared-memory buffers once, each holding a whole
batch (hidden states and the small arrays, laid out by `SlotLayout`), and on CUDA page-locks them
(cudaHostRegister). Workers build the batch straight into the slot their step was given and send
back only the slot's number; the main process issues one DMA copy of the slot per batch and takes
the batch's tensors as views of the copy.

Nothing else crosses processes per batch because the hand-over was the limit: the main process
reads every worker's results from one shared pipe, between training steps. Small arrays sent as
shared-memory handles cost a socket handshake with the (busy) worker per tensor; sent by value they
are ~165 KB per pack, more than a pipe holds, so each send takes several rounds between a worker and
the main process under the pipe's one write lock (on the H200 host, bench/RESULTS.md: 1.07-1.16x
fewer packs/s than with the slot's number alone).

Slot reuse is safe by counting: the DataLoader keeps at most workers x prefetch steps dispatched
beyond the one last handed out, so with two more slots than that, the slot a worker is given next was
last used two batches ago, and that batch's device copy is waited for before the next one is asked.
The copy of the batch just handed out may still run meanwhile (on its own stream, beside the step).

The slot count is also a multiple of the worker count: the DataLoader hands step i to worker
i % workers, so each worker only ever fills its own slots, and maps their pages once at start. A
slot first written by a worker costs a page fault per 4 KiB of its 168 MB (3.6x the time of a
168 MB read into it on the CPU machine), so each worker touches its own slots once, at start.
"""

from __future__ import annotations

import mmap
import signal
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, get_worker_info

from dflash_pipeline.shared.runtime.errors import UserError
from dflash_pipeline.shared.runtime.stop import STOP_SIGNALS
from dflash_pipeline.shared.store.shard_io import decode_in_this_thread_only
from dflash_pipeline.train.dataset import StepDataset, batch_layout
from dflash_pipeline.train.step import to_device

_ALIGN = 256  # byte alignment of each tensor in a slot (any dtype view is legal; CUDA likes 256)


@dataclass(frozen=True)
class SlotLayout:
    """Where each tensor of a batch lies in one flat byte buffer: (key, byte offset, shape, dtype)."""

    fields: tuple[tuple[str, int, tuple[int, ...], torch.dtype], ...]
    nbytes: int

    @classmethod
    def of(cls, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> SlotLayout:
        fields, offset = [], 0
        for key, (shape, dtype) in shapes.items():
            fields.append((key, offset, tuple(shape), dtype))
            offset += -(-_nbytes(shape, dtype) // _ALIGN) * _ALIGN
        return cls(tuple(fields), offset)

    def carve(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch's tensors as views of `buffer` (uint8, `nbytes`, on any device)."""
        return {
            key: buffer[offset : offset + _nbytes(shape, dtype)].view(dtype).view(shape)
            for key, offset, shape, dtype in self.fields
        }


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class SlotRing:
    """`count` shared-memory byte buffers of `layout.nbytes`; page-locked for fast device copies if `pin`.
    Pickled (to spawned workers) as its layout and buffers: the page locks stay with the main process."""

    def __init__(self, count: int, layout: SlotLayout, pin: bool) -> None:
        self.layout = layout
        self.buffers = [torch.empty(layout.nbytes, dtype=torch.uint8).share_memory_() for _ in range(count)]
        self._registered: list[torch.Tensor] = []
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        if pin:
            cudart = torch.cuda.cudart()
            for buf in self.buffers:
                _check(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0), "cudaHostRegister")
                self._registered.append(buf)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_registered": [], "_views": {}}

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        """The batch tensors of slot `slot`, writable in place."""
        if slot not in self._views:
            self._views[slot] = self.layout.carve(self.buffers[slot])
        return self._views[slot]

    def close(self) -> None:
        """Unlock the pages; every copy out of them must have finished (the caller synchronizes)."""
        cudart = torch.cuda.cudart() if self._registered else None
        while self._registered:
            _check(cudart.cudaHostUnregister(self._registered.pop().data_ptr()), "cudaHostUnregister")


def _check(status, what: str) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


def _start_worker(worker_id: int) -> None:
    """One codec thread (parallelism comes from the worker processes; codec threads inside each would
    oversubscribe), and this worker's own slots mapped into its page table before the first step.
    SIGTERM and Ctrl-C are the rank's to act on (it stops at a step boundary with a checkpoint); a worker
    dying by the one its process group got would fail the rank's next fetch first. The worker started
    with them blocked (`device_batches`), so that one sent while it imported is dropped here, not fatal."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    decode_in_this_thread_only()
    info = get_worker_info()
    for buffer in info.dataset.slots.buffers[worker_id :: info.num_workers]:
        map_pages(buffer)


def _as_sent(item):
    """No conversion in the worker: the item is the slot's number (and any extras, by value)."""
    return item


def map_pages(buffer: torch.Tensor) -> None:
    """Touch one byte per page: shared-memory pages read once are mapped writable, so the decode that
    follows does not fault (a read is enough and changes nothing another process may be writing)."""
    flat = buffer.view(-1).view(torch.uint8).numpy()
    int(flat[:: mmap.PAGESIZE].sum())


def slots_needed(workers: int, prefetch: int) -> int:
    """At least workers x prefetch + 2 (see the module docstring), rounded up to a multiple of workers."""
    return -(-(workers * prefetch + 2) // workers) * workers


def device_batches(
    dataset: StepDataset, steps: list[tuple[int, int]], workers: int, device: torch.device, prefetch: int = 2
) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """(epoch, k, batch on `device`) for each (epoch, k) of `steps`, in order, built by `workers`
    processes (0: in this process) from a copy of `dataset` given the slot ring. A yielded batch never
    shares memory with a slot. Entries an item carries besides its slot number (a dataset subclass's
    extras) join the batch as tensors. No steps (a resumed run already at its end) starts no workers:
    they would only be shut down while they start."""
    if workers == 0 or not steps:
        for epoch, k in steps:
            _, _, batch = dataset[(epoch, k, None)]
            yield epoch, k, to_device(batch, device)
        return
    count = slots_needed(workers, prefetch)
    store = dataset.store
    shapes = batch_layout(
        dataset.spec, dataset.plan.packs_per_step, store.hidden_width, store.hidden_dtype, store.scale_groups
    )
    ring = SlotRing(count, SlotLayout.of(shapes), pin=device.type == "cuda")
    loader = DataLoader(
        dataset.with_slots(ring),
        batch_size=None,
        sampler=[(e, k, i % count) for i, (e, k) in enumerate(steps)],
        num_workers=workers,
        prefetch_factor=prefetch,
        multiprocessing_context="spawn",
        worker_init_fn=_start_worker,
        collate_fn=_as_sent,
    )
    copies: deque[torch.cuda.Event] = deque()  # device copies of the last two batches
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the workers inherit the mask; this
    try:  # process gets what came meanwhile once it unblocks
        it = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    try:
        while True:
            if len(copies) == 2:
                copies.popleft().synchronize()  # two batches back: the slot the next fetch may hand out
            try:
                epoch, k, item = next(it)
            except StopIteration:
                return
            except UserError as exc:  # a bad store, found by a worker
                raise worker_error(exc) from None
            extras = {key: torch.as_tensor(value) for key, value in item.items() if key != "slot"}
            if copy_stream is None:
                batch = {**ring.layout.carve(ring.buffers[item["slot"]].clone()), **extras}
            else:
                batch, done = _copy_on(copy_stream, ring, item["slot"], extras, device)
                copies.append(done)
            yield epoch, k, batch
    finally:
        it._shutdown_workers()  # before the slots go; an exception's traceback would keep `it` alive
        del it
        for done in copies:
            done.synchronize()
        ring.close()


def worker_error(exc: UserError) -> UserError:
    """The DataLoader re-raises a worker's exception with the worker's traceback as its message;
    the user's line is the last one of it."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1:
        exc.args = (lines[-1].partition(f"{type(exc).__name__}: ")[2] or lines[-1],)
    return exc


def _copy_on(
    stream: torch.cuda.Stream, ring: SlotRing, slot: int, extras: dict[str, torch.Tensor], device: torch.device
) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
    """The slot copied to `device` in one DMA on `stream` (so it overlaps the step running on the
    current stream instead of queueing behind it), as the batch's views of the copy plus `extras`;
    the current stream waits for it on the GPU (the host does not), and the copies are marked as used
    there, so the caching allocator reuses their memory only after the step that read them."""
    consumer = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        flat = ring.buffers[slot].to(device, non_blocking=True)
        extras = to_device(extras, device)
        done = torch.cuda.Event()
        done.record(stream)
    consumer.wait_stream(stream)
    for tensor in (flat, *extras.values()):
        tensor.record_stream(consumer)
    return {**ring.layout.carve(flat), **extras}, done
