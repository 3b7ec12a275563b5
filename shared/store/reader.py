"""Reading a feature store: a read-only view of its samples in global order, and bit-exact comparison."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

from dflash_pipeline.shared.store.errors import StoreError
from dflash_pipeline.shared.store.layout import SCALES, TOPK_IDS, TOPK_LOGPROBS, StoreLayout, token_arrays
from dflash_pipeline.shared.store.manifest import (
    STORAGE_DTYPES,
    TORCH_DTYPES,
    Manifest,
    check_compatible,
    load_manifest,
)
from dflash_pipeline.shared.store.progress import ShardEntry, read_progress
from dflash_pipeline.shared.store.shard_io import ShardedArrayReader


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]
    hidden_states: torch.Tensor  # logical dtype [S, W] (float8 codes in an fp8 store)
    sample_index: int
    hidden_scales: torch.Tensor | None = None  # float32 [S, layers] of an fp8 store (shared.store.fp8)
    # a top-K store's target distribution at each token (row t predicts token t+1): int32 / float32 [S, K]
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None


class FeatureStore:
    """Read-only view of a store in global sample order (shards by rank, samples in shard order).

    Opening reads the manifest and each shard's small offset/index arrays; the zarr arrays themselves
    are opened lazily in whichever process reads, so the object pickles into DataLoader workers.
    With `require_complete=False` an unfinished store is readable up to each rank's commit point.
    """

    def __init__(self, root: str | Path, *, require_complete: bool = True) -> None:
        self.root = Path(root)
        self.manifest: Manifest = load_manifest(root)
        check_compatible(self.manifest, require_complete=require_complete)
        if self.manifest.complete:
            entries = self.manifest.shards
        else:
            entries = []
            for rank in range(self.manifest.world_size):
                if (progress := StoreLayout(root).progress_file(rank)).exists():
                    record = read_progress(progress)
                    entries.append(
                        ShardEntry(rank, StoreLayout.rank_group_name(rank), record["samples"], record["tokens"])
                    )
        self.shards = entries
        self._offsets: list[np.ndarray] = []
        self._sample_index: list[np.ndarray] = []
        for entry in entries:
            group = zarr.open_group(self.root / entry.path, mode="r")
            offsets = group["sample_offsets"][: entry.samples + 1]
            hidden = group["hidden_states"]
            groups = group[SCALES].shape[1] if SCALES in group else 0
            topk = group[TOPK_IDS].shape[1] if TOPK_IDS in group else 0
            if (
                offsets[-1] != entry.tokens
                or hidden.shape[1] != self.manifest.hidden_width
                or hidden.attrs.get("logical_dtype") != self.manifest.hidden_dtype
                or groups != self.manifest.scale_groups
                or topk != self.manifest.store_topk
            ):
                raise StoreError(
                    f"{self.root / entry.path}: shard disagrees with the manifest (tokens {offsets[-1]} vs "
                    f"{entry.tokens}, width {hidden.shape[1]} vs {self.manifest.hidden_width}, "
                    f"dtype {hidden.attrs.get('logical_dtype')} vs {self.manifest.hidden_dtype}, "
                    f"scales per token {groups} vs {self.manifest.scale_groups}, "
                    f"top-k {topk} vs {self.manifest.store_topk})"
                )
            self._offsets.append(offsets)
            self._sample_index.append(group["sample_index"][: entry.samples])
        self._first = np.cumsum(
            [0] + [e.samples for e in entries]
        ).tolist()  # global index of each shard's first sample
        self.lengths = np.concatenate([np.diff(o) for o in self._offsets]) if entries else np.zeros(0, np.int64)
        self._readers: list[dict[str, ShardedArrayReader]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = None
        return state

    def _shard_readers(self, shard: int) -> dict[str, ShardedArrayReader]:
        if self._readers is None:
            self._readers = [
                {name: ShardedArrayReader(self.root / entry.path / name) for name in self._token_arrays}
                for entry in self.shards
            ]
        return self._readers[shard]

    @property
    def layer_ids(self) -> list[int]:
        return self.manifest.layer_ids

    @property
    def hidden_size(self) -> int:
        return self.manifest.hidden_size

    @property
    def hidden_width(self) -> int:
        return self.manifest.hidden_width

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The logical torch dtype of `Sample.hidden_states`."""
        return TORCH_DTYPES[self.manifest.hidden_dtype]

    @property
    def scale_groups(self) -> int:
        """Scales per token (`hidden_scales`, one per stored layer); 0 unless the store is fp8."""
        return self.manifest.scale_groups

    @property
    def store_topk(self) -> int:
        """K of the target's top-K distribution stored at every token; 0 for stores without it."""
        return self.manifest.store_topk

    @property
    def _token_arrays(self) -> tuple[str, ...]:
        return token_arrays(self.manifest.hidden_dtype, self.manifest.store_topk)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def __len__(self) -> int:
        return self._first[-1]

    def _locate(self, i: int) -> tuple[int, int]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.root}: sample {i} out of range ({len(self)} samples)")
        i %= len(self)
        shard = bisect.bisect_right(self._first, i) - 1
        return shard, i - self._first[shard]

    def read_ids_and_mask(self, shard: int, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [start, stop) of one shard without their hidden states: int32 ids, uint8 mask."""
        if not 0 <= start <= stop <= self.shards[shard].tokens:
            raise IndexError(
                f"{self.root}: tokens [{start}, {stop}) outside shard {shard} ({self.shards[shard].tokens} tokens)"
            )
        readers = self._shard_readers(shard)
        return readers["input_ids"].read(start, stop), readers["loss_mask"].read(start, stop)

    def read_raw(
        self,
        shard: int,
        start: int,
        stop: int,
        hidden_out: np.ndarray | None = None,
    ) -> tuple[np.ndarray, ...]:
        """Tokens [start, stop) of one shard as stored: int32 ids, uint8 mask, hidden in the storage
        dtype (decoded into `hidden_out` when given: C-contiguous [stop-start, W]), in an fp8
        store float32 scales [stop-start, layers], in a top-K store int32 ids and float32 log-probs [stop-start, K]."""
        ids, mask = self.read_ids_and_mask(shard, start, stop)
        readers = self._shard_readers(shard)
        scales = [readers[name].read(start, stop) for name in self._token_arrays[3:]]
        return ids, mask, readers["hidden_states"].read(start, stop, hidden_out), *scales

    def read_scales(self, shard: int, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 scales [stop-start, layers] of tokens [start, stop) of one shard of an fp8
        store, into `out` (contiguous) when given."""
        if not self.scale_groups:
            raise StoreError(f"{self.root}: a {self.manifest.hidden_dtype} store has no scales")
        stored = self._shard_readers(shard)[SCALES].read(start, stop, None if out is None else out.numpy())
        return torch.from_numpy(stored) if out is None else out

    def read_topk(
        self,
        shard: int,
        start: int,
        stop: int,
        ids_out: torch.Tensor | None = None,
        logprobs_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-K distribution at tokens [start, stop) of one shard of a top-K store: int32
        ids and float32 log-probs [stop-start, K] (row t predicts token t+1), into the given contiguous
        tensors when given."""
        if not self.store_topk:
            raise StoreError(f"{self.root}: the store holds no top-k distribution (extracted without --store-topk)")
        readers = self._shard_readers(shard)
        got = []
        for name, out in ((TOPK_IDS, ids_out), (TOPK_LOGPROBS, logprobs_out)):
            stored = readers[name].read(start, stop, None if out is None else out.numpy())
            got.append(torch.from_numpy(stored) if out is None else out)
        return got[0], got[1]

    def read_tokens(
        self,
        shard: int,
        start: int,
        stop: int,
        hidden_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Contiguous tokens of one shard as tensors; `hidden_out` (a contiguous [stop-start, W] CPU
        tensor of the logical dtype) receives the hidden states without an intermediate copy. The
        scales of an fp8 store are read apart (`read_scales`)."""
        carrier = getattr(torch, STORAGE_DTYPES[self.manifest.hidden_dtype])
        out = None if hidden_out is None else hidden_out.view(carrier).numpy()
        ids, mask = self.read_ids_and_mask(shard, start, stop)
        stored = self._shard_readers(shard)["hidden_states"].read(start, stop, out)
        hidden = torch.from_numpy(stored).view(self.hidden_dtype) if hidden_out is None else hidden_out
        return torch.from_numpy(ids).long(), torch.from_numpy(mask).bool(), hidden

    def sample_span(self, i: int) -> tuple[int, int, int, int]:
        """(shard, start token, stop token, sample_index) of global sample i."""
        shard, j = self._locate(i)
        offsets = self._offsets[shard]
        return shard, int(offsets[j]), int(offsets[j + 1]), int(self._sample_index[shard][j])

    def __getitem__(self, i: int) -> Sample:
        shard, start, stop, index = self.sample_span(i)
        ids, mask, hidden = self.read_tokens(shard, start, stop)
        scales = self.read_scales(shard, start, stop) if self.scale_groups else None
        topk_ids, topk_logprobs = self.read_topk(shard, start, stop) if self.store_topk else (None, None)
        return Sample(
            input_ids=ids,
            loss_mask=mask,
            hidden_states=hidden,
            sample_index=index,
            hidden_scales=scales,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
        )


def _same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    """Bit equality (NaN payloads included), which `==` on floats is not."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return np.array_equal(x.view(f"u{x.dtype.itemsize}"), y.view(f"u{y.dtype.itemsize}"))


def stores_equal(a: FeatureStore | str | Path, b: FeatureStore | str | Path) -> bool:
    """True when both stores hold the same samples in the same order, bit for bit.

    Stores with the same per-shard token counts are compared shard by shard in large contiguous
    reads; otherwise (e.g. another world size) sample by sample.
    """
    a = a if isinstance(a, FeatureStore) else FeatureStore(a)
    b = b if isinstance(b, FeatureStore) else FeatureStore(b)
    if (
        len(a) != len(b)
        or a.manifest.hidden_dtype != b.manifest.hidden_dtype
        or a.manifest.store_topk != b.manifest.store_topk
        or not np.array_equal(a.lengths, b.lengths)
        or not np.array_equal(
            np.concatenate([np.zeros(0, np.int64), *a._sample_index]),
            np.concatenate([np.zeros(0, np.int64), *b._sample_index]),
        )
    ):
        return False
    if [e.tokens for e in a.shards] == [e.tokens for e in b.shards]:
        window = a.manifest.shard_tokens or 4096
        spans = [
            ((k, t, min(t + window, e.tokens)),) * 2 for k, e in enumerate(a.shards) for t in range(0, e.tokens, window)
        ]
    else:
        spans = [(a.sample_span(i)[:3], b.sample_span(i)[:3]) for i in range(len(a))]
    return all(
        all(_same_bits(x, y) for x, y in zip(a.read_raw(*span_a), b.read_raw(*span_b))) for span_a, span_b in spans
    )
