"""Batches from DataLoader worker processes onto the training device, through a ring of slots.

A 4096-token pack of an 8B target's states is ~168 MB. The stock path (a fresh shared-memory tensor
per batch, then the main process's single pin-memory thread copying it into pinned memory, then the
device copy) moves every byte three times on the main process and measured below the rate the GPU
consumes. Here the main process allocates `slots` shared-memory hidden-state buffers once and, on
CUDA, page-locks them (cudaHostRegister); workers decode straight into the slot their step was given
and send back only the small tensors, and the main process issues one DMA copy per batch.

Slot reuse is safe by counting: the DataLoader keeps at most workers x prefetch steps dispatched
beyond the one last handed out, so with two more slots than that, the slot a worker is given next was
last used two batches ago, and that batch's device copy is waited for before the next one is asked.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader

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


def _one_thread_per_worker(_worker_id: int) -> None:
    """Parallelism comes from the worker processes; codec threads inside each would oversubscribe."""
    decode_in_this_thread_only()


def slots_needed(workers: int, prefetch: int) -> int:
    return workers * prefetch + 2


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
                        worker_init_fn=_one_thread_per_worker)
    copied: torch.cuda.Event | None = None
    it = iter(loader)
    try:
        while True:
            if copied is not None:
                copied.synchronize()  # the batch before this one is on the device: its slot may be refilled
            try:
                epoch, k, batch = next(it)
            except StopIteration:
                return
            batch["context_hidden"] = ring.buffers[batch.pop("slot")]
            batch = to_device(batch, device)
            if device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
            else:
                batch["context_hidden"] = batch["context_hidden"].clone()
            yield epoch, k, batch
    finally:
        del it  # stops the workers before the slots go
        dataset.slots = None
        if copied is not None:
            copied.synchronize()
        ring.close()
