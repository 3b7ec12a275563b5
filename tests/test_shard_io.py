"""shard_io writes exactly zarr's bytes and reads what zarr wrote; corruption is caught, not returned."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zarr
import zarr.codecs

from dflash_pipeline.shared.store.codec import parse_compression
from dflash_pipeline.shared.store.shard_io import ShardedArrayReader, ShardFormat, ShardFormatError, write_shards

CODECS = ["none", "zstd:1", "blosc-lz4:5:bitshuffle"]
ROWS, WIDTH, CHUNK, SHARD = 600, 24, 64, 256  # last shard: 88 rows = one whole chunk, one partial, two absent


def make_array(path, spec: str, crc: bool, shape=(ROWS, WIDTH)) -> zarr.Array:
    codecs = parse_compression(spec) + ([zarr.codecs.Crc32cCodec()] if crc else [])
    chunks, shards = (CHUNK,) + shape[1:], (SHARD,) + shape[1:]
    group = zarr.open_group(path, mode="w")
    array = group.create_array(
        "a", shape=shape, dtype="uint16", chunks=chunks, shards=shards, compressors=codecs, fill_value=0
    )
    return array.with_config({"write_empty_chunks": True})


def rows(shape=(ROWS, WIDTH)) -> np.ndarray:
    x = np.random.default_rng(0).integers(0, 2**16, shape, dtype=np.uint16)
    x[..., : shape[-1] // 2] = 7  # a compressible part, so compressed chunks differ in size
    return x


@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("spec", CODECS)
def test_shards_are_byte_identical_to_zarrs(tmp_path, spec, crc):
    x = rows()
    make_array(tmp_path / "zarr", spec, crc)[:] = x
    make_array(tmp_path / "ours", spec, crc)
    theirs, ours = ShardFormat.of(tmp_path / "zarr" / "a"), ShardFormat.of(tmp_path / "ours" / "a")
    with ThreadPoolExecutor(2) as pool:
        write_shards([(ours, k, x[k * SHARD : (k + 1) * SHARD]) for k in range(-(-ROWS // SHARD))], pool)
    for k in range(-(-ROWS // SHARD)):
        assert ours.shard_path(k).read_bytes() == theirs.shard_path(k).read_bytes(), f"shard {k}"
    assert np.array_equal(zarr.open_array(tmp_path / "ours" / "a", mode="r")[:], x)  # zarr reads ours


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("spec", CODECS)
def test_ranged_reads_of_zarr_written_shards(tmp_path, spec, crc):
    """Partial and whole chunks (uncompressed whole chunks take the scatter-read path)."""
    x = rows()
    make_array(tmp_path, spec, crc)[:] = x
    reader = ShardedArrayReader(tmp_path / "a", max_open=1)  # reopening files on every shard change
    for start, stop in [(0, ROWS), (5, 70), (64, 128), (250, 600), (599, 600), (300, 300), (100, 130)]:
        assert np.array_equal(reader.read(start, stop), x[start:stop]), (start, stop)
    out = np.empty((200, WIDTH), np.uint16)
    assert reader.read(200, 400, out) is out and np.array_equal(out, x[200:400])
    with pytest.raises(ValueError, match="C-contiguous"):
        reader.read(0, 10, np.empty((10, 2 * WIDTH), np.uint16)[:, :WIDTH])
    reader.close()


def test_one_dimensional_arrays(tmp_path):
    x = rows((ROWS,))
    make_array(tmp_path, "blosc-lz4:5:bitshuffle", True, shape=(ROWS,))[:] = x
    assert np.array_equal(ShardedArrayReader(tmp_path / "a").read(10, 590), x[10:590])


@pytest.mark.parametrize("spec, where", [("zstd:1", "chunk"), ("zstd:1", "index"), ("none", "chunk")])
def test_corruption_is_an_error_naming_the_file(tmp_path, spec, where):
    make_array(tmp_path, spec, True)[:] = rows()
    fmt = ShardFormat.of(tmp_path / "a")
    path = fmt.shard_path(1)
    data = bytearray(path.read_bytes())
    data[10 if where == "chunk" else -8] ^= 0xFF
    path.write_bytes(bytes(data))
    reader = ShardedArrayReader(tmp_path / "a")
    assert np.array_equal(reader.read(0, 256), rows()[:256])  # other shards still read
    for start, stop in [(256, 300), (256, 320)]:  # part of the corrupt chunk, and all of it
        with pytest.raises(ShardFormatError, match=f"{path}.*crc32c mismatch"):
            reader.read(start, stop)


def test_missing_and_truncated_shards_are_errors(tmp_path):
    make_array(tmp_path, "none", True)[:] = rows()
    fmt = ShardFormat.of(tmp_path / "a")
    os.remove(fmt.shard_path(0))
    fmt.shard_path(1).write_bytes(b"\0" * 10)
    reader = ShardedArrayReader(tmp_path / "a")
    with pytest.raises(ShardFormatError, match="shard file missing"):
        reader.read(0, 10)
    with pytest.raises(ShardFormatError, match="shorter than its index"):
        reader.read(256, 260)


def test_unsupported_layouts_are_refused(tmp_path):
    group = zarr.open_group(tmp_path, mode="w")
    group.create_array("unsharded", shape=(10, 4), dtype="uint16", chunks=(5, 4))
    group.create_array("split", shape=(64, 8), dtype="uint16", chunks=(8, 4), shards=(16, 8))
    with pytest.raises(ShardFormatError, match="single sharding codec"):
        ShardFormat.of(tmp_path / "unsharded")
    with pytest.raises(ShardFormatError, match="span all but the first axis"):
        ShardFormat.of(tmp_path / "split")
