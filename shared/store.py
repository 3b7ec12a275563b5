"""The feature store: per-rank Zarr v3 groups of token-major arrays, a crash-safe writer and a reader.

Layout (docs/FORMAT.md has the bytes): `ROOT/shards/rank-XXXXX.zarr` holds `input_ids` int32 [T],
`loss_mask` uint8 [T], `hidden_states` [T, W] (bfloat16 stored as its uint16 bit pattern),
`sample_offsets` int64 [N+1] and `sample_index` int64 [N]; `ROOT/shards/rank-XXXXX.progress.json`
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

Public API:
- `StoreWriter(root, rank, *, hidden_width, hidden_dtype, capacity_tokens, capacity_samples, ...)`
  opens or creates the rank's group; `resume() -> int` (committed batches), `committed`,
  `append_batch(batch)`, `flush_shards()`, `finalize() -> ShardEntry`.
- `finished_shards(root, world_size) -> (entries, layout)` from the progress records
  (`manifest.mark_complete` uses it); `any_rank_committed(root)` (may a rerun with other settings
  start over?).
- `FeatureStore(root, *, require_complete=True)`: `len`, `lengths`, `num_tokens`, `store[i] -> Sample`,
  `read_tokens(shard, start, stop)`, `read_raw`, `read_ids_and_mask`, `sample_span(i)`, `layer_ids`,
  `hidden_size`, `hidden_width`, `hidden_dtype`, `manifest`, `root`.
- `stores_equal(a, b)`: bit-exact, sample-for-sample comparison.
- `parse_compression(spec)`, `default_chunking(hidden_width, hidden_dtype)`.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import shutil
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import zarr
import zarr.codecs
from zarr.core.sync import sync

from .durable import fsync_path, write_bytes_durably
from .manifest import (
    STORAGE_DTYPES,
    Manifest,
    ShardEntry,
    StoreError,
    StoreIncomplete,
    StoreMismatch,
    check_compatible,
    load_manifest,
)
from .shard_io import ShardedArrayReader, ShardFormat, write_shards

FORMAT_VERSION = 1
SHARDS_DIR = "shards"
# bench/compression.py on real SmolLM2 bf16 activations: 1.18x smaller than `none` at ~1 GB/s encode
# and ~2 GB/s decode per core; zstd:1 reaches 1.23x but encodes ~2x and decodes ~3x slower, which
# would cost the extractor cores at ~1.3 GB/s per GPU and the trainer's loader far more.
DEFAULT_COMPRESSION = "blosc-lz4:5:bitshuffle"
# Chunk of the small per-sample arrays (sample_offsets, sample_index), in entries.
SAMPLE_CHUNK = 16384
TOKEN_ARRAYS = ("input_ids", "loss_mask", "hidden_states")
SAMPLE_ARRAYS = ("sample_offsets", "sample_index")
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_BLOSC_CNAMES = ("zstd", "lz4", "lz4hc", "zlib", "blosclz")
_BLOSC_SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")
# Threads compressing shard chunks in a writer process (numcodecs releases the GIL): 8 keep up with
# one GPU's ~1.3 GB/s of states at the default codec (0.6-1.5 GB/s per thread) with room to spare.
CODEC_THREADS = min(8, os.cpu_count() or 1)
_codec_pool: ThreadPoolExecutor | None = None
# Shard files written at once by one writer, each on its own thread: while one waits in fsync the next
# is compressed and copied to the page cache, and the disk sees several requests at a time.
WRITE_STREAMS = 4


def codec_pool() -> ThreadPoolExecutor:
    """This process's chunk-compression threads (created on first use)."""
    global _codec_pool
    if _codec_pool is None:
        _codec_pool = ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="dflash-codec")
    return _codec_pool


def _forget_codec_pool() -> None:
    """A forked child inherits the pool object but not its threads: work sent to it would never run."""
    global _codec_pool
    _codec_pool = None


