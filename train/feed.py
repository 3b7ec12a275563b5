"""Batches from DataLoader worker processes onto the training device, through a ring of slots.

A 4096-token pack of an 8B target's states is ~168 MB. The stock path (a fresh shared-memory tensor
per batch, then the main process's single pin-memory thread copying it into pinned memory, then the
device copy) moves every byte three times on the main process and measured below the rate the GPU
consumes. Here the main process allocates `slots` shared-memory hidden-state buffers once and, on
CUDA, page-locks them (cudaHostRegister); workers decode straight into the slot their step was given
and send back only the small arrays (as numpy, by value: see StepDataset), and the main process
issues one DMA copy per batch.

Slot reuse is safe by counting: the DataLoader keeps at most workers x prefetch steps dispatched
beyond the one last handed out, so with two more slots than that, the slot a worker is given next was
last used two batches ago, and that batch's device copy is waited for before the next one is asked.
The copy of the batch just handed out may still run meanwhile (on its own stream, beside the step).

The slot count is also a multiple of the worker count: the DataLoader hands step i to worker
i % workers, so each worker only ever fills its own slots, and maps their pages once at start. A
slot first written by a worker costs a page fault per 4 KiB of its 168 MB (3.6x the time of a
168 MB read into it on the CPU machine); before this every pack of a short run was such a first touch.
"""

from __future__ import annotations

import mmap
from collections import deque
from typing import Iterator

import torch
from torch.utils.data import DataLoader, get_worker_info

from dflash.shared.shard_io import decode_in_this_thread_only
from dflash.train.dataset import StepDataset
from dflash.train.step import to_device


class SlotRing:
    """`count` shared-memory tensors of `shape`; page-locked for fast device copies if `pin`."""

    def __init__(self, count: int, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.buffers = [torch.empty(shape, dtype=dtype).share_memory_() for _ in range(count)]
        self._registered: list[torch.Tensor] = []
        if pin:
            cudart = torch.cuda.cudart()
            for buf in self.buffers:
                _check(cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0), "cudaHostRegister")
                self._registered.append(buf)

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
    oversubscribe), and this worker's own slots mapped into its page table before the first step."""
    decode_in_this_thread_only()
    info = get_worker_info()
    slots = info.dataset.slots or []
    for slot in slots[worker_id :: info.num_workers]:
        map_pages(slot)


def _as_sent(item):
    """No conversion in the worker: the small arrays stay numpy, pickled by value (see StepDataset)."""
    return item


def map_pages(buffer: torch.Tensor) -> None:
    """Touch one byte per page: shared-memory pages read once are mapped writable, so the decode that
    follows does not fault (a read is enough and changes nothing another process may be writing)."""
    flat = buffer.view(-1).view(torch.uint8).numpy()
    int(flat[:: mmap.PAGESIZE].sum())


def slots_needed(workers: int, prefetch: int) -> int:
    """At least workers x prefetch + 2 (see the module docstring), rounded up to a multiple of workers."""
    return -(-(workers * prefetch + 2) // workers) * workers


def device_batches(dataset: StepDataset, steps: list[tuple[int, int]], workers: int, device: torch.device,
                   prefetch: int = 2) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """(epoch, k, batch on `device`) for each (epoch, k) of `steps`, in order, built by `workers`
    processes (0: in this process). A yielded batch never shares memory with a slot."""
    if workers == 0:
        for epoch, k in steps:
            _, _, batch = dataset[(epoch, k, None)]
            yield epoch, k, to_device(batch, device)
        return
    count = slots_needed(workers, prefetch)
    shape = (dataset.plan.packs_per_step, dataset.spec.pack_tokens, dataset.store.hidden_width)
    ring = SlotRing(count, shape, dataset.store.hidden_dtype, pin=device.type == "cuda")
    dataset.slots = ring.buffers
    loader = DataLoader(dataset, batch_size=None, sampler=[(e, k, i % count) for i, (e, k) in enumerate(steps)],
                        num_workers=workers, prefetch_factor=prefetch, multiprocessing_context="spawn",
                        worker_init_fn=_start_worker, collate_fn=_as_sent)
    copies: deque[torch.cuda.Event] = deque()  # device copies of the last two batches
    copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    it = iter(loader)
    try:
        while True:
            if len(copies) == 2:
                copies.popleft().synchronize()  # two batches back: the slot the next fetch may hand out
            try:
                epoch, k, batch = next(it)
            except StopIteration:
                return
            slot = batch.pop("slot")
            batch = {key: torch.as_tensor(value) for key, value in batch.items()}
            batch["context_hidden"] = ring.buffers[slot]
            if copy_stream is None:
                batch = to_device(batch, device)
                batch["context_hidden"] = batch["context_hidden"].clone()
            else:
                batch, done = _copy_on(copy_stream, batch, device)
                copies.append(done)
            yield epoch, k, batch
    finally:
        del it  # stops the workers before the slots go
        dataset.slots = None
        for done in copies:
            done.synchronize()
        ring.close()


def _copy_on(stream: torch.cuda.Stream, batch: dict[str, torch.Tensor], device: torch.device,
             ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
    """The batch copied to `device` on `stream`, so the DMA overlaps the step running on the current
    stream instead of queueing behind it; the current stream waits for it on the GPU (the host does
    not), and the copies are marked as used there, so the caching allocator reuses their memory only
    after the step that read them."""
    consumer = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        batch = to_device(batch, device)
        done = torch.cuda.Event()
        done.record(stream)
    consumer.wait_stream(stream)
    for tensor in batch.values():
        tensor.record_stream(consumer)
    return batch, done
