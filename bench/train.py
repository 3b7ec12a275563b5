"""Stage-two throughput on one GPU: the drafter step with three attention paths, and the data loader.

Drafter for a Qwen3-8B-shaped target (hidden 4096, 32/8 heads, MLP 12288, vocab 151936, 5 target
layers), 4096-token packs with 256 blocks of 16 (Q = 4096 block tokens, KV = 4096 + 4096). One
training step = drafter forward, chunked weighted CE through the frozen LM head, backward, AdamW.
Compared in the same run: compiled flex_attention (the trainer's path), dense-mask SDPA, and
uncompiled flex. MFU counts matmul FLOPs (fwd x3 for trained weights, x2 for the frozen LM head)
against a bf16 matmul rate measured here. The loader is timed on a real on-disk store of random
bf16 features through the trainer's feed (`train/feed.py`, at several worker counts; also from an
uncompressed store) and compared with the packs/s the step consumes and with a stock DataLoader
(pin-memory thread) over the same dataset. With `--store-dtype float8_e4m3fn` beside bfloat16, the
compiled step is also timed on the fp8 batch (codes and scales on the GPU, dequantized in the step)
and the loader on fp8 stores (half the bytes per pack). Without CUDA, `--loader-only` times the
loader into CPU memory. `--shape smollm2-135m` times the issue 18 runs' small drafter instead (its
step is far from compute-bound), `--num-blocks` the blocks per pack; beside the compiled step, the
trainer's own `Trainer.train_step` is timed on the same batch (its host reads of the loss, gradient
norm and counts wait for the GPU every step), and `--profile-step` compares its wall time with the
GPU's busy time under torch.profiler. `--compile-drafter` adds the same step and the trainer's step with
the drafter compiled as one graph (`dflash-train --compile-drafter`); `--arch dflash2` times DFlash-2's.
`--count-ops` (any machine) only counts the operators one eager step dispatches.

    python -m bench.train --scratch /tmp/bench_train --json result.json
    python -m bench.train --scratch /tmp/bench_train --store-dtype bfloat16 --store-dtype float8_e4m3fn
    python -m bench.train --scratch /tmp/bench_train --shape smollm2-135m --num-blocks 1024 --skip-eager --skip-loader --profile-step
    python -m bench.train --scratch /tmp/bench_train --shape smollm2-135m --num-blocks 256 --arch dflash2 \
        --skip-eager --skip-loader --compile-drafter --profile-step
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from bench import emit, keep
from bench.extract import matmul_tflops, qwen3_8b_config
from dflash_pipeline.shared.model.config import DFlashConfig
from dflash_pipeline.shared.model.drafter import DFlashDrafter
from dflash_pipeline.shared.model.loss import default_gamma
from dflash_pipeline.shared.model.target_head import TargetHead
from dflash_pipeline.shared.store.codec import default_compression
from dflash_pipeline.shared.store.fp8 import quantize
from dflash_pipeline.shared.store.layout import SCALED_DTYPES
from dflash_pipeline.shared.store.manifest import STORAGE_DTYPES
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.train.config import TrainConfig
from dflash_pipeline.train.dataset import PackSpec, StepDataset, StepPlan
from dflash_pipeline.train.loop import dflash2_settings
from dflash_pipeline.train.step import compiled_drafter, pack_loss, to_device

S, N, B = 4096, 256, 16


def synthetic_batch(width: int, vocab: int, seed: int = 0, blocks: int = N) -> dict[str, torch.Tensor]:
    """One pack of four documents with dense anchors (`blocks` of them), built by the trainer's own code."""
    from dflash_pipeline.shared.model.blocks import build_blocks, sample_anchors

    g = torch.Generator().manual_seed(seed)
    doc = torch.empty(S, dtype=torch.long)
    pos = torch.empty(S, dtype=torch.long)
    mask = torch.zeros(S, dtype=torch.bool)
    anchors = []
    for d in range(4):
        sl = slice(d * S // 4, (d + 1) * S // 4)
        doc[sl], pos[sl] = d, torch.arange(S // 4)
        mask[sl.start + 200 : sl.stop] = True
        anchors.append(sample_anchors(mask[sl], blocks // 4, g) + sl.start)
    ids = torch.randint(0, vocab, (S,), generator=g)
    tensors = build_blocks(ids, doc, pos, mask, torch.cat(anchors), blocks, B, vocab - 1)
    hidden = (torch.randn(S, width, generator=g) * 0.5).to(torch.bfloat16)
    batch = {"context_hidden": hidden, "context_doc": doc, "context_positions": pos, **tensors}
    return {k: v[None] for k, v in batch.items()}


def step_flops(cfg: DFlashConfig, batch) -> float:
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    Q = batch["block_ids"].shape[1]
    labeled = int((batch["labels"] != -100).sum())
    visible_ctx = float((batch["anchor_pos"] * batch["block_valid"]).sum()) * B  # context keys seen, summed
    fc = 2 * S * cfg.context_width * h
    per_layer = 2 * S * 2 * h * kv + 2 * Q * (2 * h * q + 2 * h * kv + 3 * h * i) + 2 * 2 * q * (visible_ctx + Q * B)
    trained = fc + cfg.num_hidden_layers * per_layer
    head = 2 * labeled * h * cfg.vocab_size
    return 3 * trained + 2 * head


def time_steps(model, head, batch, backend: str, gamma: float, steps: int, compiled: bool = False) -> float:
    """Seconds per forward + backward + AdamW step with no host reads; `compiled`: the drafter compiled
    as one graph, as `dflash-train --compile-drafter` runs it."""
    model.attention_backend = backend
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_model = compiled_drafter(model) if compiled else model

    def one():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_sum, weight, _ = pack_loss(step_model, head, batch, gamma, compiled=compiled)
        (loss_sum / weight).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return seconds_per_call(one, steps)


def seconds_per_call(fn, calls: int, warmup: int = 3) -> float:
    """Seconds per call of `fn` after `warmup` calls, the GPU (where there is one) drained before and after."""
    for _ in range(warmup):
        fn()
    drain = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    drain()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    drain()
    return (time.perf_counter() - t) / calls


def trainer_step(model, head, gamma: float, device: torch.device, compiled: bool = False):
    """`Trainer.train_step` itself (its host reads of the weight, loss, gradient norm and counts
    included) on a stand-in for the Trainer holding only what that method reads; -> step(batch).
    `compiled`: on the drafter compiled as `dflash-train --compile-drafter` compiles it."""
    from types import SimpleNamespace

    from dflash_pipeline.train.loop import Trainer

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    trainer = SimpleNamespace(
        model=model,
        head=head,
        gamma=gamma,
        kl_weight=0.0,
        world=1,
        device=device,
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
        trainable=[p for p in model.parameters() if p.requires_grad],
        cfg=SimpleNamespace(selector_loss_weight=1.0, grad_clip=1.0, compile_drafter=compiled),
        state=SimpleNamespace(step=0),
        out=None,
        autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16),
    )
    step_model = compiled_drafter(model) if compiled else model
    return lambda batch: Trainer.train_step(trainer, step_model, batch)


def time_trainer_steps(model, head, batch, gamma: float, steps: int, compiled: bool = False) -> float:
    """Seconds per step of the trainer's own step (`trainer_step`), with the count of the batch's
    context tokens that `Trainer.fit` reads after it."""
    step = trainer_step(model, head, gamma, batch["block_ids"].device, compiled)

    def one():
        step(batch)
        int((batch["context_doc"] >= 0).sum())

    return seconds_per_call(one, steps)


def profile_trainer_step(model, head, batch, gamma: float, top: int = 15, compiled: bool = False) -> dict:
    """One trainer step (`trainer_step`) under torch.profiler after warm-up: its wall time, the
    device's busy time (the step's kernels and copies summed; one stream), and the top operators by
    device time (host operators and their kernels both listed), so the gap between wall and busy time
    shows what the host costs."""
    from torch.profiler import ProfilerActivity, profile

    step = trainer_step(model, head, gamma, batch["block_ids"].device, compiled)
    for _ in range(3):
        step(batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]  # kernels, copies
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
    ops = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return {
        "wall_ms_profiled": wall * 1e3,
        "device_busy_ms": busy,
        "kernels": len(kernels),
        "top_ops": [
            {"op": e.key[:90], "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3} for e in ops
        ],
    }


LAYER_IDS = [1, 9, 17, 25, 33]


def count_step_ops(cfg: DFlashConfig, blocks: int) -> dict[str, int]:
    """Aten operators of one eager training step on the CPU after a warm-up step: the top-level ones
    (what eager mode dispatches one by one, each a kernel launch or more on a GPU) and all of them."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = DFlashDrafter(cfg, attention_backend="sdpa_dense")
    head = TargetHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02, torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02
    )
    batch = synthetic_batch(cfg.context_width, cfg.vocab_size, blocks=blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss_sum, weight, _ = pack_loss(model, head, batch, default_gamma(B))
        (loss_sum / weight).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"top_level_aten_ops": len(top), "aten_ops": len(aten)}


def smollm2_135m_config():
    """SmolLM2-135M-Instruct's shape (the issue 18 runs' target): 30 layers of 576, 9/3 heads of 64."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )


# each shape's target config and the 5 target layers its drafter reads (the issue 18 runs' for SmolLM2)
SHAPES = {
    "qwen3-8b": (lambda: qwen3_8b_config(36), LAYER_IDS),
    "smollm2-135m": (smollm2_135m_config, [1, 8, 14, 20, 27]),
}


def as_stored(hidden: torch.Tensor, hidden_dtype: str) -> tuple[torch.Tensor, ...]:
    """bf16 states [.., W] as a store of `hidden_dtype` holds them: themselves, or fp8 codes and scales."""
    if hidden_dtype in SCALED_DTYPES:
        return quantize(hidden.view(-1, hidden.shape[-1]), len(LAYER_IDS))
    return (hidden.to(getattr(torch, hidden_dtype)),)


def synthetic_store(
    root: Path,
    width: int,
    vocab: int,
    samples: int,
    mean_len: int,
    compression: str | None = None,
    hidden_dtype: str = "bfloat16",
) -> None:
    """A complete on-disk store of random features, written by the real writer and manifest code."""
    from dflash_pipeline.shared.store import manifest as mf
    from dflash_pipeline.shared.store.writer import StoreWriter

    rng = np.random.default_rng(0)
    lengths = rng.integers(mean_len // 2, mean_len * 3 // 2, samples)
    w = StoreWriter(
        root,
        0,
        hidden_width=width,
        hidden_dtype=hidden_dtype,
        capacity_tokens=int(lengths.sum()),
        capacity_samples=samples,
        overwrite=True,
        scale_groups=len(LAYER_IDS) if hidden_dtype in SCALED_DTYPES else 0,
        compression=compression,
    )
    for i, L in enumerate(lengths):
        hidden = torch.from_numpy(rng.standard_normal((L, width), dtype=np.float32)).to(torch.bfloat16)
        ids = rng.integers(0, vocab, L).astype(np.int32)
        mask = np.zeros(L, np.uint8)
        mask[L // 4 :] = 1
        w.append_batch([(i, ids, mask, *as_stored(hidden, hidden_dtype))])
    shard = w.finalize()
    m = mf.new_manifest(
        target={
            "name_or_path": "synthetic",
            "architecture": "Qwen3ForCausalLM",
            "config_hash": "x",
            "num_layers": 36,
            "hidden_size": width // 5,
            "vocab_size": vocab,
            "layer_ids": LAYER_IDS,
        },
        hidden_dtype=hidden_dtype,
        tokenizer_fingerprint="x",
        data={"paths": [], "fingerprint": "x"},
        settings={},
        world_size=1,
    )
    mf.write_manifest(root, m)
    mf.mark_complete(root, mf.load_manifest(root), shards=[shard], weights_fingerprint="x", counts={})


class TimedSteps(StepDataset):
    """The trainer's dataset, each batch also carrying how long its worker took to build it and how
    long that worker had waited since its previous batch (for work, or to hand that batch over).
    With `send_small`, a slot's small arrays also travel by value, as the previous feed sent them:
    its hand-over cost, measured beside the current one."""

    _last_end: float | None = None
    send_small = False

    def __getitem__(self, item):
        t = time.perf_counter()
        epoch, k, batch = super().__getitem__(item)
        end = time.perf_counter()
        gap = 0.0 if self._last_end is None else t - self._last_end
        self._last_end = end
        times = np.array([end - t, gap])
        if item[2] is None:  # a batch of tensors (in-process, stock DataLoader)
            return epoch, k, {**batch, "build_s": torch.from_numpy(times)}
        if self.send_small:
            batch.update({key: v.numpy() for key, v in self.slots.views(item[2]).items() if key != "context_hidden"})
        return epoch, k, {**batch, "build_s": times}


def one_pack_steps(store) -> StepPlan:
    """One rank's plan over the whole store, one pack of S tokens per step (seed 0)."""
    return StepPlan(np.arange(len(store)), np.asarray(store.lengths), S, 0, rank=0, world=1, packs_per_step=1)


def loader_rate(root: Path, workers: int, steps: int, path: str = "slots") -> dict[str, float]:
    """Batches (one pack each) per second into GPU memory, and the mean time a worker spent building
    one. `path`: "slots", the trainer's (`train/feed.py`: workers build whole batches into
    page-locked shared slots, one DMA copy each, only the slot's number sent back); "slots_sent", the
    same with the small arrays also sent by value (the previous feed's hand-over); "stock", the
    baseline (a stock DataLoader of the same dataset: new shared tensors per batch and the pin-memory
    thread); "inline", built in this process (`workers` ignored: the per-process build rate).
    worker_gap_s: a worker's mean wait between two batches; main_cpu_ms_per_batch: this process's
    CPU time per batch (all its threads). Steady state: timed once every worker has delivered a batch
    (timed from the first batch, the other workers' start-up falls inside the window: 2 workers on
    the CPU machine gave 4.3 packs/s over 6 steps, 18.6 over 40). workers / build_s is the rate the
    workers could deliver: if it is far above packs_per_s, the main process is the limit; if build_s
    grows with the worker count, the workers contend for something (memory bandwidth, cores, the disk)."""
    from torch.utils.data import DataLoader

    from dflash_pipeline.shared.store.reader import FeatureStore
    from dflash_pipeline.train.feed import device_batches

    plan = one_pack_steps(FeatureStore(root))
    warm = 1 if path == "inline" else max(1, workers)
    epochs = 2 + (warm + steps) // plan.steps_in(0)  # one spare: epochs differ a little in length
    dataset = TimedSteps(str(root), plan, PackSpec(S, N, B, 0, 512))
    dataset.send_small = path == "slots_sent"
    schedule = plan.schedule(epochs)[: warm + steps]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if path == "stock":
        batches = (
            to_device(b, device)
            for _, _, b in DataLoader(
                dataset,
                batch_size=None,
                sampler=[(e, k, None) for e, k in schedule],
                num_workers=workers,
                pin_memory=device.type == "cuda",
                prefetch_factor=2,
                multiprocessing_context="spawn",
            )
        )  # blosc threads as numcodecs sets them
    else:
        batches = (b for _, _, b in device_batches(dataset, schedule, 0 if path == "inline" else workers, device))
    for _ in range(warm):  # start-up is paid once per run: every worker has delivered a batch before the clock starts
        next(batches)
    build = torch.zeros(2, dtype=torch.float64, device=device)
    t, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        build += batch["build_s"]  # on the device: no wait for the copy, as a training step would not
    if device.type == "cuda":
        torch.cuda.synchronize()
    build_s, gap_s = (build / steps).tolist()
    return {
        "packs_per_s": steps / (time.perf_counter() - t),
        "build_s": build_s,
        "worker_gap_s": gap_s,
        "main_cpu_ms_per_batch": 1000 * (time.process_time() - cpu) / steps,
    }


def host_to_device_rates(width: int, repeats: int = 5) -> dict[str, float]:
    """GB/s of copying one pack's hidden states to the GPU from page-locked shared memory (the
    feed's slots), from pinned memory of torch's allocator, and from ordinary memory: the ceiling on
    packs/s that no loader can pass (one DMA per pack)."""
    from dflash_pipeline.train.feed import SlotLayout, SlotRing

    ring = SlotRing(1, SlotLayout.of({"hidden": ((S, width), torch.bfloat16)}), pin=True)
    sources = {
        "registered_shared": ring.views(0)["hidden"],
        "pinned": torch.empty(S, width, dtype=torch.bfloat16).pin_memory(),
        "pageable": torch.empty(S, width, dtype=torch.bfloat16),
    }
    rates = {}
    for name, host in sources.items():
        host.fill_(1)
        dest = torch.empty_like(host, device="cuda")
        dest.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            dest.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        rates[name] = repeats * host.numel() * host.element_size() / (time.perf_counter() - t) / 1e9
    ring.close()
    return rates


def page_cache_read_rate(root: Path, passes: int = 2) -> list[float]:
    """GB/s of reading every file of a store with plain preads, `passes` times: just after the store
    was written, a rate far below memory speed means the reads come from the disk, not the page cache."""
    files = [p for p in root.rglob("*") if p.is_file()]
    buf = np.empty(64 << 20, np.uint8)
    rates = []
    for _ in range(passes):
        total, t = 0, time.perf_counter()
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                offset = 0
                while n := os.preadv(fd, [buf], offset):
                    offset += n
                total += offset
            finally:
                os.close(fd)
        rates.append(total / (time.perf_counter() - t) / 1e9)
    return rates


def build_profile(root: Path, packs: int = 6, top: int = 8) -> list[tuple[str, float]]:
    """Where one process's pack building spends its time: cProfile's top functions by own time (s per pack)."""
    import cProfile
    import pstats

    from dflash_pipeline.shared.store.reader import FeatureStore
    from dflash_pipeline.train.dataset import build_batch

    store = FeatureStore(root)
    plan = one_pack_steps(store)
    spec, todo = PackSpec(S, N, B, 0, 512), plan.epoch_packs(0)[:packs]
    out = build_batch(store, todo[:1], spec, 0, 0)  # files opened, pages of `out` mapped
    profiler = cProfile.Profile()
    profiler.enable()
    for pack in todo:
        build_batch(store, [pack], spec, 0, 0, out=out)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(
        ((f"{fn[2]} ({Path(fn[0]).name}:{fn[1]})", v[2] / len(todo)) for fn, v in stats.items()), key=lambda r: -r[1]
    )
    return rows[:top]


def attention_only(cfg: DFlashConfig, batch: dict[str, torch.Tensor], iters: int = 20) -> dict[str, float]:
    """Forward + backward of one attention call at the drafter's shapes and this batch's mask:
    compiled flex with its BlockMask against SDPA with the same rule as a dense bool mask."""
    from dflash_pipeline.shared.model import attention as attn

    mask_args = [batch[k] for k in ("anchor_pos", "block_doc", "block_valid", "context_doc")]
    block_mask = attn.build_block_mask(*mask_args, B, device="cuda")
    dense = attn.dense_mask(*mask_args, B)
    g = torch.Generator(device="cuda").manual_seed(0)
    hd, Q = cfg.head_dim, batch["block_ids"].shape[1]
    q = torch.randn(
        1, cfg.num_attention_heads, Q, hd, device="cuda", dtype=torch.bfloat16, generator=g
    ).requires_grad_()
    k, v = (
        torch.randn(
            1, cfg.num_key_value_heads, S + Q, hd, device="cuda", dtype=torch.bfloat16, generator=g
        ).requires_grad_()
        for _ in range(2)
    )
    scale = hd**-0.5
    paths = {
        "flex_compiled": lambda: attn.flex_attention_compiled(q, k, v, block_mask, scale),
        "sdpa_dense": lambda: attn.sdpa_dense_attention(q, k, v, dense, scale),
    }
    out: dict[str, float] = {"block_sparsity_pct": float(block_mask.sparsity())}
    for name, fn in paths.items():
        for _ in range(3):
            fn().sum().backward()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn().sum().backward()
        torch.cuda.synchronize()
        out[f"{name}_ms"] = (time.perf_counter() - t) / iters * 1e3
    out["compiled_flex_speedup"] = out["sdpa_dense_ms"] / out["flex_compiled_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--layers", type=int, default=5, help="drafter decoder layers")
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="qwen3-8b",
        help="the target whose drafter is timed (smollm2-135m: the issue 18 runs' small drafter)",
    )
    ap.add_argument(
        "--num-blocks", type=int, default=N, help="draft blocks per 4096-token pack (dflash-train --num-blocks)"
    )
    ap.add_argument(
        "--profile-step",
        action="store_true",
        help="also one trainer step under torch.profiler: wall against device-busy time, top operators",
    )
    ap.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash", help="the drafter (dflash-train --arch)")
    ap.add_argument(
        "--compile-drafter",
        action="store_true",
        help="also the step and the trainer's step with the drafter compiled as one graph (dflash-train "
        "--compile-drafter), beside the eager drafter with compiled flex",
    )
    ap.add_argument(
        "--count-ops",
        action="store_true",
        help="only count the aten operators one eager training step dispatches, on the CPU (SDPA, foreach "
        "AdamW): what a host-bound GPU step pays per operator",
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--loader-workers", type=int, default=8)
    ap.add_argument("--loader-steps", type=int, default=150, help="timed batches per loader run")
    ap.add_argument("--loader-samples", type=int, default=48, help="samples (~1500 tokens each) per loader store")
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument(
        "--skip-loader", action="store_true", help="time the step only (the loader's packs hold 256 blocks)"
    )
    ap.add_argument("--loader-only", action="store_true", help="time only the data loader (no step, no compile)")
    ap.add_argument(
        "--loader-diagnostics",
        action="store_true",
        help="also: page-cache read rates of the stores and a profile of one process building packs",
    )
    ap.add_argument(
        "--store-dtype",
        action="append",
        default=None,
        choices=sorted(STORAGE_DTYPES),
        help="store dtype(s) of the loader's stores and the step's batch, repeatable [default: bfloat16]",
    )
    args = ap.parse_args()
    dtypes = args.store_dtype or ["bfloat16"]
    make_target, layer_ids = SHAPES[args.shape]
    target = make_target()
    train_defaults = TrainConfig(store="", out="", arch=args.arch)  # dflash-train's DFlash-2 settings
    cfg = DFlashConfig.for_target(
        target.to_dict(),
        layer_ids,
        mask_token_id=target.vocab_size - 1,
        num_layers=args.layers,
        block_size=B,
        **dflash2_settings(train_defaults, target),
    )
    if args.count_ops:
        emit({"arch": args.arch, "shape": args.shape, **count_step_ops(cfg, args.num_blocks)}, args.json)
        return
    if not torch.cuda.is_available():
        if not args.loader_only:
            ap.error("without CUDA only --loader-only runs (the loader into CPU memory)")
        emit({"device": "cpu", "loader": run_loaders(args, cfg, dtypes, {})}, args.json)
        return
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = DFlashDrafter(cfg).to(device)
    head = TargetHead(
        torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=torch.bfloat16) * 0.02,
        torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, dtype=torch.bfloat16) * 0.02,
    )
    batch = to_device(synthetic_batch(cfg.context_width, cfg.vocab_size, blocks=args.num_blocks), device)
    gamma = default_gamma(B)
    peak = matmul_tflops(device)
    flops = step_flops(cfg, batch)
    result = {
        "shape": args.shape,
        "arch": args.arch,
        "drafter_layers": args.layers,
        "pack_tokens": S,
        "blocks": args.num_blocks,
        "block_size": B,
        "matmul_tflops": peak,
        "step_tflop": flops / 1e12,
    }
    from dflash_pipeline.shared.model.attention import CompileCounter

    backends = [] if args.loader_only else ["flex_compiled", "sdpa_dense"] + ([] if args.skip_eager else ["flex_eager"])
    # the trainer's path on each other store dtype's batch (dequantized in the step)
    runs = [(b, b, batch, False) for b in backends] + [
        (f"flex_compiled_{d}", "flex_compiled", stored_batch(batch, d), False)
        for d in dtypes
        if d != "bfloat16" and not args.loader_only
    ]
    if args.compile_drafter and not args.loader_only:
        runs.append(("compiled_drafter", "flex_compiled", batch, True))
    for name, backend, run_batch, compiled in runs:
        with CompileCounter() as counter:
            try:
                steps = args.steps if backend != "flex_eager" else 3
                sec = time_steps(model, head, run_batch, backend, gamma, steps, compiled)
            except torch.OutOfMemoryError as exc:
                result[name] = {"error": f"OOM: {str(exc).splitlines()[0]}"}
                torch.cuda.empty_cache()
                continue
        result[name] = {
            "step_s": sec,
            "context_tokens_per_s": S / sec,
            "mfu": flops / sec / (peak * 1e12),
            "graphs_compiled": counter.count,
        }
        torch.cuda.empty_cache()
        keep(result, args.json)
    fc = result.get("flex_compiled", {}).get("step_s")
    if fc and not args.loader_only:  # the trainer's own step on the same batch: its host reads included
        model.attention_backend = "flex_compiled"
        sec = time_trainer_steps(model, head, batch, gamma, args.steps)
        result["trainer_step"] = {
            "step_s": sec,
            "context_tokens_per_s": S / sec,
            "vs_step_without_host_reads": sec / fc,
        }
        if args.profile_step:
            result["trainer_step"]["profile"] = profile_trainer_step(model, head, batch, gamma)
        keep(result, args.json)
        if args.compile_drafter:
            sec_compiled = time_trainer_steps(model, head, batch, gamma, args.steps, compiled=True)
            result["trainer_step_compiled"] = {
                "step_s": sec_compiled,
                "context_tokens_per_s": S / sec_compiled,
                "speedup_vs_trainer_step": sec / sec_compiled,
            }
            if args.profile_step:
                result["trainer_step_compiled"]["profile"] = profile_trainer_step(
                    model, head, batch, gamma, compiled=True
                )
    for other in ("sdpa_dense", "flex_eager"):
        if fc and "step_s" in result.get(other, {}):
            result[f"compiled_flex_speedup_vs_{other}"] = result[other]["step_s"] / fc
    if not args.loader_only:
        result["attention_only"] = attention_only(cfg, batch)
    step_s = {d: result.get("flex_compiled" + ("" if d == "bfloat16" else f"_{d}"), {}).get("step_s") for d in dtypes}
    if not args.skip_loader:
        result["loader"] = run_loaders(args, cfg, dtypes, step_s)
    emit(result, args.json)


def stored_batch(batch: dict[str, torch.Tensor], hidden_dtype: str) -> dict[str, torch.Tensor]:
    """`batch` with its context states as a `hidden_dtype` store's loader delivers them."""
    stored = as_stored(batch["context_hidden"], hidden_dtype)
    scales = {"context_scales": stored[1].view(*batch["context_hidden"].shape[:-1], -1)} if len(stored) > 1 else {}
    return {**batch, "context_hidden": stored[0].view(batch["context_hidden"].shape), **scales}


def run_loaders(args, cfg: DFlashConfig, dtypes: list[str], step_s: dict[str, float | None]) -> dict:
    """Loader packs/s per store (each dtype with the default codec and uncompressed) against the
    packs/s the compiled step consumes on that dtype's batches (`step_s`: seconds per pack, if timed)."""
    scratch = Path(args.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    # each dtype's default codec, and uncompressed (scatter reads, no decode) where that is not the
    # default; bf16 keeps its store names (bench/RESULTS.md)
    stores = {
        f"{name}{'' if d == 'bfloat16' else '_' + d}": (d, compression)
        for d in dtypes
        for name, compression in (("store", default_compression(d)), ("store_none", "none"))
        if name == "store" or default_compression(d) != "none"
    }
    for name, (d, compression) in stores.items():
        synthetic_store(scratch / name, cfg.context_width, cfg.vocab_size, args.loader_samples, 1500, compression, d)
    loader = {"host_to_device_GBps": host_to_device_rates(cfg.context_width)} if torch.cuda.is_available() else {}
    if args.loader_diagnostics:
        loader["page_cache_read_GBps"] = {name: page_cache_read_rate(scratch / name) for name in stores}
        loader["one_process_build_profile"] = build_profile(scratch / next(iter(stores)))
    counts = sorted(
        {max(1, args.loader_workers // 2), args.loader_workers} | ({14} if torch.cuda.is_available() else set())
    )
    for name in stores:
        runs = {
            "inline": loader_rate(scratch / name, 0, steps=8, path="inline"),
            **{
                w: loader_rate(scratch / name, w, steps=args.loader_steps)
                for w in (counts if not name.startswith("store_none") else counts[-1:])
            },
        }
        if name == "store":
            runs["slots_sent"] = loader_rate(
                scratch / name, args.loader_workers, steps=args.loader_steps, path="slots_sent"
            )
            runs["stock"] = loader_rate(scratch / name, args.loader_workers, steps=40, path="stock")
            runs["speedup_vs_stock"] = runs[args.loader_workers]["packs_per_s"] / runs["stock"]["packs_per_s"]
            runs["speedup_vs_small_arrays_sent"] = (
                runs[args.loader_workers]["packs_per_s"] / runs["slots_sent"]["packs_per_s"]
            )
        best = max((w for w in counts if w in runs), key=lambda w: runs[w]["packs_per_s"])
        runs["best_workers"], runs["packs_per_s"] = best, runs[best]["packs_per_s"]
        runs["bytes_per_token"] = sum(f.stat().st_size for f in (scratch / name).rglob("*") if f.is_file()) / sum(
            FeatureStore(scratch / name).lengths
        )
        if fc := step_s.get(stores[name][0]):
            runs["consumed_packs_per_s"], runs["ratio"] = 1 / fc, runs["packs_per_s"] * fc
        loader[name] = runs
    return loader


if __name__ == "__main__":
    main()