os.register_at_fork(after_in_child=_forget_codec_pool)


def rank_group_name(rank: int) -> str:
    return f"{SHARDS_DIR}/rank-{rank:05d}.zarr"


def progress_path(root: str | Path, rank: int) -> Path:
    return Path(root) / SHARDS_DIR / f"rank-{rank:05d}.progress.json"


def parse_compression(spec: str) -> list[Any]:
    """Zarr v3 compressors for `none`, `zstd:<level>` or `blosc-<cname>:<level>:<shuffle>`."""
    grammar = "expected 'none', 'zstd:<level>' or 'blosc-<cname>:<level>:<noshuffle|shuffle|bitshuffle>'"
    parts = spec.strip().lower().split(":")
    try:
        if parts == ["none"]:
            return []
        if parts[0] == "zstd" and len(parts) == 2:
            return [zarr.codecs.ZstdCodec(level=int(parts[1]))]
        if parts[0].startswith("blosc-") and len(parts) == 3:
            cname = parts[0].removeprefix("blosc-")
            if cname in _BLOSC_CNAMES and parts[2] in _BLOSC_SHUFFLES:
                return [zarr.codecs.BloscCodec(cname=cname, clevel=int(parts[1]), shuffle=parts[2])]
    except ValueError:
        pass
    raise ValueError(f"compression {spec!r}: {grammar}")


