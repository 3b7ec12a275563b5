"""Whole-shard writes and ranged reads of the store's sharded Zarr v3 arrays, bypassing zarr's
per-chunk Python path while producing and consuming exactly the bytes zarr does.

Why: zarr 3.1 handles every inner chunk of a shard in Python on its single event-loop thread (a
fill-value array per chunk, a merge copy, a final concatenation). That capped the extractor's writer
at ~0.5 GB/s, below one GPU's ~1.3 GB/s of states, and the trainer's loader likewise. The store's
arrays are simple, chunked along axis 0 only, so a shard is: its inner chunks in order, each encoded
by the chunk codecs (`bytes` little-endian, an optional compressor, `crc32c`), then the shard index
(offset, length) per chunk as little-endian uint64 and its crc32c. Here the chunks are compressed
by a thread pool (the numcodecs compressors release the GIL), written with one `writev`, and read
with one `pread` per contiguous run of chunks decoded straight into the caller's buffer. The layout
comes from the array's own `zarr.json`, and tests check the bytes against zarr's own writer and
reader both ways.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google_crc32c
import numcodecs
import numpy as np

from dflash_pipeline.shared.runtime.errors import UserError

EMPTY = np.uint64(2**64 - 1)  # index entry of a chunk that is not stored (all fill value)
_SHUFFLES = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # pieces per readv/writev call


class ShardFormatError(UserError, ValueError):
    """The array's zarr.json describes a layout this module does not handle (or the bytes are bad)."""


def decode_in_this_thread_only() -> None:
    """Make blosc decode on the calling thread alone. numcodecs' blosc spawns up to 8 threads per call
    made from a process's main thread, which is where DataLoader workers decode: a dozen workers
    would each start 8 (measured on a 16-core host: 12 workers gave 16 packs/s, barely more than 4)."""
    from numcodecs import blosc

    blosc.use_threads = False


def _compressor(codec: dict[str, Any]) -> numcodecs.abc.Codec:
    """The numcodecs codec that zarr itself uses for this v3 codec entry."""
    name, config = codec["name"], dict(codec.get("configuration", {}))
    if name == "blosc":
        config["shuffle"] = _SHUFFLES[config["shuffle"]]
        return numcodecs.get_codec({"id": "blosc", **config})
    if name == "zstd":
        return numcodecs.get_codec(
            {"id": "zstd", "level": config.get("level", 0), "checksum": config.get("checksum", False)}
        )
    raise ShardFormatError(f"unsupported chunk codec {name!r}")


def _crc(data: Any) -> int:
    """crc32c of any contiguous buffer (google_crc32c takes bytes and arrays, not memoryviews)."""
    return google_crc32c.value(np.frombuffer(data, np.uint8))


def _checked(blob: memoryview, where: str) -> memoryview:
    """`blob` without its trailing crc32c, which must match."""
    if len(blob) < 4 or _crc(blob[:-4]) != int.from_bytes(blob[-4:], "little"):
        raise ShardFormatError(f"{where}: crc32c mismatch (corrupt shard)")
    return blob[:-4]


