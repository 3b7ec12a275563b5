"""How the store's chunks are compressed: the codec grammar of `--compression`, the default chunking,
and the threads that compress and decompress chunks in a process."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zarr
import zarr.codecs

from dflash_pipeline.shared.store.layout import SCALED_DTYPES
from dflash_pipeline.shared.store.manifest import STORAGE_DTYPES

# bench/compression.py on real SmolLM2 bf16 activations: 1.18x smaller than `none` at ~1 GB/s encode
# and ~2 GB/s decode per core; zstd:1 reaches 1.23x but encodes ~2x and decodes ~3x slower, which
# would cost the extractor cores at ~1.3 GB/s per GPU and the trainer's loader far more.
DEFAULT_COMPRESSION = "blosc-lz4:5:bitshuffle"
# The same bench on the same states stored as fp8 (`--store-dtype float8_e4m3fn`): blosc-lz4 saves 1.7%
# of the bytes and reads 9x slower than `none`; zstd:1 saves 15% at 11x slower reads. Uncompressed
# fp8 chunks are read straight into the loader's buffers (no decode).
FP8_DEFAULT_COMPRESSION = "none"
_BLOSC_CNAMES = ("zstd", "lz4", "lz4hc", "zlib", "blosclz")
_BLOSC_SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")
# Threads compressing shard chunks in a writer process (numcodecs releases the GIL): 8 keep up with
# one GPU's ~1.3 GB/s of states at the default codec (0.6-1.5 GB/s per thread) with room to spare.
CODEC_THREADS = min(8, os.cpu_count() or 1)
_codec_pool: ThreadPoolExecutor | None = None


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


def default_compression(hidden_dtype: str) -> str:
    """The codec a store of `hidden_dtype` gets unless `--compression` says otherwise."""
    return FP8_DEFAULT_COMPRESSION if hidden_dtype in SCALED_DTYPES else DEFAULT_COMPRESSION


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
