"""Paged decode attention on one GPU: the Triton kernel against the device's copy bandwidth and the torch reference.

What is timed: `dflash_pipeline.shared.generation.paged_attention` for one decode step of one layer at
Qwen3-8B's attention shapes (32 query heads, 8 kv heads, head_dim 128, bf16; the pages bf16 or, with
`--kv-dtype float8_e4m3fn`, an fp8 KV cache's, whose bytes are what GB/s counts), page size 64, batches
64 and 256, random context lengths (uniform in [mean - w, mean + w] inside 100..2500, means 550 and
1500), every row's pages scattered over the pool.
How: each contender is captured in a CUDA graph of one launch per K/V pool, over `--pools` pools of
the same lengths but different pages and contents, so L2 (50 MB on an H200) never holds what the
next launch reads; each timed replay queues behind a GPU sleep (no launch gaps counted), CUDA
events around it, median over `--replays`, divided by the launches in the graph.
Bytes: K and V of each row's valid tokens, q and out (the block table and lengths are noise). GB/s
is compared with a device-to-device copy of a ~4 GB tensor (bytes read + written) in the same run
(`vs_copy`); `speedup_vs_reference` is the reference path (gather the whole capacity, repeat_kv,
masked SDPA) over the kernel. The sweep times split-K factors and (num_warps, num_stages, maxnreg)
so the defaults can be checked; `default` is what `paged_decode_attention` runs (`default_config`);
on fp8 pages that converts them to float16, and `q_dtype_dots` times the same launch converting them
to q's bfloat16 instead. `--layout` (repeatable, LAYOUTS) stores the pages with their axes in
another order, the same kernel reading them through their strides: whether the fp8 kernel's gap to
the copy bandwidth (~0.54 on the H200 where bf16 pages reach ~0.95, run 11) was the transpose of fp8
values on their way into the tensor cores. Not so: values stored token-minor (`vt`) made the kernel
1.7x slower on fp8 pages and 1.3x on bf16 ones (run 12, bench/RESULTS.md): their masked load then
leaves the software pipeline (sm_90 code compiled offline, bench.kernel_ptx). The masked load also
reads fp8 values from shared memory a byte at a time; loading value pages whole instead (tails zeroed
by a select, a float16 round trip through shared memory in its place) ran at 0.89x (run 13).
`finite_value_tails` times the launch of that name on every shape (the value pages loaded unmasked; the
pools here are finite everywhere): compiled for sm_90 on `vt` pages, it keeps V in the pipeline and
reads fp8 values without byte loads (bench.kernel_ptx), and ran 1.34-1.36x the masked launch on `thd`
fp8 pages on an H200 (run 14). That is the engine's fp8 cache since (`PagedKVCache`); its 16-bit cache
stays `thd` with the masked load, which was faster there.

    python -m bench.decode_attention --json result.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import torch

from bench import emit

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Qwen3-8B
MIN_LEN, MAX_LEN = 100, 2500
DEVICE = "cuda"
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU sleep ahead of each timed replay


def draw_lengths(b: int, mean: int, gen: torch.Generator) -> torch.Tensor:
    half = min(mean - MIN_LEN, MAX_LEN - mean)
    return torch.randint(mean - half, mean + half + 1, (b,), generator=gen)


def make_pool(
    lengths: torch.Tensor,
    page: int,
    max_pages: int,
    gen: torch.Generator,
    device,
    kv_dtype: torch.dtype,
    layout: str = "thd",
) -> dict:
    """K/V pages (`kv_dtype`, stored as LAYOUTS[layout]) for these lengths, each row's pages at random places
    in the pool (plus 5% spare)."""
    b = len(lengths)
    pages_per_row = (lengths + page - 1) // page
    num_pages = int(pages_per_row.sum() * 1.05) + 1
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(b, max_pages, dtype=torch.int32)
    start = 0
    for r, n in enumerate(pages_per_row.tolist()):
        table[r, :n] = perm[start : start + n].to(torch.int32)
        start += n
    k, v = (page_view(num_pages, page, kv_dtype, device, order) for order in LAYOUTS[layout])
    return {"k": k, "v": v, "table": table.to(device)}


# where each page's (token, kv head, dim) axes lie in memory, slowest first, for K and for V: the kernel
# reads pages through their strides, so a layout is only a view of [pages, page, kv_heads, head_dim]
LAYOUTS = {
    "thd": ("thd", "thd"),  # the engine's 16-bit cache
    # V with the token axis contiguous (the reduction axis of its dot with P): the engine's fp8 cache
    "vt": ("thd", "hdt"),
    "htd": ("htd", "htd"),  # each kv head's page one contiguous tile
    "htd_vt": ("htd", "hdt"),
}


def stored_as(pages: torch.Tensor, order: str) -> torch.Tensor:
    """The same [num_pages, page, kv_heads, head_dim] pages, stored with their axes in `order` (of t, h, d,
    slowest first) and viewed in the original order."""
    stored = pages.permute(0, *(1 + "thd".index(axis) for axis in order)).contiguous()
    return stored.permute(0, *(1 + order.index(axis) for axis in "thd"))


def page_view(num_pages: int, page: int, kv_dtype: torch.dtype, device, order: str) -> torch.Tensor:
    """Random pages stored with their axes in `order`, viewed as [num_pages, page, KV_HEADS, HEAD_DIM]."""
    pages = torch.empty((num_pages, page, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=device).normal_()
    return stored_as(pages.to(kv_dtype), order)


def time_graph(calls, replays: int) -> float:
    """Seconds per call: all `calls` captured in one CUDA graph, median over `replays` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:  # compile and warm up outside the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    del graph
    return statistics.median(times)


