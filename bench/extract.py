"""Stage-one throughput on one GPU: this pipeline against a naive extractor, in the same run.

Target: a Qwen3-8B-shaped model with random weights (bf16). Data: synthetic conversations with
lognormal lengths (mean ~1.5k tokens, 128..3072). Both contenders write to the same local disk:
- naive: HF forward of the full model with `output_hidden_states=True` (LM head included), batches
  of 8 in data order padded to the longest with an attention mask, concat of the 5 layers, a
  synchronous `.cpu()` and `np.save` per batch;
- pipeline: the code `dflash-extract` runs (truncated decoder, hooks, length-sorted token-budget
  batches, async device->host copy into pinned memory, the crash-safe sharded Zarr writer), with the
  forward of batch i queued before batch i-1 is written; with HF's eager decoder layers and with
  them compiled (`compile_decoder_layers`, dflash-extract's GPU default), each against the same
  forward with nothing stored (the ceiling); per store dtype, store codec and number of writer threads
  (`--store-dtype`, `--compression`, `--write-streams`, each repeatable), so their effect is measured
  in one run (fp8 is quantized on the GPU, as dflash-extract does, before the device->host copy);
  with `--store-topk K`, also the pipeline that stores the target's top-K beside the states (the
  whole model runs: every layer, the final norm and the LM head), with its peak GPU memory.
MFU counts useful work only: matmul FLOPs of the decoder layers up to the last stored layer plus
causal attention, over real (unpadded) tokens, against a bf16 matmul rate measured in this run.

    python -m bench.extract --out-dir /tmp/bench --json result.json
    python -m bench.extract --out-dir /tmp/bench --store-dtype bfloat16 --store-dtype float8_e4m3fn
    python -m bench.extract --out-dir /tmp/bench --store-topk 16
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench import emit
from dflash_pipeline.data.tokens import TokenizedSample
from dflash_pipeline.extract.plan import padded_fraction, plan_batches
from dflash_pipeline.extract.worker import BatchRunner, run_batches
from dflash_pipeline.shared.model.config import default_target_layer_ids
from dflash_pipeline.shared.runtime.durable import folder_bytes
from dflash_pipeline.shared.store.codec import default_compression
from dflash_pipeline.shared.store.layout import SCALED_DTYPES
from dflash_pipeline.shared.store.manifest import STORAGE_DTYPES
from dflash_pipeline.shared.store.writer import WRITE_STREAMS, StoreWriter
from dflash_pipeline.shared.target.loading import (
    HiddenStateCapture,
    compile_decoder_layers,
    decoder_layers,
    drop_unused_modules,
)


def qwen3_8b_config(num_layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def random_model(config, device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def synthetic_samples(n: int, vocab: int, mean: float, seed: int = 0) -> list[TokenizedSample]:
    rng = np.random.default_rng(seed)
    sigma = 0.6
    lengths = np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n), 128, 3072).astype(int)
    return [
        TokenizedSample(i, rng.integers(0, vocab, L, dtype=np.int32), (rng.random(L) < 0.6).astype(np.uint8), False)
        for i, L in enumerate(lengths)
    ]


def matmul_tflops(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - t) / 1e12


def useful_flops(config, layers_run: int, samples) -> float:
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_token_layer = 2 * (h * q + 2 * h * kv + q * h + 3 * h * i)
    total = 0.0
    for s in samples:
        L = len(s.input_ids)
        total += layers_run * (per_token_layer * L + 2 * 2 * q * L * (L + 1) / 2)
    return total


def bench_naive(model, samples, layer_ids, out: Path, batch_size: int = 8) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    written = 0
    for b in range(0, len(samples), batch_size):
        batch = samples[b : b + batch_size]
        longest = max(len(s.input_ids) for s in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        att = torch.zeros(len(batch), longest, dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, : len(s.input_ids)] = torch.from_numpy(s.input_ids.astype(np.int64))
            att[r, : len(s.input_ids)] = 1
        with torch.inference_mode():
            o = model(input_ids=ids.cuda(), attention_mask=att.cuda(), output_hidden_states=True)
            feats = torch.cat([o.hidden_states[i + 1] for i in layer_ids], dim=-1).cpu()
        for r, s in enumerate(batch):
            arr = feats[r, : len(s.input_ids)].view(torch.int16).numpy()
            np.save(out / f"{s.index}.npy", arr)
            written += arr.nbytes
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "bytes": written}


class BatchClock:
    """`run_batches`' progress hook: when each batch was handed to the writer. The rate between the
    first and the last hand-over is the pipeline's steady state, free of the first forward (nothing
    to overlap yet), the last writes and `finalize`, which a short bench weighs far more than a run
    of millions of tokens does."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []

    def update(self, n: int) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(n)

    def steady_rate(self) -> float | None:
        if len(self.times) < 2:
            return None
        return sum(self.tokens[1:]) / (self.times[-1] - self.times[0])


