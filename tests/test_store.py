"""Feature store: bit-exact round-trips, shard-boundary handling, the reader API, and crash safety.

Crash tests fork a child that writes the store and SIGKILL it (at random moments and at precise
points of the commit protocol), resume in a fresh child, and require the result to equal an
uninterrupted run bit for bit. Fork keeps a child's start in milliseconds (spawn would re-import
torch for each of the dozens of kills); the kill itself is a real SIGKILL of a separate process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from dflash_pipeline.shared.store.codec import parse_compression
from dflash_pipeline.shared.store.manifest import (
    StoreError,
    StoreIncomplete,
    StoreMismatch,
    mark_complete,
    new_manifest,
    write_manifest,
)
from dflash_pipeline.shared.store.progress import finished_shards
from dflash_pipeline.shared.store.reader import FeatureStore, stores_equal
from dflash_pipeline.shared.store.writer import StoreWriter

W = 12  # hidden width: 2 layers x hidden 6
LAYOUT = dict(hidden_width=W, capacity_tokens=4000, capacity_samples=400, chunk_tokens=8, shard_tokens=32)
FORK = mp.get_context("fork")


def make_batch(seed: int, b: int, dtype: str = "bfloat16") -> list[tuple]:
    """Batch b of a deterministic stream: 1-4 samples of 1-40 tokens, hidden = random bit patterns
    (NaN and inf encodings included), bf16 as a torch tensor, other dtypes as numpy."""
    rng = np.random.default_rng([seed, b])
    batch = []
    for k in range(int(rng.integers(1, 5))):
        n = int(rng.integers(1, 41))
        ids = rng.integers(0, 50_000, n).astype(np.int32)
        mask = rng.integers(0, 2, n).astype(np.uint8)
        if dtype == "bfloat16":
            hidden = torch.from_numpy(rng.integers(0, 1 << 16, (n, W), dtype=np.uint16)).view(torch.bfloat16)
        else:
            bits = np.dtype(dtype).itemsize * 8
            hidden = rng.integers(0, 1 << bits, (n, W), dtype=f"uint{bits}").view(dtype)
        batch.append((b * 10 + k, ids, mask, hidden))
    return batch


def write_store(
    root: Path, seed: int, n_batches: int, *, dtype: str = "bfloat16", compression: str = "zstd:1", **layout
) -> None:
    layout = {**LAYOUT, **layout}
    writer = StoreWriter(root, 0, hidden_dtype=dtype, compression=compression, **layout)
    for b in range(writer.resume(), n_batches):
        writer.append_batch(make_batch(seed, b, dtype))
    writer.finalize()


def write_manifest_for(
    root: Path, *, complete: bool, dtype: str = "bfloat16", world_size: int = 1, store_topk: int = 0
) -> None:
    m = new_manifest(
        target={
            "name_or_path": "tiny",
            "architecture": "Qwen3ForCausalLM",
            "config_hash": "abc123",
            "num_layers": 4,
            "hidden_size": 6,
            "layer_ids": [1, 2],
            "vocab_size": 50_000,
        },
        hidden_dtype=dtype,
        world_size=world_size,
        store_topk=store_topk,
    )
    if complete:
        mark_complete(root, m, shards=finished_shards(root, world_size)[0])
    else:
        write_manifest(root, m)


def expected_samples(seed: int, n_batches: int, dtype: str = "bfloat16") -> list[tuple]:
    return [s for b in range(n_batches) for s in make_batch(seed, b, dtype)]


def bits(x) -> np.ndarray:
    a = x.view(torch.uint16).numpy() if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 else np.asarray(x)
    return a.view(f"u{a.dtype.itemsize}")


def assert_store_holds(store: FeatureStore, samples: list[tuple]) -> None:
    assert len(store) == len(samples)
    for i, (index, ids, mask, hidden) in enumerate(samples):
        got = store[i]
        assert got.sample_index == index
        assert got.input_ids.dtype == torch.int64 and np.array_equal(got.input_ids.numpy(), ids)
        assert got.loss_mask.dtype == torch.bool and np.array_equal(got.loss_mask.numpy(), mask.astype(bool))
        assert np.array_equal(bits(got.hidden_states), bits(hidden))


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize(
    "dtype,compression",
    [
        ("bfloat16", "zstd:1"),
        ("bfloat16", "none"),
        ("bfloat16", "blosc-zstd:1:shuffle"),
        ("float32", "zstd:3"),
        ("float16", "blosc-lz4:5:bitshuffle"),
    ],
)
def test_round_trip_is_bit_exact_across_shard_boundaries(tmp_path, dtype, compression):
    write_store(tmp_path, seed=1, n_batches=12, dtype=dtype, compression=compression)
    write_manifest_for(tmp_path, complete=True, dtype=dtype)
    store = FeatureStore(tmp_path)
    assert store.manifest.compression == compression and store.manifest.shard_tokens == LAYOUT["shard_tokens"]
    assert store.hidden_width == W and store.hidden_dtype == getattr(torch, dtype) and store.layer_ids == [1, 2]
    samples = expected_samples(1, 12, dtype)
    assert store.num_tokens == sum(len(s[1]) for s in samples) > 4 * LAYOUT["shard_tokens"]
    assert store.lengths.tolist() == [len(s[1]) for s in samples]
    assert_store_holds(store, samples)
    if dtype == "bfloat16":
        assert store[0].hidden_states.dtype == torch.bfloat16


def test_write_streams_change_nothing_on_disk_and_may_differ_on_resume(tmp_path):
    """The number of write threads is not part of the layout: stores written with 1 and 5 are equal
    bit for bit, and a store begun with 5 resumes with 1."""
    write_store(tmp_path / "one", seed=13, n_batches=20, write_streams=1)
    first = StoreWriter(tmp_path / "mixed", 0, hidden_dtype="bfloat16", compression="zstd:1", write_streams=5, **LAYOUT)
    for b in range(12):
        first.append_batch(make_batch(13, b))
    first.flush_shards()
    assert first.committed.batches > 0
    del first  # abandoned without finalize, as after a crash
    write_store(tmp_path / "mixed", seed=13, n_batches=20, write_streams=1)
    for name in ("one", "mixed"):
        write_manifest_for(tmp_path / name, complete=True)
    assert stores_equal(tmp_path / "one", tmp_path / "mixed")
    assert_store_holds(FeatureStore(tmp_path / "one"), expected_samples(13, 20))


def test_arrays_are_trimmed_sharded_and_readable_with_plain_zarr(tmp_path):
    write_store(tmp_path, seed=2, n_batches=20)
    samples = expected_samples(2, 20)
    group = zarr.open_group(tmp_path / "shards/rank-00000.zarr", mode="r")
    total = sum(len(s[1]) for s in samples)
    hidden = group["hidden_states"]
    assert hidden.shape == (total, W) and hidden.dtype == np.uint16 and hidden.attrs["logical_dtype"] == "bfloat16"
    assert hidden.chunks == (8, W) and hidden.shards == (32, W)
    assert group["input_ids"].shape == group["loss_mask"].shape == (total,)
    offsets = group["sample_offsets"][:]
    assert offsets.tolist() == np.cumsum([0] + [len(s[1]) for s in samples]).tolist()
    assert group["sample_index"][:].tolist() == [s[0] for s in samples]
    j = len(samples) // 2
    row = torch.from_numpy(hidden[offsets[j] : offsets[j + 1]]).view(torch.bfloat16)
    assert np.array_equal(bits(row), bits(samples[j][3]))
    # one file per shard, none per sample; nothing left beyond the last shard
    assert len(list((tmp_path / "shards/rank-00000.zarr/hidden_states/c").iterdir())) == -(-total // 32)


def test_writer_copies_what_it_is_given(tmp_path):
    """The extractor hands over views of reusable host buffers; overwriting them later must not matter."""
    w = StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", **LAYOUT)
    batches = [make_batch(10, b) for b in range(6)]
    originals = [[(i, ids.copy(), mask.copy(), hidden.clone()) for i, ids, mask, hidden in batch] for batch in batches]
    for batch in batches:
        w.append_batch(batch)
        for _, ids, mask, hidden in batch:
            ids[:] = -1
            mask[:] = 0
            hidden.zero_()
    w.finalize()
    write_manifest_for(tmp_path, complete=True)
    assert_store_holds(FeatureStore(tmp_path), [s for batch in originals for s in batch])


def _gated_shard_writes(writer: StoreWriter, gates: dict[int, threading.Event], fail: set[int] = frozenset()):
    """Make shard k's write wait for gates[k] (if any) and raise for k in `fail`; returns the shard
    numbers in the order their writes finished."""
    original, finished = writer._write_shard, []

    def write(shard):
        k = shard.start // writer.shard_tokens
        if k in gates:
            assert gates[k].wait(30)
        if k in fail:
            raise OSError(28, f"No space left on device (shard {k})")
        original(shard)
        finished.append(k)

    writer._write_shard = write
    return finished


def _shard_end_batches(seed: int, n_batches: int, shard_tokens: int) -> list[int]:
    """For each shard boundary, how many of the first batches end at or before it."""
    ends = np.cumsum([sum(len(s[1]) for s in make_batch(seed, b)) for b in range(n_batches)])
    return [
        int(np.searchsorted(ends, k * shard_tokens, side="right")) for k in range(1, int(ends[-1]) // shard_tokens + 1)
    ]


def test_shards_finishing_out_of_order_commit_only_the_durable_prefix(tmp_path):
    w = StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", write_streams=3, **LAYOUT)
    gate = threading.Event()
    finished = _gated_shard_writes(w, {0: gate})
    ends = np.cumsum([sum(len(s[1]) for s in make_batch(11, b)) for b in range(40)])
    n_batches = int(np.searchsorted(ends, 4 * LAYOUT["shard_tokens"]))  # fills shards 0-2: one per stream
    assert ends[n_batches - 1] >= 3 * LAYOUT["shard_tokens"]
    for b in range(n_batches):
        w.append_batch(make_batch(11, b))
    deadline = time.monotonic() + 30
    while len(finished) < 2 and time.monotonic() < deadline:  # shards 1 and 2 land while 0 waits
        time.sleep(0.01)
    assert sorted(finished) == [1, 2]
    w._collect(keep=3)
    assert w.committed.batches == 0 and w.committed.tokens == 0  # shard 0 is not durable yet
    gate.set()
    w.flush_shards()
    assert w.committed.batches == _shard_end_batches(11, n_batches, LAYOUT["shard_tokens"])[len(finished) - 1]
    w.finalize()
    write_manifest_for(tmp_path, complete=True)
    assert_store_holds(FeatureStore(tmp_path), expected_samples(11, n_batches))


def test_a_failed_shard_write_stops_the_commit_point_there(tmp_path):
    w = StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", write_streams=3, **LAYOUT)
    _gated_shard_writes(w, {}, fail={1})
    with pytest.raises(OSError, match=r"No space left on device \(shard 1\)"):
        for b in range(40):
            w.append_batch(make_batch(12, b))
        w.flush_shards()
    time.sleep(0.2)  # later shards' writes may still land on disk...
    assert w.committed.batches == _shard_end_batches(12, 40, LAYOUT["shard_tokens"])[0]  # ...only shard 0 counts
    for call in (lambda: w.append_batch(make_batch(12, 40)), w.flush_shards, w.finalize):
        with pytest.raises(StoreError, match="an earlier shard write failed"):
            call()
    with pytest.raises(StoreIncomplete, match="ranks 0 have not finished"):  # nothing marked done
        finished_shards(tmp_path, 1)


def test_mark_complete_checks_the_ranks(tmp_path):
    w = StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", **LAYOUT)
    w.append_batch(make_batch(0, 0))
    m = new_manifest(
        target={
            "name_or_path": "t",
            "architecture": "A",
            "config_hash": "h",
            "num_layers": 4,
            "hidden_size": 6,
            "layer_ids": [1, 2],
            "vocab_size": 9,
        },
        hidden_dtype="bfloat16",
        world_size=1,
    )
    with pytest.raises(StoreIncomplete, match="ranks 0 have not finished"):
        mark_complete(tmp_path, m, shards=[])
    entry = w.finalize()
    with pytest.raises(StoreError, match="disagrees with the ranks' progress records"):
        mark_complete(
            tmp_path, m, shards=[{"rank": 0, "path": entry.path, "samples": entry.samples + 1, "tokens": entry.tokens}]
        )
    mark_complete(tmp_path, m, shards=[entry], weights_fingerprint="w", counts={"samples": entry.samples})
    store = FeatureStore(tmp_path)
    assert store.manifest.target["weights_fingerprint"] == "w" and store.manifest.data["counts"] == {
        "samples": entry.samples
    }
    assert len(store) == entry.samples


def test_read_tokens_spans_samples(tmp_path):
    write_store(tmp_path, seed=3, n_batches=10)
    write_manifest_for(tmp_path, complete=True)
    store = FeatureStore(tmp_path)
    samples = expected_samples(3, 10)
    ids, mask, hidden = store.read_tokens(0, 8, 72)
    assert np.array_equal(ids.numpy(), np.concatenate([s[1] for s in samples])[8:72])
    assert np.array_equal(mask.numpy(), np.concatenate([s[2] for s in samples])[8:72].astype(bool))
    assert np.array_equal(bits(hidden), np.concatenate([bits(s[3]) for s in samples])[8:72])
    with pytest.raises(IndexError, match="outside shard 0"):
        store.read_tokens(0, 0, store.num_tokens + 1)


def test_two_ranks_read_in_rank_order(tmp_path):
    for rank, seed in ((0, 4), (1, 5)):
        w = StoreWriter(tmp_path, rank, hidden_dtype="bfloat16", **LAYOUT)
        for b in range(6):
            w.append_batch(make_batch(seed, b))
        w.finalize()
    write_manifest_for(tmp_path, complete=True, world_size=2)
    assert_store_holds(FeatureStore(tmp_path), expected_samples(4, 6) + expected_samples(5, 6))


def test_empty_rank_and_capacity_limits(tmp_path):
    entry = StoreWriter(
        tmp_path, 0, hidden_dtype="bfloat16", **{**LAYOUT, "capacity_tokens": 0, "capacity_samples": 0}
    ).finalize()
    assert (entry.samples, entry.tokens) == (0, 0)
    write_manifest_for(tmp_path, complete=True)
    assert len(FeatureStore(tmp_path)) == 0
    w = StoreWriter(tmp_path / "small", 0, hidden_dtype="bfloat16", **{**LAYOUT, "capacity_tokens": 30})
    with pytest.raises(StoreError, match="exceeds the capacity"):
        for b in range(10):
            w.append_batch(make_batch(0, b))


def test_bad_samples_are_refused_with_the_sample_named(tmp_path):
    w = StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", **LAYOUT)
    index, ids, mask, hidden = make_batch(0, 0)[0]
    cases = [
        ((7, ids, mask, hidden.float()), "sample 7: hidden must be a CPU bfloat16 tensor"),
        ((7, ids, mask, hidden[:, :5]), "sample 7: hidden has shape"),
        ((7, ids[:0], mask[:0], hidden[:0]), "sample 7: input_ids must be a non-empty"),
        ((7, ids, mask[:-1], hidden), "sample 7: loss_mask must be 0/1"),
        ((7, ids, mask + 2, hidden), "sample 7: loss_mask must be 0/1"),
        ((7, ids.astype(np.float32), mask, hidden), "sample 7: input_ids must be"),
    ]
    for sample, message in cases:
        with pytest.raises(ValueError, match=message):
            w.append_batch([make_batch(0, 1)[0], sample])
    assert w.committed.batches == 0 and w.finalize().samples == 0  # refused batches left no trace


def test_parse_compression():
    assert parse_compression("none") == []
    assert parse_compression("zstd:3")[0].level == 3
    assert parse_compression("blosc-zstd:1:shuffle")[0].shuffle.value == "shuffle"
    for bad in ("gzip", "zstd", "zstd:x", "blosc-zstd:1", "blosc-foo:1:shuffle", "blosc-lz4:1:sideways"):
        with pytest.raises(ValueError, match="expected 'none'"):
            parse_compression(bad)


# ------------------------------------------------------------------ reader


def test_incomplete_store_is_refused_unless_asked(tmp_path):
    w = StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", **LAYOUT)
    for b in range(8):
        w.append_batch(make_batch(6, b))
    w.flush_shards()  # the full shards' writes are done and committed
    write_manifest_for(tmp_path, complete=False)
    with pytest.raises(StoreIncomplete, match=f"{tmp_path}: store is incomplete"):
        FeatureStore(tmp_path)
    with pytest.raises(StoreIncomplete, match="ranks 0 have not finished"):
        finished_shards(tmp_path, 1)
    partial = FeatureStore(tmp_path, require_complete=False)  # the committed prefix only
    c = w.committed
    assert 0 < c.batches < 8 and len(partial) == c.samples and partial.num_tokens == c.tokens
    assert_store_holds(partial, expected_samples(6, c.batches))


def test_reader_pickles_and_feeds_a_two_worker_dataloader(tmp_path):
    write_store(tmp_path, seed=7, n_batches=12)
    write_manifest_for(tmp_path, complete=True)
    store = FeatureStore(tmp_path)
    store[0]  # open the shard files in this process: they must not travel in the pickle
    clone = pickle.loads(pickle.dumps(store))
    assert clone._readers is None and stores_equal(store, clone)
    loader = torch.utils.data.DataLoader(store, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    samples = expected_samples(7, 12)
    got = list(loader)
    assert [s.sample_index for s in got] == [s[0] for s in samples]
    assert all(np.array_equal(bits(g.hidden_states), bits(s[3])) for g, s in zip(got, samples))


def test_stores_equal_sees_a_single_flipped_bit(tmp_path):
    for name in ("a", "b"):
        write_store(tmp_path / name, seed=8, n_batches=6)
        write_manifest_for(tmp_path / name, complete=True)
    assert stores_equal(tmp_path / "a", tmp_path / "b")
    hidden = zarr.open_group(tmp_path / "b/shards/rank-00000.zarr", mode="r+")["hidden_states"]
    row = hidden[5:6]
    row[0, 3] ^= 1
    hidden[5:6] = row
    assert not stores_equal(tmp_path / "a", tmp_path / "b")


def test_reopening_with_other_settings_is_a_mismatch(tmp_path):
    w = StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", **LAYOUT)
    w.append_batch(make_batch(0, 0))
    with pytest.raises(
        StoreMismatch,
        match=r"rank-00000.zarr: existing rank store was started with other settings \(compression, shard_tokens\)",
    ):
        StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", compression="none", **{**LAYOUT, "shard_tokens": 64})


# ------------------------------------------------------------------ crash safety

N_CRASH_BATCHES = 16


def _child(root: str, kill_point: str | None, nth: int) -> None:
    """Write (or resume) the store; SIGKILL ourselves at the nth hit of `kill_point`."""
    if kill_point is not None:
        _arm(kill_point, nth, Path(root))
    write_store(Path(root), seed=9, n_batches=N_CRASH_BATCHES, chunk_tokens=16, shard_tokens=64)
    os._exit(0)


def _arm(point: str, nth: int, root: Path) -> None:
    from dflash_pipeline.shared.runtime import durable
    from dflash_pipeline.shared.store import shard_io, writer

    hits = [0]

    def hit() -> None:
        hits[0] += 1
        if hits[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)

    def before(obj, name, when=lambda *a, **k: True):
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            if when(*args, **kwargs):
                hit()
            return original(*args, **kwargs)

        setattr(obj, name, wrapped)

    W_ = writer.StoreWriter
    if point == "after-shards-before-offsets":
        before(W_, "_write_sample_arrays")
    elif point == "before-progress":
        before(W_, "_write_progress")
    elif point == "mid-progress":  # temp record written, rename never happens
        before(durable.os, "replace", lambda src, dst: str(dst).endswith("progress.json"))
    elif point == "mid-shard-write":  # a torn temp file, as if killed inside a shard file's write
        original_writev = shard_io._writev_all

        def torn(fd, pieces):
            hits[0] += 1
            if hits[0] == nth:
                data = b"".join(bytes(p) for p in pieces)
                os.write(fd, data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            return original_writev(fd, pieces)

        shard_io._writev_all = torn
    elif point == "finalize-after-trim":  # arrays trimmed, last partial shard not yet written
        before(W_, "_write_shard", lambda self, shard: not shard.full)
    elif point == "finalize-before-done":
        before(W_, "_write_progress", lambda self: self._commit.done)
    elif point == "after-finalize":
        before(os, "_exit")
    else:
        raise AssertionError(point)


def _run_child(root: Path, kill_point: str | None = None, nth: int = 0, kill_after: float | None = None) -> int:
    proc = FORK.Process(target=_child, args=(str(root), kill_point, nth))
    proc.start()
    if kill_after is not None:
        proc.join(kill_after)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    return proc.exitcode


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    start = time.perf_counter()
    assert _run_child(root) == 0
    write_manifest_for(root, complete=True)
    return root, time.perf_counter() - start


def _finish_and_compare(root: Path, reference_root: Path) -> None:
    assert _run_child(root) == 0
    write_manifest_for(root, complete=True)
    assert stores_equal(root, reference_root)
    assert not list(root.rglob("*.partial")) and not list(root.rglob("*.tmp"))


def _assert_commit_is_a_true_prefix(root: Path, reference_root: Path) -> None:
    """Whatever the progress record claims after a kill is really on disk, bit for bit."""
    if not (root / "shards/rank-00000.progress.json").exists():
        return
    write_manifest_for(root, complete=False)
    partial, full = FeatureStore(root, require_complete=False), FeatureStore(reference_root)
    n, t = len(partial), partial.num_tokens
    assert np.array_equal(partial.lengths, full.lengths[:n])
    assert [partial.sample_span(i)[3] for i in range(n)] == [full.sample_span(i)[3] for i in range(n)]
    assert all(np.array_equal(x, y) for x, y in zip(partial.read_raw(0, 0, t), full.read_raw(0, 0, t)))


@pytest.mark.parametrize(
    "point,nth",
    [
        ("after-shards-before-offsets", 3),
        ("before-progress", 1),  # 1st: group made, no record yet
        ("before-progress", 4),
        ("mid-progress", 3),
        ("mid-shard-write", 5),
        ("finalize-after-trim", 1),
        ("finalize-before-done", 1),
        ("after-finalize", 1),
    ],
)
def test_kill_at_a_precise_point_then_resume(tmp_path, reference, point, nth):
    assert _run_child(tmp_path, point, nth) == -signal.SIGKILL  # the point was reached
    _assert_commit_is_a_true_prefix(tmp_path, reference[0])
    _finish_and_compare(tmp_path, reference[0])


@pytest.mark.parametrize("seed", range(5))
def test_kill_at_random_moments_then_resume(tmp_path, reference, seed):
    rng = np.random.default_rng(seed)
    _, duration = reference
    for _ in range(3):
        code = _run_child(tmp_path, kill_after=float(rng.uniform(0.0, 1.2 * duration)))
        _assert_commit_is_a_true_prefix(tmp_path, reference[0])
        if code == 0:
            break
    _finish_and_compare(tmp_path, reference[0])