@dataclass(frozen=True)
class ShardFormat:
    """How one sharded array lays out its bytes, read from its zarr.json."""

    array_dir: Path
    shape: tuple[int, ...]
    dtype: np.dtype
    chunk_rows: int
    shard_rows: int
    compressor: numcodecs.abc.Codec | None
    chunk_crc: bool

    @classmethod
    def of(cls, array_dir: str | Path) -> ShardFormat:
        array_dir = Path(array_dir)
        meta = json.loads((array_dir / "zarr.json").read_bytes())
        shape = tuple(meta["shape"])
        shard_shape = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
        codecs = meta["codecs"]
        where = f"{array_dir}/zarr.json"
        if (
            len(codecs) != 1
            or codecs[0]["name"] != "sharding_indexed"
            or meta["chunk_key_encoding"] != {"name": "default", "configuration": {"separator": "/"}}
        ):
            raise ShardFormatError(f"{where}: not a single sharding codec with '/' chunk keys")
        sharding = codecs[0]["configuration"]
        chunk_shape = tuple(sharding["chunk_shape"])
        if chunk_shape[1:] != shape[1:] or shard_shape[1:] != shape[1:] or shard_shape[0] % chunk_shape[0]:
            raise ShardFormatError(f"{where}: chunks must span all but the first axis and tile the shard")
        if sharding.get("index_location", "end") != "end" or [c["name"] for c in sharding["index_codecs"]] != [
            "bytes",
            "crc32c",
        ]:
            raise ShardFormatError(f"{where}: shard index must be little-endian bytes + crc32c at the end")
        inner = list(sharding["codecs"])
        if (
            not inner
            or inner[0]["name"] != "bytes"
            or inner[0].get("configuration", {}).get("endian", "little") != "little"
        ):
            raise ShardFormatError(f"{where}: inner chunks must start with little-endian bytes")
        inner = inner[1:]
        chunk_crc = bool(inner) and inner[-1]["name"] == "crc32c"
        inner = inner[:-1] if chunk_crc else inner
        if len(inner) > 1:
            raise ShardFormatError(f"{where}: at most one compressor is supported, got {[c['name'] for c in inner]}")
        if meta["fill_value"] != 0:
            raise ShardFormatError(f"{where}: fill value must be 0")
        return cls(
            array_dir,
            shape,
            np.dtype(meta["data_type"]).newbyteorder("<"),
            chunk_shape[0],
            shard_shape[0],
            _compressor(inner[0]) if inner else None,
            chunk_crc,
        )

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_rows // self.chunk_rows

    def shard_path(self, shard: int) -> Path:
        return self.array_dir / "c" / str(shard) / Path(*["0"] * (len(self.shape) - 1))

    # ------------------------------------------------------------------ writing
    def split(self, rows: np.ndarray) -> list[np.ndarray]:
        """The inner chunks' rows of a shard holding `rows` (at most shard_rows; the rest is not stored)."""
        if not 0 < len(rows) <= self.shard_rows:
            raise ValueError(f"a shard holds 1..{self.shard_rows} rows, got {len(rows)}")
        return [rows[k : k + self.chunk_rows] for k in range(0, len(rows), self.chunk_rows)]

    def encode_chunk(self, rows: np.ndarray) -> list[Any]:
        """Byte pieces of one stored chunk (rows padded with the fill value to a whole chunk)."""
        if len(rows) < self.chunk_rows:
            padded = np.zeros((self.chunk_rows,) + rows.shape[1:], self.dtype)
            padded[: len(rows)] = rows
            rows = padded
        data = memoryview(np.ascontiguousarray(rows, self.dtype)).cast("B")
        if self.compressor is not None:
            data = memoryview(self.compressor.encode(data))
        if not self.chunk_crc:
            return [data]
        return [data, _crc(data).to_bytes(4, "little")]

    def assemble(self, encoded: list[list[Any]]) -> list[Any]:
        """A shard's byte pieces: its encoded chunks (in order, from chunk 0) and the index."""
        index = np.full((self.chunks_per_shard, 2), EMPTY, dtype="<u8")
        offset = 0
        for k, pieces in enumerate(encoded):
            size = sum(len(p) for p in pieces)
            index[k] = (offset, size)
            offset += size
        index_bytes = index.tobytes()
        return [piece for pieces in encoded for piece in pieces] + [
            index_bytes,
            _crc(index_bytes).to_bytes(4, "little"),
        ]

    def write_file(self, shard: int, pieces: list[Any]) -> Path:
        """Write a shard file atomically (temp file, fsync, rename); the caller fsyncs directories."""
        path = self.shard_path(shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".partial")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _writev_all(fd, pieces)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
        return path

    # ------------------------------------------------------------------ reading
    def read_index(self, fd: int, shard: int) -> np.ndarray:
        """[chunks_per_shard, 2] (offset, length) of one shard file, crc-checked."""
        size = 16 * self.chunks_per_shard + 4
        end = os.fstat(fd).st_size
        blob = memoryview(os.pread(fd, size, end - size)) if end >= size else memoryview(b"")
        if len(blob) != size:
            raise ShardFormatError(f"{self.shard_path(shard)}: shorter than its index")
        body = _checked(blob, str(self.shard_path(shard)))
        return np.frombuffer(body, dtype="<u8").reshape(self.chunks_per_shard, 2)

    def read_rows(self, fd: int, index: np.ndarray, shard: int, start: int, stop: int, out: np.ndarray) -> None:
        """Rows [start, stop) of shard `shard` (relative to the shard) into `out`, one pread per
        contiguous run of chunks; chunks wholly inside the range decode straight into `out`."""
        first, last = start // self.chunk_rows, (stop - 1) // self.chunk_rows
        where = str(self.shard_path(shard))
        k = first
        while k <= last:
            if index[k, 0] == EMPTY:  # not stored: all fill value
                lo, hi = max(start, k * self.chunk_rows), min(stop, (k + 1) * self.chunk_rows)
                out[lo - start : hi - start] = 0
                k += 1
                continue
            run_end = k
            while (
                run_end < last
                and index[run_end + 1, 0] != EMPTY
                and index[run_end, 0] + index[run_end, 1] == index[run_end + 1, 0]
            ):
                run_end += 1
            base = int(index[k, 0])
            span = int(index[run_end, 0] + index[run_end, 1]) - base
            lo, hi = max(start, k * self.chunk_rows), min(stop, (run_end + 1) * self.chunk_rows)
            if self.compressor is None and lo == k * self.chunk_rows and hi == (run_end + 1) * self.chunk_rows:
                self._read_raw_run(fd, base, span, k, run_end, out[lo - start : hi - start], where)
                k = run_end + 1
                continue
            blob = memoryview(_scratch(span))
            _preadv_all(fd, [blob], base, f"{where}: truncated (chunk {run_end} past the end of the file)")
            for c in range(k, run_end + 1):
                piece = blob[int(index[c, 0]) - base : int(index[c, 0] + index[c, 1]) - base]
                self._decode_chunk(piece, c, start, stop, out, where)
            k = run_end + 1

    def _read_raw_run(self, fd: int, base: int, span: int, k: int, last: int, rows: np.ndarray, where: str) -> None:
        """Uncompressed whole chunks k..last: one scatter read straight into `rows`, each chunk's
        crc32c into a side buffer (no intermediate copy: the loader moves ~170 MB per pack)."""
        flat = rows.reshape(-1).view(np.uint8)
        size = flat.nbytes // (last - k + 1)
        crcs = np.empty((last - k + 1, 4), np.uint8) if self.chunk_crc else None
        views = []
        for j in range(last - k + 1):
            views.append(flat[j * size : (j + 1) * size])
            if crcs is not None:
                views.append(crcs[j])
        if span != flat.nbytes + (0 if crcs is None else crcs.nbytes):
            raise ShardFormatError(f"{where} chunks {k}-{last}: {span} bytes stored, expected {flat.nbytes} and crcs")
        _preadv_all(fd, views, base, f"{where}: truncated (chunk {last} past the end of the file)")
        if crcs is not None:
            for j in range(last - k + 1):
                if _crc(flat[j * size : (j + 1) * size]) != int.from_bytes(crcs[j].tobytes(), "little"):
                    raise ShardFormatError(f"{where} chunk {k + j}: crc32c mismatch (corrupt shard)")

    def _decode_chunk(self, piece: memoryview, c: int, start: int, stop: int, out: np.ndarray, where: str) -> None:
        if self.chunk_crc:
            piece = _checked(piece, f"{where} chunk {c}")
        lo, hi = max(start, c * self.chunk_rows), min(stop, (c + 1) * self.chunk_rows)
        whole = lo == c * self.chunk_rows and hi == (c + 1) * self.chunk_rows
        target = out[lo - start : hi - start] if whole else np.empty((self.chunk_rows,) + out.shape[1:], self.dtype)
        flat = target.reshape(-1).view(np.uint8)
        if self.compressor is None:
            if len(piece) != flat.nbytes:
                raise ShardFormatError(f"{where} chunk {c}: {len(piece)} bytes, expected {flat.nbytes}")
            flat[:] = np.frombuffer(piece, np.uint8)
        else:
            self.compressor.decode(piece, out=flat)
        if not whole:
            out[lo - start : hi - start] = target[lo - c * self.chunk_rows : hi - c * self.chunk_rows]


