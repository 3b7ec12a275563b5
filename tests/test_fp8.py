"""fp8 feature storage (`--store-dtype float8_e4m3fn`, docs/FORMAT.md): the quantization's error bound,
the store's round trip (codes and scales bit-exact), checksums, a killed extraction that resumes, and
training on CPU that follows the bf16 store's losses."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from test_extract_resume import command, run_until_killed
from test_store import LAYOUT, W, write_manifest_for
from test_train import base_config, losses

from dflash_pipeline.shared.store.codec import DEFAULT_COMPRESSION
from dflash_pipeline.shared.store.fp8 import FP8, FP8_MAX, dequantize, quantize
from dflash_pipeline.shared.store.manifest import Manifest, ManifestError, load_manifest
from dflash_pipeline.shared.store.reader import FeatureStore, stores_equal
from dflash_pipeline.shared.store.shard_io import ShardFormatError
from dflash_pipeline.shared.store.writer import StoreWriter
from dflash_pipeline.train.dataset import PackSpec, build_batch
from dflash_pipeline.train.packing import plan_packs
from dflash_pipeline.train.run import run_training
from dflash_pipeline.train.step import context_states

GROUPS = 2  # W = 2 layers x 6, as test_store's stores


def states(n: int, seed: int) -> torch.Tensor:
    """bf16 states [n, W] whose layers and tokens differ by orders of magnitude, with an all-zero
    (token, layer) row, values deep in e4m3's subnormal range next to large ones, and outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, W, generator=g) * torch.logspace(-4, 3, n)[:, None]
    x[:, : W // GROUPS] *= 1e-3
    x[0, : W // GROUPS] = 0
    x[-1, 0] = 5e4  # an outlier: every other value of its row is tiny next to it
    return x.to(torch.bfloat16)


def error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step at |x|: 2^-4 relative for normal codes, 2^-10 x scale for subnormal ones."""
    per_element = scales.repeat_interleave(x.shape[-1] // scales.shape[-1], dim=-1)
    return torch.maximum(x.float().abs() * 2**-4, per_element * 2**-10)


def test_quantize_scales_are_row_amax_over_448_and_errors_within_half_an_e4m3_step():
    x = states(64, 0)
    codes, scales = quantize(x, GROUPS)
    assert codes.dtype == FP8 and codes.shape == x.shape and scales.dtype == torch.float32
    amax = x.float().abs().view(64, GROUPS, -1).amax(-1)
    assert torch.equal(scales, amax / FP8_MAX)
    assert scales[0, 0] == 0 and not codes[0, : W // GROUPS].float().any()
    deq = dequantize(codes, scales, torch.float32)
    assert (codes.float().abs().view(64, GROUPS, -1).amax(-1) == FP8_MAX).logical_or(amax == 0).all()
    assert ((x.float() - deq).abs() <= error_bound(x, scales)).all()
    # in bf16 the one more rounding adds at most half a bf16 step
    deq16 = dequantize(codes, scales, torch.bfloat16).float()
    assert ((x.float() - deq16).abs() <= error_bound(x, scales) + deq.abs() * 2**-9).all()


def fp8_batch(seed: int, b: int) -> list[tuple]:
    """Batch b of a deterministic stream, as an fp8 extractor hands it to the writer."""
    rng = np.random.default_rng([seed, b])
    batch = []
    for k in range(int(rng.integers(1, 5))):
        n = int(rng.integers(1, 41))
        codes, scales = quantize(states(n, seed * 1000 + b * 10 + k), GROUPS)
        batch.append(
            (
                b * 10 + k,
                rng.integers(0, 50_000, n).astype(np.int32),
                rng.integers(0, 2, n).astype(np.uint8),
                codes,
                scales,
            )
        )
    return batch


def write_fp8_store(root: Path, seed: int, n_batches: int, compression: str = "blosc-lz4:5:bitshuffle") -> None:
    writer = StoreWriter(root, 0, hidden_dtype="float8_e4m3fn", compression=compression, scale_groups=GROUPS, **LAYOUT)
    for b in range(writer.resume(), n_batches):
        writer.append_batch(fp8_batch(seed, b))
    writer.finalize()
    write_manifest_for(root, complete=True, dtype="float8_e4m3fn")


@pytest.mark.parametrize("compression", ["none", "blosc-lz4:5:bitshuffle", "zstd:1"])
def test_store_round_trip_keeps_codes_and_scales_bit_exact_across_shards(tmp_path, compression):
    write_fp8_store(tmp_path, 1, 12, compression)
    store = FeatureStore(tmp_path)
    samples = [s for b in range(12) for s in fp8_batch(1, b)]
    assert store.num_tokens > 4 * LAYOUT["shard_tokens"] and len(store) == len(samples)
    assert store.hidden_dtype == FP8 and store.scale_groups == GROUPS
    for i, (index, ids, _, codes, scales) in enumerate(samples):
        got = store[i]
        assert got.sample_index == index and np.array_equal(got.input_ids.numpy(), ids)
        assert torch.equal(got.hidden_states.view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(got.hidden_scales, scales)
    # the format as docs/FORMAT.md gives it, read with plain json and zarr
    raw = json.loads((tmp_path / "manifest.json").read_text())
    assert (raw["format_version"], raw["hidden_dtype"], raw["storage_dtype"]) == (2, "float8_e4m3fn", "uint8")
    group = zarr.open_group(tmp_path / "shards/rank-00000.zarr", mode="r")
    assert group.attrs["format_version"] == 2
    assert group["hidden_states"].dtype == np.uint8 and group["hidden_scales"].dtype == np.float32
    assert group["hidden_scales"].shape == (store.num_tokens, GROUPS)
    first = samples[0]
    n = len(first[1])
    assert np.array_equal(group["hidden_states"][:n], first[3].view(torch.uint8).numpy())
    assert np.array_equal(group["hidden_scales"][:n], first[4].numpy())


def test_a_flipped_bit_in_the_scales_is_a_crc_error_and_a_difference(tmp_path):
    for name in ("a", "b"):
        write_fp8_store(tmp_path / name, 2, 6, "none")
    assert stores_equal(tmp_path / "a", tmp_path / "b")
    shard = tmp_path / "b/shards/rank-00000.zarr/hidden_scales/c/1/0"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x10
    shard.write_bytes(bytes(data))
    store = FeatureStore(tmp_path / "b")
    with pytest.raises(ShardFormatError, match=r"hidden_scales/c/1/0 chunk 0: crc32c mismatch \(corrupt shard\)"):
        store.read_scales(0, LAYOUT["shard_tokens"], LAYOUT["shard_tokens"] + 1)
    with pytest.raises(ShardFormatError, match="crc32c mismatch"):
        stores_equal(tmp_path / "a", tmp_path / "b")


def test_the_version_says_whether_a_store_holds_scales():
    target = dict(name_or_path="t", architecture="A", config_hash="h", num_layers=2, hidden_size=6, layer_ids=[0, 1])
    target["vocab_size"] = 10
    with pytest.raises(ManifestError, match="format_version 1 does not hold hidden_dtype 'float8_e4m3fn'"):
        Manifest(target=target, hidden_dtype="float8_e4m3fn", world_size=1, format_version=1)
    with pytest.raises(ManifestError, match="format_version 2 does not hold hidden_dtype 'bfloat16'"):
        Manifest(target=target, hidden_dtype="bfloat16", world_size=1, format_version=2)
    assert Manifest(target=target, hidden_dtype="bfloat16", world_size=1).to_dict()["format_version"] == 1


def test_fp8_stores_are_uncompressed_by_default(tmp_path):
    """Measured on real states (codec.FP8_DEFAULT_COMPRESSION): codecs barely shrink e4m3 codes and
    would cost the loader a decode; bf16 keeps its default."""
    assert (
        StoreWriter(tmp_path / "a", 0, hidden_dtype="bfloat16", **LAYOUT).layout["compression"] == DEFAULT_COMPRESSION
    )
    fp8 = StoreWriter(tmp_path / "b", 0, hidden_dtype="float8_e4m3fn", scale_groups=GROUPS, **LAYOUT)
    assert fp8.layout["compression"] == "none"


def test_writer_wants_scales_exactly_for_fp8(tmp_path):
    with pytest.raises(ValueError, match="scale_groups 0: a float8_e4m3fn store takes a divisor of the width 12"):
        StoreWriter(tmp_path, 0, hidden_dtype="float8_e4m3fn", **LAYOUT)
    with pytest.raises(ValueError, match="scale_groups 2: a bfloat16 store takes none"):
        StoreWriter(tmp_path, 0, hidden_dtype="bfloat16", scale_groups=2, **LAYOUT)
    writer = StoreWriter(tmp_path, 0, hidden_dtype="float8_e4m3fn", scale_groups=GROUPS, **LAYOUT)
    index, ids, mask, codes, scales = fp8_batch(0, 0)[0]
    with pytest.raises(ValueError, match="sample 0: a float8_e4m3fn store takes 4 arrays a sample"):
        writer.append_batch([(index, ids, mask, codes)])
    with pytest.raises(ValueError, match=r"scales must be float32 of shape \(\d+, 2\), got float64"):
        writer.append_batch([(index, ids, mask, codes, scales.double())])


# ------------------------------------------------------------------ end to end on the tiny target

# uncompressed, so the bytes are the format's; small chunks, so padding the last one costs little
SMALL = dict(compression="none", chunk_tokens=32, shard_tokens=256)


@pytest.fixture(scope="module")
def stores(extract_cpu_store, small_corpus, tmp_path_factory) -> dict[str, Path]:
    """The same corpus extracted as bf16 and as fp8 (float32 compute on CPU, both rounded from it)."""
    return {
        dtype: extract_cpu_store(small_corpus, tmp_path_factory.mktemp(dtype) / "store", store_dtype=dtype, **SMALL)
        for dtype in ("bfloat16", "float8_e4m3fn")
    }


def test_extracted_fp8_states_are_the_bf16_states_within_the_bound_in_half_the_bytes(stores):
    bf16, fp8 = FeatureStore(stores["bfloat16"]), FeatureStore(stores["float8_e4m3fn"])
    assert len(bf16) == len(fp8) and fp8.scale_groups == len(fp8.layer_ids)
    for i in range(len(fp8)):
        want, got = bf16[i], fp8[i]
        assert torch.equal(want.input_ids, got.input_ids) and want.hidden_scales is None
        deq = dequantize(got.hidden_states, got.hidden_scales, torch.float32)
        # both round the same float32 states: bf16 by up to 2^-9 relative, fp8 within its bound
        bound = error_bound(deq, got.hidden_scales) * (1 + 2**-4) + want.hidden_states.float().abs() * 2**-8
        assert ((want.hidden_states.float() - deq).abs() <= bound).all(), i
    hidden_bytes = {
        name: sum(f.stat().st_size for f in (root / "shards").rglob("*") if "hidden_" in f.as_posix() and f.is_file())
        for name, root in stores.items()
    }
    # W + 4 L = 136 bytes a token against 2 W = 256, plus chunk checksums and shard indexes
    assert hidden_bytes["float8_e4m3fn"] < 0.55 * hidden_bytes["bfloat16"]


def test_batches_carry_codes_and_scales_and_dequantize_in_the_step(stores):
    bf16, fp8 = FeatureStore(stores["bfloat16"]), FeatureStore(stores["float8_e4m3fn"])
    spec = PackSpec(pack_tokens=256, num_blocks=16, block_size=8, mask_token_id=0, max_anchors_per_sample=64)
    packs = plan_packs(np.arange(len(fp8)), np.asarray(fp8.lengths), 256, 0, 0)[:2]
    want, got = build_batch(bf16, packs, spec, 0, 0), build_batch(fp8, packs, spec, 0, 0)
    assert got["context_hidden"].dtype == FP8 and got["context_scales"].shape == (2, 256, fp8.scale_groups)
    assert "context_scales" not in want
    for key in want:
        if key != "context_hidden":
            assert torch.equal(want[key], got[key]), key
    torch.testing.assert_close(context_states(got, torch.float32), want["context_hidden"].float(), rtol=0.07, atol=1e-3)


def test_fp8_training_follows_the_bf16_losses(stores, tmp_path):
    """Through a loader worker (the slot ring) on CPU. The tiny drafter leans little on its context:
    measured, fp8 stays within 2.6e-4 of bf16's losses, codes left unscaled drift 1.3e-3 away."""
    runs = {}
    for dtype, root in stores.items():
        runs[dtype] = tmp_path / dtype
        cfg = replace(base_config(root, runs[dtype]), max_steps=25, lr=3e-3, eval_every=25, loader_workers=1)
        run_training(cfg)
    want, got = losses(runs["bfloat16"]), losses(runs["float8_e4m3fn"])
    assert sorted(got) == sorted(want) == list(range(1, 26))
    assert got[25] < got[1]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=6e-4), step


@pytest.mark.slow
def test_killed_fp8_extraction_resumes_identical(tiny_target_dir, small_corpus, tmp_path):
    cmds = {name: [*command(tiny_target_dir, small_corpus, tmp_path / name), "--store-dtype", "float8_e4m3fn"]
            for name in ("ref", "killed")}  # fmt: skip
    subprocess.run(cmds["ref"], check=True, capture_output=True)
    assert run_until_killed(cmds["killed"], tmp_path / "killed", 3, kill="group") >= 3
    assert not load_manifest(tmp_path / "killed").complete
    rerun = subprocess.run(cmds["killed"], capture_output=True, text=True)
    assert rerun.returncode == 0 and "resumed" in rerun.stdout, rerun.stderr[-2000:]
    assert load_manifest(tmp_path / "killed").hidden_dtype == "float8_e4m3fn"
    assert stores_equal(tmp_path / "killed", tmp_path / "ref")