def bench_pipeline(
    model,
    samples,
    layer_ids,
    out: Path,
    batch_tokens: int,
    compression: str,
    write_streams: int,
    store_dtype: str = "bfloat16",
    topk: int = 0,
) -> dict:
    """`dflash-extract`'s own batch loop (`run_batches`) into the real crash-safe store writer, on
    the model's device (`topk`: the whole model, the target's top-K stored with the states)."""
    lengths = [len(s.input_ids) for s in samples]
    plan = plan_batches(lengths, batch_tokens, 64)
    width = model.config.hidden_size * len(layer_ids)
    groups = len(layer_ids) if store_dtype in SCALED_DTYPES else 0
    shutil.rmtree(out, ignore_errors=True)
    writer = StoreWriter(
        out,
        0,
        hidden_width=width,
        hidden_dtype=store_dtype,
        capacity_tokens=sum(lengths),
        capacity_samples=len(samples),
        compression=compression,
        overwrite=True,
        write_streams=write_streams,
        scale_groups=groups,
        topk=topk,
    )
    device = next(model.parameters()).device
    runner = BatchRunner(model, layer_ids, device, getattr(torch, store_dtype), pad_id=0, topk=topk)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    clock = BatchClock()
    t = time.perf_counter()
    _, writer_wait = run_batches(runner, samples, plan.batches, writer, progress=clock)
    drained = time.perf_counter()
    writer.finalize()
    seconds = time.perf_counter() - t
    runner.capture.close()
    size = folder_bytes(out)
    # states + scales + top-K ids and log-probs, raw
    row_bytes = width * np.dtype(STORAGE_DTYPES[store_dtype]).itemsize + 4 * groups + 8 * topk
    return {
        "store_dtype": store_dtype,
        "topk": topk,
        "peak_memory_GB": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "compression": compression,
        "write_streams": write_streams,
        "seconds": seconds,
        "bytes": size,
        "batches": len(plan.batches),
        "padding": padded_fraction(lengths, plan),
        "forward_waited_for_writer_s": writer_wait,
        "steady_tokens_per_s": clock.steady_rate(),
        "finalize_s": seconds - (drained - t),
        "write_GBps": row_bytes * sum(lengths) / seconds / 1e9,
    }


def disk_write_rate(out: Path, streams: int, gigabytes: float = 4.0) -> float:
    """Plain writes + fsync of incompressible bytes, one 256 MiB file per write on each of `streams`
    threads (as the store writer does): the disk's own ceiling at that concurrency (GB/s)."""
    out.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 255, 256 * 2**20, dtype=np.uint8).tobytes()
    files = int(gigabytes * 4)

    def write(k: int) -> None:
        with open(out / f"ddtest{k}", "wb") as f:
            f.write(block)
            f.flush()
            os.fsync(f.fileno())

    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(write, range(files)))
    rate = files * len(block) / (time.perf_counter() - t) / 1e9
    shutil.rmtree(out)
    return rate


