"""The crash-safe writer of one rank's group of a feature store.

Layout (docs/FORMAT.md has the bytes): `ROOT/shards/rank-XXXXX.zarr` holds `input_ids` int32 [T],
`loss_mask` uint8 [T], `hidden_states` [T, W] (bfloat16 stored as its uint16 bit pattern, float8 as
uint8), for float8 `hidden_scales` float32 [T, layers], with --store-topk K `target_topk_ids` int32
and `target_topk_logprobs` float32 [T, K], `sample_offsets` int64 [N+1] and
`sample_index` int64 [N]; `ROOT/shards/rank-XXXXX.progress.json`
is that rank's commit record. Token arrays are chunked along tokens and sharded (Zarr v3 sharding
codec, crc32c on every chunk and every shard index).

Why the writer looks the way it does: a partial write of a zarr shard is a read-modify-write of the
whole shard file, so `StoreWriter` keeps rows in memory and writes only whole shards while it runs
(the last, partial shard at `finalize`), through `shard_io` (zarr's own per-chunk path was too slow).
A full shard goes to one of `write_streams` write threads while the next fills (one GPU makes
~2 GB/s of states; one file at a time, each waiting in its fsync, wrote ~1 GB/s). Files are replaced
atomically (temp + fsync + rename), and the progress record advances only over the prefix of shards
that are durable, whatever order the threads finish in. A batch is the unit of commit: it counts as
committed once every one of its tokens is in a durable shard. After a crash, reopening the writer
truncates logically to the commit point (the committed head of the partially written shard is read
back into the buffer) and the caller recomputes the batches from number `resume()` on; the finished
store is then identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
import zarr.codecs
from zarr.core.sync import sync

from dflash_pipeline.shared.runtime.durable import disk_full_error, fsync_path, write_bytes_durably
from dflash_pipeline.shared.store.codec import codec_pool, default_chunking, default_compression, parse_compression
from dflash_pipeline.shared.store.errors import RESUME_HINT, StoreError, StoreMismatch
from dflash_pipeline.shared.store.layout import (
    FORMAT_VERSION,
    SAMPLE_ARRAYS,
    SCALED_DTYPES,
    SCALES,
    TOPK_IDS,
    TOPK_LOGPROBS,
    StoreLayout,
    format_version,
    token_arrays,
)
from dflash_pipeline.shared.store.manifest import STORAGE_DTYPES, TORCH_DTYPES
from dflash_pipeline.shared.store.progress import ShardEntry, read_progress
from dflash_pipeline.shared.store.shard_io import ShardFormat, write_shards

# Chunk of the small per-sample arrays (sample_offsets, sample_index), in entries.
SAMPLE_CHUNK = 16384
# Shard files written at once by one writer, each on its own thread: while one waits in fsync the next
# is compressed and copied to the page cache, and the disk sees several requests at a time.
WRITE_STREAMS = 4


@dataclass(frozen=True)
class Commit:
    """What the progress record says is durable: the first `batches` batches, holding these counts."""

    batches: int
    samples: int
    tokens: int
    done: bool


def _fsync_path(path: Path) -> None:
    try:
        fsync_path(path)
    except FileNotFoundError:  # zarr leaves out a shard whose chunks are all fill value
        pass


class _ShardRows:
    """The token rows of one shard (ids, mask, hidden, scales of a scaled store), filled in order and
    then written whole. A full one goes to a write thread untouched while the next fills, so rows are
    copied in exactly once."""

    def __init__(self, width: int, dtype: np.dtype, rows: int, start: int, scale_groups: int, topk: int = 0) -> None:
        self.arrays = [np.empty(rows, np.int32), np.empty(rows, np.uint8), np.empty((rows, width), dtype)]
        if scale_groups:
            self.arrays.append(np.empty((rows, scale_groups), np.float32))
        if topk:
            self.arrays += [np.empty((rows, topk), np.int32), np.empty((rows, topk), np.float32)]
        self.start = start  # absolute token index of row 0 (a multiple of the shard size)
        self.n = 0

    @property
    def full(self) -> bool:
        return self.n == len(self.arrays[0])

    def fill(self, rows: Sequence[np.ndarray], offset: int) -> int:
        """Copy rows[offset:] in until full; returns how many were taken."""
        take = min(len(rows[0]) - offset, len(self.arrays[0]) - self.n)
        for buf, r in zip(self.arrays, rows):
            buf[self.n : self.n + take] = r[offset : offset + take]
        self.n += take
        return take

    def reuse(self, start: int) -> _ShardRows:
        self.start, self.n = start, 0
        return self


class StoreWriter:
    """Writes one rank's group; see the module docstring for the commit protocol.

    Opening is also resuming: with a progress record present the writer continues from its commit
    point (the caller skips the first `resume()` batches); without one any leftover group is deleted
    and created afresh. `overwrite=True` always starts afresh. A float8 store takes `scale_groups`
    (the stored layers, each with its own scale per token: `shared.store.fp8`). `compression` None
    is the dtype's default (`codec.default_compression`). `topk` K > 0: every sample also brings the
    target's top-K next-token ids (int32) and log-probs (float32), [S, K] each (docs/FORMAT.md).
    """

    def __init__(
        self,
        root: str | Path,
        rank: int,
        *,
        hidden_width: int,
        hidden_dtype: str,
        capacity_tokens: int,
        capacity_samples: int,
        chunk_tokens: int | None = None,
        shard_tokens: int | None = None,
        compression: str | None = None,
        overwrite: bool = False,
        write_streams: int = WRITE_STREAMS,
        scale_groups: int = 0,
        topk: int = 0,
    ) -> None:
        if hidden_dtype not in STORAGE_DTYPES:
            raise ValueError(f"hidden_dtype {hidden_dtype!r} is not one of {sorted(STORAGE_DTYPES)}")
        scaled = hidden_dtype in SCALED_DTYPES
        if scaled != (scale_groups > 0) or (scaled and hidden_width % scale_groups):
            raise ValueError(
                f"scale_groups {scale_groups}: a {hidden_dtype} store takes "
                + (f"a divisor of the width {hidden_width}" if scaled else "none")
            )
        default_chunk, default_shard = default_chunking(hidden_width, hidden_dtype)
        chunk_tokens = chunk_tokens or default_chunk
        shard_tokens = shard_tokens or max(default_shard, chunk_tokens)
        if shard_tokens % chunk_tokens:
            raise ValueError(f"shard_tokens {shard_tokens} is not a multiple of chunk_tokens {chunk_tokens}")
        compression = compression or default_compression(hidden_dtype)
        parse_compression(compression)  # fail before touching the disk
        if topk < 0:
            raise ValueError(f"topk must be >= 0, got {topk}")
        if write_streams < 1:
            raise ValueError(f"write_streams must be >= 1, got {write_streams}")
        self.write_streams = write_streams
        self._pool: ThreadPoolExecutor | None = None
        self.root = Path(root)
        self.rank = rank
        self.group_dir = StoreLayout(root).rank_group(rank)
        self.progress_file = StoreLayout(root).progress_file(rank)
        self.hidden_dtype = hidden_dtype
        self.storage_dtype = np.dtype(STORAGE_DTYPES[hidden_dtype])
        self.shard_tokens = shard_tokens
        self.scale_groups = scale_groups
        self.topk = topk
        self.token_arrays = token_arrays(hidden_dtype, topk)
        self.layout = {
            "hidden_width": int(hidden_width),
            "hidden_dtype": hidden_dtype,
            "storage_dtype": STORAGE_DTYPES[hidden_dtype],
            "capacity_tokens": int(capacity_tokens),
            "capacity_samples": int(capacity_samples),
            "chunk_tokens": int(chunk_tokens),
            "shard_tokens": int(shard_tokens),
            "compression": compression,
            **({"scale_groups": scale_groups} if scaled else {}),
            **({"topk": topk} if topk else {}),
        }
        if overwrite or not self.progress_file.exists():
            self._create()
        else:
            self._reopen()

    # ---------------------------------------------------------------- opening
    def _create(self) -> None:
        self.progress_file.unlink(missing_ok=True)
        if self.group_dir.exists():
            shutil.rmtree(self.group_dir)
        self.group_dir.parent.mkdir(parents=True, exist_ok=True)
        lay = self.layout
        # crc32c last: every stored chunk carries its checksum, checked on every read.
        compressors = [*parse_compression(lay["compression"]), zarr.codecs.Crc32cCodec()]
        group = zarr.open_group(
            self.group_dir,
            mode="w",
            attributes={"format_version": format_version(self.hidden_dtype, self.topk), "rank": self.rank},
        )
        cap_t, cap_n, shard = max(1, lay["capacity_tokens"]), max(1, lay["capacity_samples"]), lay["shard_tokens"]

        def create(name: str, shape: tuple, dtype: Any, chunks: tuple, shards: tuple | None, **attrs: Any) -> None:
            group.create_array(
                name,
                shape=shape,
                dtype=dtype,
                chunks=chunks,
                shards=shards,
                compressors=compressors,
                fill_value=0,
                attributes=attrs,
            )

        # The 1-D token arrays use one inner chunk per shard: small, and read with the hidden rows.
        create("input_ids", (cap_t,), "int32", (shard,), (shard,))
        create("loss_mask", (cap_t,), "uint8", (shard,), (shard,))
        create(
            "hidden_states",
            (cap_t, lay["hidden_width"]),
            lay["storage_dtype"],
            (lay["chunk_tokens"], lay["hidden_width"]),
            (shard, lay["hidden_width"]),
            logical_dtype=self.hidden_dtype,
        )
        if self.scale_groups:
            groups = self.scale_groups
            create(SCALES, (cap_t, groups), "float32", (lay["chunk_tokens"], groups), (shard, groups))
        if self.topk:
            k = self.topk
            for name, dtype in ((TOPK_IDS, "int32"), (TOPK_LOGPROBS, "float32")):
                create(name, (cap_t, k), dtype, (lay["chunk_tokens"], k), (shard, k))
        create("sample_offsets", (cap_n + 1,), "int64", (SAMPLE_CHUNK,), None)
        create("sample_index", (cap_n,), "int64", (SAMPLE_CHUNK,), None)
        self._open_arrays()
        for path in sorted(self.group_dir.rglob("*"), key=lambda p: -len(p.parts)):
            _fsync_path(path)
        _fsync_path(self.group_dir)
        self._set_state(Commit(0, 0, 0, False), offsets=[0], index=[])
        self._write_progress()

    def _reopen(self) -> None:
        record = read_progress(self.progress_file)
        if record.get("layout") != self.layout:
            diff = sorted(k for k in self.layout if record.get("layout", {}).get(k) != self.layout[k])
            raise StoreMismatch(
                f"{self.group_dir}: existing rank store was started with other settings ({', '.join(diff)}); "
                "rerun with the same settings or remove it"
            )
        # Temp files of writes a crash cut short (zarr's and the progress record's).
        for leftover in [
            *self.group_dir.rglob("*.partial"),
            *self.progress_file.parent.glob(f".{self.progress_file.name}.*.tmp"),
        ]:
            leftover.unlink()
        self._open_arrays()
        commit = Commit(record["batches"], record["samples"], record["tokens"], record["done"])
        n = commit.samples
        offsets = self._arrays["sample_offsets"][: n + 1].tolist()
        index = self._arrays["sample_index"][:n].tolist()
        if commit.done:
            self._set_state(commit, offsets, index)
            return
        # A crash during finalize may have left the arrays trimmed; give them their capacity back.
        self._resize(self._shapes(self._cap_t, self._cap_n))
        self._set_state(commit, offsets, index)
        if commit.tokens > self._shard.start:
            self._shard.fill([self._arrays[name][self._shard.start : commit.tokens] for name in self.token_arrays], 0)

    def _shapes(self, tokens: int, samples: int) -> dict[str, tuple[int, ...]]:
        """Every array's shape for `tokens` tokens and `samples` samples."""
        rows = {
            "hidden_states": self.layout["hidden_width"],
            SCALES: self.scale_groups,
            TOPK_IDS: self.topk,
            TOPK_LOGPROBS: self.topk,
        }
        shapes = {name: (tokens,) + ((rows[name],) if name in rows else ()) for name in self.token_arrays}
        return {**shapes, "sample_offsets": (samples + 1,), "sample_index": (samples,)}

    def _open_arrays(self) -> None:
        group = zarr.open_group(self.group_dir, mode="r+")
        # write_empty_chunks: zarr would otherwise compare every chunk with the fill value first.
        self._arrays = {
            name: group[name].with_config({"write_empty_chunks": True}) for name in self.token_arrays + SAMPLE_ARRAYS
        }
        # Token rows bypass zarr's per-chunk write path (shard_io writes the same bytes, faster).
        self._formats = {name: ShardFormat.of(self.group_dir / name) for name in self.token_arrays}
        self._cap_t = max(1, self.layout["capacity_tokens"])
        self._cap_n = max(1, self.layout["capacity_samples"])

    def bytes_per_token(self) -> int:
        """Bytes a token takes in this rank's arrays before compression (the store's size, up to the codec's
        saving: ~15% on real bf16 states, none on fp8)."""
        return sum(
            self._arrays[name].dtype.itemsize * math.prod(self._arrays[name].shape[1:]) for name in self.token_arrays
        )

    def _set_state(self, commit: Commit, offsets: list[int], index: list[int]) -> None:
        self._commit = commit
        self._offsets = offsets  # sample_offsets of every appended sample (committed or not)
        self._index = index
        self._batches = commit.batches
        self._pending: list[tuple[int, int]] = []  # (end token, end sample) of uncommitted batches
        # The shard being filled starts at the committed shard boundary; `_reopen` reads back the
        # committed rows past it.
        self._spare: list[_ShardRows] = []  # written shards' buffers, for reuse
        self._shard = self._new_shard((commit.tokens // self.shard_tokens) * self.shard_tokens)
        self._inflight: deque[tuple[int, Future, _ShardRows]] = deque()  # (end token, write, rows), oldest first
        self._failed: BaseException | None = None

    def _new_shard(self, start: int) -> _ShardRows:
        if self._spare:
            return self._spare.pop().reuse(start)
        return _ShardRows(
            self.layout["hidden_width"], self.storage_dtype, self.shard_tokens, start, self.scale_groups, self.topk
        )

    # ---------------------------------------------------------------- writing
    @property
    def committed(self) -> Commit:
        return self._commit

    def resume(self) -> int:
        """How many of the caller's batches are committed: continue with batch number `resume()`."""
        return self._commit.batches

    def append_batch(self, batch: Iterable[Sequence[Any]]) -> None:
        """Buffer one batch of (sample_index, input_ids [S], loss_mask [S], hidden [S, W]) samples, in
        a scaled store (sample_index, input_ids, loss_mask, codes [S, W], scales [S, scale_groups]); a
        top-K store appends (topk_ids int32 [S, K], topk_logprobs float32 [S, K]) to either;
        whole shards that become full are written and the batches they complete committed."""
        if self._commit.done:
            raise StoreError(f"{self.group_dir}: rank store is finalized; nothing more can be appended")
        rows = [self._validate(*sample) for sample in batch]
        n_tokens = sum(len(r[1]) for r in rows)
        end = self._offsets[-1] + n_tokens
        cap_t, cap_n = self.layout["capacity_tokens"], self.layout["capacity_samples"]
        if end > cap_t or len(self._index) + len(rows) > cap_n:
            raise StoreError(
                f"{self.group_dir}: batch {self._batches} exceeds the capacity given at creation "
                f"({cap_t} tokens, {cap_n} samples)"
            )
        self._raise_if_failed()
        for index, *token_rows in rows:
            taken = 0
            while taken < len(token_rows[0]):
                taken += self._shard.fill(token_rows, taken)
                if self._shard.full:
                    self._send(self._shard)
                    self._shard = self._new_shard(self._shard.start + self.shard_tokens)
            self._index.append(index)
            self._offsets.append(self._offsets[-1] + len(token_rows[0]))
        self._batches += 1
        self._pending.append((end, len(self._index)))
        self._collect(keep=self.write_streams)

    def _validate(self, index: Any, ids: Any, mask: Any, hidden: Any, *extra: Any) -> tuple[Any, ...]:
        where = f"{self.group_dir}: sample {index}"
        wanted = (self.scale_groups > 0) + 2 * (self.topk > 0)
        if len(extra) != wanted:
            raise ValueError(
                f"{where}: a {self.hidden_dtype} store{f' with top-{self.topk}' if self.topk else ''} takes "
                f"{3 + wanted} arrays a sample"
            )
        scales, topk = extra[: self.scale_groups > 0], extra[self.scale_groups > 0 :]
        ids = np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids)
        mask = np.asarray(mask.numpy() if isinstance(mask, torch.Tensor) else mask)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise ValueError(f"{where}: input_ids must be a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
        if mask.shape != ids.shape or not (
            mask.dtype == np.bool_ or (mask.dtype.kind in "iu" and mask.max() <= 1 and mask.min() >= 0)
        ):
            raise ValueError(f"{where}: loss_mask must be 0/1 of shape {ids.shape}, got {mask.dtype} {mask.shape}")
        if isinstance(hidden, torch.Tensor):
            if hidden.device.type != "cpu" or hidden.dtype != TORCH_DTYPES[self.hidden_dtype]:
                raise ValueError(
                    f"{where}: hidden must be a CPU {self.hidden_dtype} tensor, got {hidden.dtype} on {hidden.device}"
                )
            hidden = hidden.contiguous().view(getattr(torch, self.layout["storage_dtype"])).numpy()
        hidden = np.asarray(hidden)
        if hidden.dtype != self.storage_dtype:
            raise ValueError(
                f"{where}: hidden must be {self.storage_dtype} ({self.hidden_dtype} bits), got {hidden.dtype}"
            )
        if hidden.shape != (ids.size, self.layout["hidden_width"]):
            raise ValueError(
                f"{where}: hidden has shape {hidden.shape}, expected {(ids.size, self.layout['hidden_width'])}"
            )
        rows = (int(index), ids.astype(np.int32, copy=False), mask.astype(np.uint8, copy=False), hidden)
        checks = [("scales", np.float32, self.scale_groups)] if scales else []
        checks += [("topk ids", np.int32, self.topk), ("topk logprobs", np.float32, self.topk)] if topk else []
        for (what, dtype, width), value in zip(checks, (*scales, *topk)):
            value = np.asarray(value.numpy() if isinstance(value, torch.Tensor) else value)
            if value.dtype != dtype or value.shape != (ids.size, width):
                raise ValueError(
                    f"{where}: {what} must be {np.dtype(dtype)} of shape {(ids.size, width)}, "
                    f"got {value.dtype} {value.shape}"
                )
            rows = (*rows, value)
        return rows

    def flush_shards(self) -> None:
        """Wait until every full shard handed to the write threads is durable, then commit the
        batches they complete (the shard being filled stays in memory)."""
        self._raise_if_failed()
        self._collect(keep=0)

    def _send(self, shard: _ShardRows) -> None:
        """Queue a full shard for writing, after waiting for a write thread if all are busy."""
        self._collect(keep=self.write_streams - 1)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.write_streams, thread_name_prefix="dflash-shard-write")
        self._inflight.append((shard.start + shard.n, self._pool.submit(self._write_shard, shard), shard))

    def _collect(self, keep: int) -> None:
        """Take finished shard writes in order (waiting while more than `keep` are in flight), then
        commit the batches the durable prefix completes. Shards may finish out of order; only a
        prefix of them counts, so a crash leaves nothing committed that is not on disk."""
        durable = None
        while self._inflight and (len(self._inflight) > keep or self._inflight[0][1].done()):
            end, write, shard = self._inflight[0]
            try:
                write.result()
            except BaseException as exc:
                self._failed = exc  # later shards may land, but the commit point must stop here
                raise
            self._inflight.popleft()
            self._spare.append(shard)
            durable = end
        if durable is not None:
            self._commit_through(durable)

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise StoreError(
                f"{self.group_dir}: an earlier shard write failed ({self._failed!r}); nothing after it is committed"
            )

    def _write_shard(self, shard: _ShardRows) -> None:
        """Write one shard's rows as whole shard files, fsynced, and the directories naming them; a full
        disk is one `DiskFull` line."""
        k = shard.start // self.shard_tokens
        try:
            write_shards(
                [(self._formats[name], k, rows[: shard.n]) for name, rows in zip(self.token_arrays, shard.arrays)],
                codec_pool(),
            )
            for name in self.token_arrays:
                self._fsync_chunks(name, [(k,) + (0,) * (self._arrays[name].ndim - 1)], files=False)
        except OSError as exc:
            full = disk_full_error(
                exc, self.group_dir, f"shard {k} of {self.group_dir}", f"free space there, then {RESUME_HINT}"
            )
            if full is None:
                raise
            raise full from exc

    def _fsync_chunks(self, name: str, coords: list[tuple[int, ...]], files: bool = True) -> None:
        """fsync the chunk/shard files at `coords` (unless `files` is False) and the directories leading to them."""
        array_dir, metadata = self.group_dir / name, self._arrays[name].metadata
        dirs: set[Path] = {array_dir}
        for c in coords:
            key = metadata.encode_chunk_key(c)
            if files:
                _fsync_path(array_dir / key)
            parts = key.split("/")[:-1]
            dirs.update(array_dir.joinpath(*parts[: i + 1]) for i in range(len(parts)))
        for d in sorted(dirs, key=lambda p: -len(p.parts)):
            _fsync_path(d)

    def _commit_through(self, durable_tokens: int) -> None:
        """Commit the pending batches that end at or before `durable_tokens`."""
        n_done = 0
        while n_done < len(self._pending) and self._pending[n_done][0] <= durable_tokens:
            n_done += 1
        if n_done == 0:
            return
        tokens, samples = self._pending[n_done - 1]
        del self._pending[:n_done]
        self._write_sample_arrays(self._commit.samples, samples)
        self._commit = Commit(self._commit.batches + n_done, samples, tokens, False)
        self._write_progress()

    def _write_sample_arrays(self, old: int, new: int) -> None:
        """Rewrite, as whole chunks, the offset/index chunks that hold samples [old, new)."""
        for name, values, n in (("sample_offsets", self._offsets, new + 1), ("sample_index", self._index, new)):
            array = self._arrays[name]
            lo = (min(old, n) // SAMPLE_CHUNK) * SAMPLE_CHUNK
            hi = min(-(-n // SAMPLE_CHUNK) * SAMPLE_CHUNK, array.shape[0])
            if hi <= lo:
                continue
            block = np.zeros(hi - lo, dtype=np.int64)
            block[: n - lo] = values[lo:n]
            array[lo:hi] = block
            self._fsync_chunks(
                name, [(k,) for k in range(lo // SAMPLE_CHUNK, hi // SAMPLE_CHUNK + (hi % SAMPLE_CHUNK > 0))]
            )

    def _write_progress(self) -> None:
        c = self._commit
        record = {
            "format_version": FORMAT_VERSION,
            "rank": self.rank,
            "batches": c.batches,
            "samples": c.samples,
            "tokens": c.tokens,
            "done": c.done,
            "layout": self.layout,
        }
        write_bytes_durably(self.progress_file, json.dumps(record, indent=1).encode())

    def _resize(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Change array shapes by rewriting metadata only, dropping shard files beyond the new end.

        (zarr's own shrinking visits every chunk key up to the old capacity: minutes on big stores.)
        """
        for name, shape in shapes.items():
            array = self._arrays[name]
            if array.shape == shape:
                continue
            sync(array.async_array.resize(shape, delete_outside_chunks=False))
            _fsync_path(self.group_dir / name / "zarr.json")
            chunk_len = array.metadata.chunk_grid.chunk_shape[0]
            keep = -(-shape[0] // chunk_len)
            chunk_dir = self.group_dir / name / "c"
            for entry in chunk_dir.iterdir() if chunk_dir.exists() else ():
                if entry.name.isdigit() and int(entry.name) >= keep:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def finalize(self) -> ShardEntry:
        """Trim the arrays to their exact sizes, write the last partial shard and mark the rank done.

        Idempotent: on a finished rank it only returns the entry.
        """
        if not self._commit.done:
            self.flush_shards()
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
            total_t, total_n = self._offsets[-1], len(self._index)
            self._resize(self._shapes(total_t, total_n))
            if self._shard.n:
                self._write_shard(self._shard)
            self._write_sample_arrays(self._commit.samples, total_n)
            self._commit = Commit(self._batches, total_n, total_t, True)
            self._pending.clear()
            self._write_progress()
        return ShardEntry(
            rank=self.rank,
            path=StoreLayout.rank_group_name(self.rank),
            samples=self._commit.samples,
            tokens=self._commit.tokens,
        )