def default_chunking(hidden_width: int, hidden_dtype: str) -> tuple[int, int]:
    """(chunk_tokens, shard_tokens): chunks of up to ~4 MiB (the unit of reads), shards of 64 chunks
    up to ~256 MiB (the unit of writes and of files). Powers of two, so shards stay chunk-aligned."""
    row_bytes = hidden_width * np.dtype(STORAGE_DTYPES[hidden_dtype]).itemsize
    chunk = 1 << max(4, min(12, int(math.log2(max(1, (4 << 20) // row_bytes)))))
    per_shard = 1 << max(0, min(6, int(math.log2(max(1, (256 << 20) // (row_bytes * chunk))))))
    return chunk, chunk * per_shard


@dataclass(frozen=True)
class Commit:
    """What the progress record says is durable: the first `batches` batches, holding these counts."""

    batches: int
    samples: int
    tokens: int
    done: bool


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]
    hidden_states: torch.Tensor  # logical dtype [S, W]
    sample_index: int


def _fsync_path(path: Path) -> None:
    try:
        fsync_path(path)
    except FileNotFoundError:  # zarr leaves out a shard whose chunks are all fill value
        pass


class _ShardRows:
    """The token rows of one shard (ids, mask, hidden), filled in order and then written whole. A full
    one goes to a write thread untouched while the next fills, so rows are copied in exactly once."""

    def __init__(self, width: int, dtype: np.dtype, rows: int, start: int) -> None:
        self.arrays = [np.empty(rows, np.int32), np.empty(rows, np.uint8), np.empty((rows, width), dtype)]
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

    def reuse(self, start: int) -> "_ShardRows":
        self.start, self.n = start, 0
        return self


class StoreWriter:
    """Writes one rank's group; see the module docstring for the commit protocol.

    Opening is also resuming: with a progress record present the writer continues from its commit
    point (the caller skips the first `resume()` batches); without one any leftover group is deleted
    and created afresh. `overwrite=True` always starts afresh.
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
        compression: str = DEFAULT_COMPRESSION,
        overwrite: bool = False,
        write_streams: int = WRITE_STREAMS,
    ) -> None:
        if hidden_dtype not in STORAGE_DTYPES:
            raise ValueError(f"hidden_dtype {hidden_dtype!r} is not one of {sorted(STORAGE_DTYPES)}")
        default_chunk, default_shard = default_chunking(hidden_width, hidden_dtype)
        chunk_tokens = chunk_tokens or default_chunk
        shard_tokens = shard_tokens or max(default_shard, chunk_tokens)
        if shard_tokens % chunk_tokens:
            raise ValueError(f"shard_tokens {shard_tokens} is not a multiple of chunk_tokens {chunk_tokens}")
        parse_compression(compression)  # fail before touching the disk
        if write_streams < 1:
            raise ValueError(f"write_streams must be >= 1, got {write_streams}")
        self.write_streams = write_streams
        self._pool: ThreadPoolExecutor | None = None
        self.root = Path(root)
        self.rank = rank
        self.group_dir = self.root / rank_group_name(rank)
        self.progress_file = progress_path(root, rank)
        self.hidden_dtype = hidden_dtype
        self.storage_dtype = np.dtype(STORAGE_DTYPES[hidden_dtype])
        self.shard_tokens = shard_tokens
        self.layout = {
            "hidden_width": int(hidden_width),
            "hidden_dtype": hidden_dtype,
            "storage_dtype": STORAGE_DTYPES[hidden_dtype],
            "capacity_tokens": int(capacity_tokens),
            "capacity_samples": int(capacity_samples),
            "chunk_tokens": int(chunk_tokens),
            "shard_tokens": int(shard_tokens),
            "compression": compression,
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
        group = zarr.open_group(self.group_dir, mode="w", attributes={"format_version": FORMAT_VERSION, "rank": self.rank})
        cap_t, cap_n, shard = max(1, lay["capacity_tokens"]), max(1, lay["capacity_samples"]), lay["shard_tokens"]

        def create(name: str, shape: tuple, dtype: Any, chunks: tuple, shards: tuple | None, **attrs: Any) -> None:
            group.create_array(
                name, shape=shape, dtype=dtype, chunks=chunks, shards=shards, compressors=compressors,
                fill_value=0, attributes=attrs,
            )

        # The 1-D token arrays use one inner chunk per shard: small, and read with the hidden rows.
        create("input_ids", (cap_t,), "int32", (shard,), (shard,))
        create("loss_mask", (cap_t,), "uint8", (shard,), (shard,))
        create(
            "hidden_states", (cap_t, lay["hidden_width"]), lay["storage_dtype"],
            (lay["chunk_tokens"], lay["hidden_width"]), (shard, lay["hidden_width"]),
            logical_dtype=self.hidden_dtype,
        )
        create("sample_offsets", (cap_n + 1,), "int64", (SAMPLE_CHUNK,), None)
        create("sample_index", (cap_n,), "int64", (SAMPLE_CHUNK,), None)
        self._open_arrays()
        for path in sorted(self.group_dir.rglob("*"), key=lambda p: -len(p.parts)):
            _fsync_path(path)
        _fsync_path(self.group_dir)
        self._set_state(Commit(0, 0, 0, False), offsets=[0], index=[])
        self._write_progress()

    def _reopen(self) -> None:
        record = _read_progress(self.progress_file)
        if record.get("layout") != self.layout:
            diff = sorted(k for k in self.layout if record.get("layout", {}).get(k) != self.layout[k])
            raise StoreMismatch(
                f"{self.group_dir}: existing rank store was started with other settings ({', '.join(diff)}); "
                "rerun with the same settings or remove it"
            )
        # Temp files of writes a crash cut short (zarr's and the progress record's).
        for leftover in [*self.group_dir.rglob("*.partial"), *self.progress_file.parent.glob(f".{self.progress_file.name}.*.tmp")]:
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
        self._resize({"input_ids": (self._cap_t,), "loss_mask": (self._cap_t,),
                      "hidden_states": (self._cap_t, self.layout["hidden_width"]),
                      "sample_offsets": (self._cap_n + 1,), "sample_index": (self._cap_n,)})
        self._set_state(commit, offsets, index)
        if commit.tokens > self._shard.start:
            self._shard.fill([self._arrays[name][self._shard.start : commit.tokens] for name in TOKEN_ARRAYS], 0)

    def _open_arrays(self) -> None:
        group = zarr.open_group(self.group_dir, mode="r+")
        # write_empty_chunks: zarr would otherwise compare every chunk with the fill value first.
        self._arrays = {name: group[name].with_config({"write_empty_chunks": True}) for name in TOKEN_ARRAYS + SAMPLE_ARRAYS}
        # Token rows bypass zarr's per-chunk write path (shard_io writes the same bytes, faster).
        self._formats = {name: ShardFormat.of(self.group_dir / name) for name in TOKEN_ARRAYS}
        self._cap_t = max(1, self.layout["capacity_tokens"])
        self._cap_n = max(1, self.layout["capacity_samples"])

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
        return _ShardRows(self.layout["hidden_width"], self.storage_dtype, self.shard_tokens, start)

    # ---------------------------------------------------------------- writing
    @property
    def committed(self) -> Commit:
        return self._commit

    def resume(self) -> int:
        """How many of the caller's batches are committed: continue with batch number `resume()`."""
        return self._commit.batches

    def append_batch(self, batch: Iterable[Sequence[Any]]) -> None:
        """Buffer one batch of (sample_index, input_ids [S], loss_mask [S], hidden [S, W]) samples;
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
        for index, ids, mask, hidden in rows:
            taken = 0
            while taken < len(ids):
                taken += self._shard.fill((ids, mask, hidden), taken)
                if self._shard.full:
                    self._send(self._shard)
                    self._shard = self._new_shard(self._shard.start + self.shard_tokens)
            self._index.append(index)
            self._offsets.append(self._offsets[-1] + len(ids))
        self._batches += 1
        self._pending.append((end, len(self._index)))
        self._collect(keep=self.write_streams)

    def _validate(self, index: Any, ids: Any, mask: Any, hidden: Any) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        where = f"{self.group_dir}: sample {index}"
        ids = np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids)
        mask = np.asarray(mask.numpy() if isinstance(mask, torch.Tensor) else mask)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise ValueError(f"{where}: input_ids must be a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
        if mask.shape != ids.shape or not (mask.dtype == np.bool_ or (mask.dtype.kind in "iu" and mask.max() <= 1 and mask.min() >= 0)):
            raise ValueError(f"{where}: loss_mask must be 0/1 of shape {ids.shape}, got {mask.dtype} {mask.shape}")
        if isinstance(hidden, torch.Tensor):
            if hidden.device.type != "cpu" or hidden.dtype != _TORCH_DTYPES[self.hidden_dtype]:
                raise ValueError(f"{where}: hidden must be a CPU {self.hidden_dtype} tensor, got {hidden.dtype} on {hidden.device}")
            hidden = hidden.contiguous()
            hidden = (hidden.view(torch.uint16) if self.hidden_dtype == "bfloat16" else hidden).numpy()
        hidden = np.asarray(hidden)
        if hidden.dtype != self.storage_dtype:
            raise ValueError(f"{where}: hidden must be {self.storage_dtype} ({self.hidden_dtype} bits), got {hidden.dtype}")
        if hidden.shape != (ids.size, self.layout["hidden_width"]):
            raise ValueError(f"{where}: hidden has shape {hidden.shape}, expected {(ids.size, self.layout['hidden_width'])}")
        return int(index), ids.astype(np.int32, copy=False), mask.astype(np.uint8, copy=False), hidden

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
            raise StoreError(f"{self.group_dir}: an earlier shard write failed ({self._failed!r}); nothing after it is committed")

    def _write_shard(self, shard: _ShardRows) -> None:
        """Write one shard's rows as whole shard files, fsynced, and the directories naming them."""
        k = shard.start // self.shard_tokens
        write_shards([(self._formats[name], k, rows[: shard.n]) for name, rows in zip(TOKEN_ARRAYS, shard.arrays)],
                     codec_pool())
        for name in TOKEN_ARRAYS:
            self._fsync_chunks(name, [(k,) + (0,) * (self._arrays[name].ndim - 1)], files=False)

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
            self._fsync_chunks(name, [(k,) for k in range(lo // SAMPLE_CHUNK, hi // SAMPLE_CHUNK + (hi % SAMPLE_CHUNK > 0))])

    def _write_progress(self) -> None:
        c = self._commit
        record = {"format_version": FORMAT_VERSION, "rank": self.rank, "batches": c.batches, "samples": c.samples,
                  "tokens": c.tokens, "done": c.done, "layout": self.layout}
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
            width = self.layout["hidden_width"]
            self._resize({"input_ids": (total_t,), "loss_mask": (total_t,), "hidden_states": (total_t, width),
                          "sample_offsets": (total_n + 1,), "sample_index": (total_n,)})
            if self._shard.n:
                self._write_shard(self._shard)
            self._write_sample_arrays(self._commit.samples, total_n)
            self._commit = Commit(self._batches, total_n, total_t, True)
            self._pending.clear()
            self._write_progress()
        return ShardEntry(rank=self.rank, path=rank_group_name(self.rank), samples=self._commit.samples,
                          tokens=self._commit.tokens)


def _read_progress(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise StoreIncomplete(f"{path}: no progress record (this rank never started)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: corrupt progress record ({exc})") from None
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{path}: unknown progress record format (expected format_version {FORMAT_VERSION})")
    return record


def finished_shards(root: str | Path, world_size: int) -> tuple[list[ShardEntry], dict[str, Any]]:
    """The shard list and the common layout of a finished store, from the ranks' progress records.

    Raises StoreIncomplete naming the ranks that are not done, StoreMismatch if layouts differ.
    """
    entries, layouts, unfinished = [], [], []
    for rank in range(world_size):
        record = _read_progress(progress_path(root, rank))
        if not record["done"]:
            unfinished.append(str(rank))
        layouts.append({k: v for k, v in record["layout"].items() if not k.startswith("capacity_")})
        entries.append(ShardEntry(rank=rank, path=rank_group_name(rank), samples=record["samples"], tokens=record["tokens"]))
    if unfinished:
        raise StoreIncomplete(f"{root}: ranks {', '.join(unfinished)} have not finished")
    if any(layout != layouts[0] for layout in layouts):
        raise StoreMismatch(f"{root}: ranks were written with different layouts ({layouts})")
    return entries, layouts[0] if layouts else {"compression": None, "chunk_tokens": None, "shard_tokens": None}


def any_rank_committed(root: str | Path) -> bool:
    """Whether some rank's progress record holds a committed batch or sample (an unreadable record
    counts as one: it may): a store for which this is False holds nothing worth keeping."""
    for path in sorted((Path(root) / SHARDS_DIR).glob("rank-*.progress.json")):
        try:
            record = _read_progress(path)
        except StoreError:
            return True
        if record.get("batches") or record.get("samples"):
            return True
    return False


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
                if progress_path(root, rank).exists():
                    record = _read_progress(progress_path(root, rank))
                    entries.append(ShardEntry(rank, rank_group_name(rank), record["samples"], record["tokens"]))
        self.shards = entries
        self._offsets: list[np.ndarray] = []
        self._sample_index: list[np.ndarray] = []
        for entry in entries:
            group = zarr.open_group(self.root / entry.path, mode="r")
            offsets = group["sample_offsets"][: entry.samples + 1]
            hidden = group["hidden_states"]
            if (offsets[-1] != entry.tokens or hidden.shape[1] != self.manifest.hidden_width
                    or hidden.attrs.get("logical_dtype") != self.manifest.hidden_dtype):
                raise StoreError(
                    f"{self.root / entry.path}: shard disagrees with the manifest (tokens {offsets[-1]} vs "
                    f"{entry.tokens}, width {hidden.shape[1]} vs {self.manifest.hidden_width}, "
                    f"dtype {hidden.attrs.get('logical_dtype')} vs {self.manifest.hidden_dtype})"
                )
            self._offsets.append(offsets)
            self._sample_index.append(group["sample_index"][: entry.samples])
        self._first = np.cumsum([0] + [e.samples for e in entries]).tolist()  # global index of each shard's first sample
        self.lengths = np.concatenate([np.diff(o) for o in self._offsets]) if entries else np.zeros(0, np.int64)
        self._readers: list[dict[str, ShardedArrayReader]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = None
        return state

    def _shard_readers(self, shard: int) -> dict[str, ShardedArrayReader]:
        if self._readers is None:
            self._readers = [{name: ShardedArrayReader(self.root / entry.path / name) for name in TOKEN_ARRAYS}
                             for entry in self.shards]
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
        return _TORCH_DTYPES[self.manifest.hidden_dtype]

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
            raise IndexError(f"{self.root}: tokens [{start}, {stop}) outside shard {shard} ({self.shards[shard].tokens} tokens)")
        readers = self._shard_readers(shard)
        return readers["input_ids"].read(start, stop), readers["loss_mask"].read(start, stop)

    def read_raw(self, shard: int, start: int, stop: int, hidden_out: np.ndarray | None = None,
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens [start, stop) of one shard as stored: int32 ids, uint8 mask, hidden in the storage
        dtype (decoded into `hidden_out` when given: C-contiguous [stop-start, W])."""
        ids, mask = self.read_ids_and_mask(shard, start, stop)
        return ids, mask, self._shard_readers(shard)["hidden_states"].read(start, stop, hidden_out)

    def read_tokens(self, shard: int, start: int, stop: int, hidden_out: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Contiguous tokens of one shard as tensors; `hidden_out` (a contiguous [stop-start, W] CPU
        tensor of the logical dtype) receives the hidden states without an intermediate copy."""
        bits = self.manifest.hidden_dtype == "bfloat16"
        out = None if hidden_out is None else (hidden_out.view(torch.uint16) if bits else hidden_out).numpy()
        ids, mask, stored = self.read_raw(shard, start, stop, out)
        hidden = hidden_out
        if hidden is None:
            hidden = torch.from_numpy(stored).view(torch.bfloat16) if bits else torch.from_numpy(stored)
        return torch.from_numpy(ids).long(), torch.from_numpy(mask).bool(), hidden

    def sample_span(self, i: int) -> tuple[int, int, int, int]:
        """(shard, start token, stop token, sample_index) of global sample i."""
        shard, j = self._locate(i)
        offsets = self._offsets[shard]
        return shard, int(offsets[j]), int(offsets[j + 1]), int(self._sample_index[shard][j])

    def __getitem__(self, i: int) -> Sample:
        shard, start, stop, index = self.sample_span(i)
        ids, mask, hidden = self.read_tokens(shard, start, stop)
        return Sample(input_ids=ids, loss_mask=mask, hidden_states=hidden, sample_index=index)


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
    if (len(a) != len(b) or a.manifest.hidden_dtype != b.manifest.hidden_dtype
            or not np.array_equal(a.lengths, b.lengths)
            or not np.array_equal(np.concatenate([np.zeros(0, np.int64), *a._sample_index]),
                                  np.concatenate([np.zeros(0, np.int64), *b._sample_index]))):
        return False
    if [e.tokens for e in a.shards] == [e.tokens for e in b.shards]:
        window = a.manifest.shard_tokens or 4096
        spans = [((k, t, min(t + window, e.tokens)),) * 2 for k, e in enumerate(a.shards) for t in range(0, e.tokens, window)]
    else:
        spans = [(a.sample_span(i)[:3], b.sample_span(i)[:3]) for i in range(len(a))]
    return all(
        all(_same_bits(x, y) for x, y in zip(a.read_raw(*span_a), b.read_raw(*span_b)))
        for span_a, span_b in spans
    )
