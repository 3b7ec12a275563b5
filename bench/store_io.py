"""Store write and read throughput: the store's own shard path against zarr's, in the same run.

Writes the same bf16 rows (random normal values, Qwen3-8B width by default) through `StoreWriter`
(whole shards encoded by `shared/store/shard_io.py`, crash-safe commits and fsyncs included) and, as the
baseline, through zarr's own `array[a:b] = rows` on an identically configured array (the writer's
previous path). Reads: `FeatureStore.read_tokens` over sample-sized spans against zarr slicing of the
same files. Both paths produce the same bytes (tests/test_shard_io.py), so only speed differs.

    python -m bench.store_io [--tokens 16384] [--width 20480] [--codecs none,blosc-lz4:5:bitshuffle]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr

from bench import emit
from dflash_pipeline.shared.store.layout import StoreLayout
from dflash_pipeline.shared.store.manifest import mark_complete, new_manifest
from dflash_pipeline.shared.store.progress import finished_shards
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.shared.store.writer import StoreWriter


def _rows(tokens: int, width: int) -> np.ndarray:
    """bf16 bit patterns of N(0, 1) values (what activations roughly look like to a codec)."""
    x = np.random.default_rng(0).standard_normal((tokens, width), dtype=np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def write_store(root: Path, hidden: np.ndarray, codec: str, sample_tokens: int) -> float:
    """Seconds to write `hidden` through StoreWriter (batches of 4 samples) and finalize it."""
    tokens, width = hidden.shape
    writer = StoreWriter(
        root,
        0,
        hidden_width=width,
        hidden_dtype="bfloat16",
        capacity_tokens=tokens,
        capacity_samples=tokens // sample_tokens,
        compression=codec,
        overwrite=True,
    )
    ids, mask = np.zeros(sample_tokens, np.int32), np.ones(sample_tokens, np.uint8)
    t0 = time.perf_counter()
    samples = tokens // sample_tokens
    for b in range(0, samples, 4):
        writer.append_batch(
            [(s, ids, mask, hidden[s * sample_tokens : (s + 1) * sample_tokens]) for s in range(b, min(b + 4, samples))]
        )
    writer.finalize()
    return time.perf_counter() - t0


def zarr_write(root: Path, hidden: np.ndarray, shard_tokens: int) -> float:
    """Seconds for zarr's own path to write the same rows, shard by shard, into a copy of the
    store's hidden_states array (same metadata), and fsync the files (the writer's commits need it)."""
    template = StoreLayout(root).rank_group(0) / "hidden_states"
    copy = root.parent / (root.name + "-zarr")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(template, copy, ignore=shutil.ignore_patterns("c"))
    array = zarr.open_array(copy, mode="r+").with_config({"write_empty_chunks": True})
    t0 = time.perf_counter()
    for start in range(0, len(hidden), shard_tokens):
        array[start : start + shard_tokens] = hidden[start : start + shard_tokens]
    for path in copy.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - t0


def read_spans(root: Path, sample_tokens: int) -> tuple[float, float]:
    """Seconds to read every sample span (FeatureStore, then zarr slicing of the same array)."""
    store = FeatureStore(root)
    spans = [store.sample_span(i)[:3] for i in range(len(store))]
    t0 = time.perf_counter()
    for shard, a, b in spans:
        store.read_raw(shard, a, b)
    ours = time.perf_counter() - t0
    array = zarr.open_array(StoreLayout(root).rank_group(0) / "hidden_states", mode="r")
    t0 = time.perf_counter()
    for _, a, b in spans:
        array[a:b]
    return ours, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--width", type=int, default=20480)
    ap.add_argument("--sample-tokens", type=int, default=1024)
    ap.add_argument("--codecs", default="none,blosc-lz4:5:bitshuffle,zstd:1")
    ap.add_argument("--scratch", type=Path, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="dflash-store-io-"))
    hidden = _rows(args.tokens, args.width)
    gb = hidden.nbytes / 1e9
    result = {"tokens": args.tokens, "width": args.width, "gbytes": gb, "codecs": {}}
    for codec in args.codecs.split(","):
        root = scratch / codec.replace(":", "_")
        shutil.rmtree(root, ignore_errors=True)
        ours_w = write_store(root, hidden, codec, args.sample_tokens)
        target = {
            "name_or_path": "bench",
            "architecture": "bench",
            "config_hash": "bench",
            "num_layers": 1,
            "hidden_size": args.width,
            "layer_ids": [0],
            "vocab_size": 1,
        }
        mark_complete(
            root, new_manifest(target=target, hidden_dtype="bfloat16", world_size=1), shards=finished_shards(root, 1)[0]
        )
        shard_tokens = FeatureStore(root).manifest.shard_tokens
        zarr_w = zarr_write(root, hidden, shard_tokens)
        ours_r, zarr_r = read_spans(root, args.sample_tokens)
        stored = sum(
            f.stat().st_size for f in (StoreLayout(root).rank_group(0) / "hidden_states").rglob("*") if f.is_file()
        )
        row = {
            "ratio": hidden.nbytes / stored,
            "write_gbps": gb / ours_w,
            "zarr_write_gbps": gb / zarr_w,
            "write_speedup": zarr_w / ours_w,
            "read_gbps": gb / ours_r,
            "zarr_read_gbps": gb / zarr_r,
            "read_speedup": zarr_r / ours_r,
        }
        result["codecs"][codec] = row
        print(
            f"{codec:>24}: ratio {row['ratio']:.3f}  write {row['write_gbps']:.2f} GB/s vs zarr "
            f"{row['zarr_write_gbps']:.2f} ({row['write_speedup']:.2f}x)  read {row['read_gbps']:.2f} GB/s vs "
            f"zarr {row['zarr_read_gbps']:.2f} ({row['read_speedup']:.2f}x)",
            flush=True,
        )
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(root.parent / (root.name + "-zarr"), ignore_errors=True)
    emit(result, args.json)


if __name__ == "__main__":
    main()