def bench_forward_only(model, samples, layer_ids, batch_tokens: int) -> dict:
    """The same batches with nothing stored: the ceiling the pipeline can reach."""
    lengths = [len(s.input_ids) for s in samples]
    plan = plan_batches(lengths, batch_tokens, 64)
    capture = HiddenStateCapture(model, layer_ids)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        for batch in plan.batches:
            longest = max(lengths[i] for i in batch)
            ids = torch.zeros(len(batch), longest, dtype=torch.long, device="cuda")
            model.model(input_ids=ids, use_cache=False)
            capture.take()
    torch.cuda.synchronize()
    capture.close()
    return {"seconds": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", required=True, help="Scratch folder on the disk under test (emptied).")
    ap.add_argument("--json", default=None)
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--mean-len", type=float, default=1500)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument(
        "--compression",
        action="append",
        default=None,
        help="store codec(s) to run, repeatable [default: each store dtype's default]",
    )
    ap.add_argument(
        "--write-streams",
        type=int,
        action="append",
        default=None,
        help=f"store writer threads to run, repeatable [default: {WRITE_STREAMS}]",
    )
    ap.add_argument(
        "--store-dtype",
        action="append",
        default=None,
        choices=sorted(STORAGE_DTYPES),
        help="store dtype(s) to run, repeatable [default: bfloat16]",
    )
    ap.add_argument(
        "--store-topk",
        type=int,
        default=0,
        help="also run the pipeline storing the target's top-K (whole model, first store dtype/codec/streams)",
    )
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--naive-samples", type=int, default=160, help="the naive baseline runs on the first N samples")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled-layer rows")
    ap.add_argument("--skip-eager", action="store_true", help="skip the eager-layer rows")
    args = ap.parse_args()
    scratch = Path(args.out_dir)
    shutil.rmtree(scratch, ignore_errors=True)

    full_layers = 36
    layer_ids = default_target_layer_ids(full_layers)
    config = qwen3_8b_config(full_layers)
    samples = synthetic_samples(args.samples, config.vocab_size, args.mean_len)
    peak = matmul_tflops("cuda")
    streams = args.write_streams or [WRITE_STREAMS]
    store_dtypes = args.store_dtype or ["bfloat16"]
    result = {
        "layer_ids": layer_ids,
        "samples": len(samples),
        "tokens": sum(len(s.input_ids) for s in samples),
        "matmul_tflops": peak,
        "batch_tokens": args.batch_tokens,
        "disk_write_GBps_by_streams": {n: disk_write_rate(scratch / "dd", n) for n in sorted({1, *streams})},
    }
    model = random_model(config, "cuda")
    warm = samples[:4]
    rows = []  # (row, samples it ran on)
    result["pipeline"] = []
    if not args.skip_naive:
        naive_samples = samples[: args.naive_samples]
        bench_naive(model, warm, layer_ids, scratch / "warm")
        result["naive"] = bench_naive(model, naive_samples, layer_ids, scratch / "naive")
        rows.append((result["naive"], naive_samples))
        shutil.rmtree(scratch / "naive")
    compiled_early = False
    if args.store_topk:  # the whole target runs (final norm, LM head): measured before the model is cut
        compiled_early = not args.no_compile
        if compiled_early:
            compile_decoder_layers(model)
        d = store_dtypes[0]
        c = (args.compression or [default_compression(d)])[0]
        bench_pipeline(
            model, samples[:64], layer_ids, scratch / "store", args.batch_tokens, c, streams[0], d, args.store_topk
        )
        run = bench_pipeline(
            model, samples, layer_ids, scratch / "store", args.batch_tokens, c, streams[0], d, args.store_topk
        )
        run["compiled"] = compiled_early
        result["pipeline"].append(run)
        rows.append((run, samples))
    # the pipeline's own model: decoder cut after the last stored layer, no LM head, no final norm
    layers = decoder_layers(model)
    del layers[layer_ids[-1] + 1 :]
    model.config.num_hidden_layers = layer_ids[-1] + 1
    model.config.layer_types = model.config.layer_types[: layer_ids[-1] + 1]
    drop_unused_modules(model)
    torch.cuda.empty_cache()
    for compiled in ([] if args.skip_eager else [False]) + ([] if args.no_compile else [True]):
        key = "forward_only_compiled" if compiled else "forward_only"
        if compiled:
            from dflash_pipeline.shared.model.attention import CompileCounter

            if not compiled_early:
                compile_decoder_layers(model)
            with CompileCounter() as counter:
                t = time.perf_counter()
                bench_forward_only(model, samples[:64], layer_ids, args.batch_tokens)  # several batch shapes
                result["compile_warmup_s"] = time.perf_counter() - t
            result["compile_graphs"] = counter.count
        else:
            bench_forward_only(model, warm, layer_ids, args.batch_tokens)
        result[key] = bench_forward_only(model, samples, layer_ids, args.batch_tokens)
        rows.append((result[key], samples))
        runs = [(d, c, n) for d in store_dtypes for c in args.compression or [default_compression(d)] for n in streams]
        for d, c, n in runs:
            run = bench_pipeline(model, samples, layer_ids, scratch / "store", args.batch_tokens, c, n, d)
            run["compiled"] = compiled
            run["vs_forward_only"] = result[key]["seconds"] / run["seconds"]
            if run["steady_tokens_per_s"] is not None:
                forward_rate = sum(len(s.input_ids) for s in samples) / result[key]["seconds"]
                run["steady_vs_forward_only"] = run["steady_tokens_per_s"] / forward_rate
            result["pipeline"].append(run)
            rows.append((run, samples))
    for r, ran in rows:
        r["tokens_per_s"] = sum(len(s.input_ids) for s in ran) / r["seconds"]
        flops = useful_flops(config, layer_ids[-1] + 1, ran)
        if r.get("topk"):  # every layer, and the LM head over every token
            flops = useful_flops(config, full_layers, ran) + 2 * config.hidden_size * config.vocab_size * sum(
                len(s.input_ids) for s in ran
            )
        r["mfu"] = flops / r["seconds"] / (peak * 1e12)
    for r in result["pipeline"]:
        r["bytes_per_token"] = r["bytes"] / result["tokens"]
        if "naive" in result:
            r["speedup_vs_naive"] = r["tokens_per_s"] / result["naive"]["tokens_per_s"]
    emit(result, args.json)


if __name__ == "__main__":
    main()