def time_eager(calls, replays: int) -> float:
    """Seconds per call, each call between CUDA events (for the reference: ms-scale, many kernels)."""
    for call in calls:
        call()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(replays):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        calls[i % len(calls)]()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(gigabytes: float, repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy of a `gigabytes` tensor."""
    n = int(gigabytes * 2**30) // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def bench_shape(b: int, mean: int, kv_dtype: torch.dtype, layout: str, args, copy_bps: float, seed: int) -> dict:
    from dflash_pipeline.shared.generation.paged_attention import (
        _default_splits,
        _default_stages,
        _default_warps,
        _paged_decode_attention_triton,
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    page = args.page_size
    max_pages = -(-MAX_LEN // page)
    gen = torch.Generator().manual_seed(seed)
    lengths_cpu = draw_lengths(b, mean, gen)
    lengths = lengths_cpu.to(DEVICE, torch.int32)
    pools = [make_pool(lengths_cpu, page, max_pages, gen, DEVICE, kv_dtype, layout) for _ in range(args.pools)]
    q = torch.randn(b, HEADS, HEAD_DIM, generator=gen).to(DEVICE, torch.bfloat16)
    scale = HEAD_DIM**-0.5
    elem = kv_dtype.itemsize
    nbytes = int(lengths_cpu.sum()) * KV_HEADS * HEAD_DIM * elem * 2 + 2 * q.numel() * q.element_size()
    pool_bytes = sum(p["k"].numel() * 2 * elem for p in pools)

    def row(seconds: float) -> dict:
        return {"us": seconds * 1e6, "GBps": nbytes / seconds / 1e9, "vs_copy": nbytes / seconds / copy_bps}

    def kernel_calls(**kw):
        return [
            lambda p=p: _paged_decode_attention_triton(q, p["k"], p["v"], p["table"], lengths, scale, **kw)
            for p in pools
        ]

    # correctness on pool 0 (bf16 reference, relative error)
    p0 = pools[0]
    out = paged_decode_attention(q, p0["k"], p0["v"], p0["table"], lengths, scale)
    ref = paged_decode_attention_reference(q, p0["k"], p0["v"], p0["table"], lengths, scale)

    def error(got: torch.Tensor) -> float:
        return ((got.float() - ref.float()).norm() / ref.float().norm()).item()

    def launch_variant(**kw) -> dict:
        """A launch other than the default: its time, and its relative error on pool 0."""
        got = _paged_decode_attention_triton(q, p0["k"], p0["v"], p0["table"], lengths, scale, **kw)
        return {**row(time_graph(kernel_calls(**kw), args.replays)), "rel_err_vs_reference": error(got)}

    default_splits = _default_splits(b, KV_HEADS, max_pages, q.device)
    default = row(
        time_graph(
            [lambda p=p: paged_decode_attention(q, p["k"], p["v"], p["table"], lengths, scale) for p in pools],
            args.replays,
        )
    )
    ref_calls = [
        lambda p=p: paged_decode_attention_reference(q, p["k"], p["v"], p["table"], lengths, scale) for p in pools
    ]
    ref_s = time_eager(ref_calls, args.reference_replays)
    result = {
        "batch": b,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "layout": layout,
        "mean_context_target": mean,
        "mean_context": float(lengths_cpu.float().mean()),
        "min_context": int(lengths_cpu.min()),
        "max_context": int(lengths_cpu.max()),
        "page_size": page,
        "bytes": nbytes,
        "pools": len(pools),
        "pool_bytes_total": pool_bytes,
        "rel_err_vs_reference": error(out),
        "default_config": {
            "splits": default_splits,
            "num_warps": _default_warps(page, HEAD_DIM),
            "num_stages": _default_stages(page, HEAD_DIM, elem),
        },
        "default": default,
        "reference": row(ref_s),
        "speedup_vs_reference": ref_s / (default["us"] / 1e6),
        "finite_value_tails": launch_variant(finite_value_tails=True),
    }
    if kv_dtype == torch.float8_e4m3fn:  # the same launch with the pages in q's dtype (not the default)
        result["q_dtype_dots"] = launch_variant(f16_dots=False)
    if not args.no_sweep:
        sweep = []
        for splits in args.splits:
            for warps, stages, maxnreg in args.configs:
                config = {"splits": splits, "num_warps": warps, "num_stages": stages, "maxnreg": maxnreg}
                try:
                    r = row(
                        time_graph(
                            kernel_calls(num_splits=splits, num_warps=warps, num_stages=stages, maxnreg=maxnreg),
                            args.replays,
                        )
                    )
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at some stage count
                    r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                sweep.append({**config, **r})
                print(
                    f"  b={b} mean={mean} {config}: {r.get('us', float('nan')):.1f} us, "
                    f"{r.get('vs_copy', float('nan')):.3f} of copy",
                    file=sys.stderr,
                    flush=True,
                )
        ok = [s for s in sweep if "us" in s]
        result["sweep"] = sweep
        if ok:
            result["best"] = min(ok, key=lambda s: s["us"])
    pools.clear()  # free the K/V pools before the next shape
    torch.cuda.empty_cache()
    return result


def parse_config(text: str) -> tuple[int, int, int | None]:
    """'num_warps,num_stages' or 'num_warps,num_stages,maxnreg'."""
    parts = [int(x) for x in text.split(",")]
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected num_warps,num_stages[,maxnreg], got {text!r}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch", type=int, action="append", default=None, help="repeatable [default: 64, 256]")
    ap.add_argument(
        "--mean-context",
        type=int,
        action="append",
        default=None,
        help=f"repeatable, in {MIN_LEN}..{MAX_LEN} [default: 550, 1500]",
    )
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument(
        "--kv-dtype",
        choices=["bfloat16", "float8_e4m3fn"],
        action="append",
        default=None,
        help="dtype of the K/V pages, repeatable (an fp8 KV cache: converted as the kernel reads it) [default: bfloat16]",
    )
    ap.add_argument(
        "--layout",
        choices=list(LAYOUTS),
        action="append",
        default=None,
        help="how K and V pages lie in memory (LAYOUTS), repeatable [default: thd, the engine's 16-bit layout]",
    )
    ap.add_argument("--pools", type=int, default=4, help="K/V pools rotated through (L2 never holds a launch's pages)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--reference-replays", type=int, default=10)
    ap.add_argument("--copy-gb", type=float, default=4.0, help="size of the tensor copied for the bandwidth ceiling")
    ap.add_argument("--no-sweep", action="store_true", help="time the default configuration only")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8], help="split-K factors swept")
    ap.add_argument(
        "--configs",
        type=parse_config,
        nargs="+",
        default=[(4, 2, None), (4, 3, None), (4, 4, None), (8, 3, None), (8, 4, None), (4, 3, 168)],
        help="num_warps,num_stages[,maxnreg] swept (maxnreg 168: 3 programs of 4 warps per SM)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit(
            "bench.decode_attention: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing measured."
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("bench.decode_attention: needs triton (the kernel's compiler); nothing measured.")
    batches = args.batch or [64, 256]
    means = args.mean_context or [550, 1500]
    for m in means:
        if not MIN_LEN <= m <= MAX_LEN:
            sys.exit(f"bench.decode_attention: --mean-context {m} outside {MIN_LEN}..{MAX_LEN}")

    props = torch.cuda.get_device_properties(0)
    copy_bps = copy_bandwidth(args.copy_gb)
    result = {
        "device": props.name,
        "sm_count": props.multi_processor_count,
        "copy_GBps": copy_bps / 1e9,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "dtype": "bfloat16",  # q's; each shape's kv_dtype is its pages'
        "shapes": [],
    }
    for (i, b), (j, mean), kv, layout in itertools.product(
        enumerate(batches),
        enumerate(means),
        [getattr(torch, d) for d in args.kv_dtype or ["bfloat16"]],
        args.layout or ["thd"],
    ):
        r = bench_shape(b, mean, kv, layout, args, copy_bps, seed=1000 * i + j)
        print(
            f"b={b} mean={mean} {r['kv_dtype']} pages, layout {layout}: default {r['default']['us']:.1f} us, {r['default']['GBps']:.0f} GB/s = "
            f"{r['default']['vs_copy']:.3f} of copy, {r['speedup_vs_reference']:.1f}x the reference"
            + (f"; pages in q's dtype {r['q_dtype_dots']['vs_copy']:.3f} of copy" if "q_dtype_dots" in r else "")
            + f"; values unmasked {r['finite_value_tails']['vs_copy']:.3f} of copy",
            file=sys.stderr,
            flush=True,
        )
        result["shapes"].append(r)
    emit(result, args.json)


if __name__ == "__main__":
    main()