class ShardedArrayReader:
    """Ranged row reads of one sharded array. Keeps up to `max_open` shard files open with their
    indexes; an open file keeps reading the version it opened (the writer replaces files by rename)."""

    def __init__(self, array_dir: str | Path, max_open: int = 32) -> None:
        self.format = ShardFormat.of(array_dir)
        self.max_open = max_open
        self._open: OrderedDict[int, tuple[int, np.ndarray]] = OrderedDict()

    def _shard(self, shard: int) -> tuple[int, np.ndarray]:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        try:
            fd = os.open(self.format.shard_path(shard), os.O_RDONLY)
        except FileNotFoundError:
            raise ShardFormatError(f"{self.format.shard_path(shard)}: shard file missing") from None
        try:
            entry = (fd, self.format.read_index(fd, shard))
        except BaseException:
            os.close(fd)
            raise
        self._open[shard] = entry
        if len(self._open) > self.max_open:
            os.close(self._open.popitem(last=False)[1][0])
        return entry

    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) into `out` (C-contiguous, [stop-start, *row shape]) or a new array."""
        fmt = self.format
        shape = (stop - start,) + fmt.shape[1:]
        if out is None:
            out = np.empty(shape, fmt.dtype)
        elif out.shape != shape or out.dtype != fmt.dtype or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(
                f"out must be a writable C-contiguous {fmt.dtype} array of shape {shape}, got {out.dtype} {out.shape}"
            )
        pos = start
        while pos < stop:
            shard = pos // fmt.shard_rows
            end = min(stop, (shard + 1) * fmt.shard_rows)
            fd, index = self._shard(shard)
            base = shard * fmt.shard_rows
            fmt.read_rows(fd, index, shard, pos - base, end - base, out[pos - start : end - start])
            pos = end
        return out

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1][0])

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: os may already be gone
            pass


def write_shards(jobs: list[tuple[ShardFormat, int, np.ndarray]], pool: Executor) -> list[Path]:
    """Write (format, shard number, rows) shards: every chunk is queued for compression at once and
    the files are written in order as their chunks are ready, so writing overlaps compressing."""
    pending = [
        (fmt, shard, [pool.submit(fmt.encode_chunk, part) for part in fmt.split(rows)]) for fmt, shard, rows in jobs
    ]
    return [fmt.write_file(shard, fmt.assemble([f.result() for f in futures])) for fmt, shard, futures in pending]


def _preadv_all(fd: int, views: list[Any], offset: int, truncated: str) -> None:
    """os.preadv until every view is filled; `truncated` is the error if the file ends first."""
    views = list(views)
    while views:
        n = os.preadv(fd, views[:_IOV_MAX], offset)
        if n == 0:
            raise ShardFormatError(truncated)
        offset += n
        _consume(views, n)


_scratch_local = threading.local()


def _scratch(n: int) -> np.ndarray:
    """n bytes of this thread's reusable read buffer. A fresh buffer per compressed read (up to a
    shard, ~140 MB) pays a page fault per 4 KiB every time: a 168 MB `pread` into new memory took
    1.8-2.4x as long as into a reused buffer on the CPU machine."""
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _scratch_local.buf = np.empty(n, np.uint8)
    return buf[:n]


def _writev_all(fd: int, pieces: list[Any]) -> None:
    """os.writev until every byte is written (writev may write less, and takes at most IOV_MAX pieces)."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        _consume(views, os.writev(fd, views[:_IOV_MAX]))


def _consume(views: list[Any], n: int) -> None:
    """Drop the first `n` bytes of a scatter/gather list after a vectored read or write of them
    (either may move fewer bytes than asked, ending mid-piece)."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0
