"""One extraction process: owns one rank's samples, one device and one store shard.

Per batch the forward of batch i is queued on the GPU before batch i-1 is collected from its
pinned host buffer (copied there on a side stream, overlapping the forward of batch i) and handed
to the store writer's I/O thread (`background_writer`), so the device computes while the states
of earlier batches are compressed and written. Model code runs on this
process's main thread only.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from dflash_pipeline.data.errors import DataError
from dflash_pipeline.data.records import ReadStats, iter_records
from dflash_pipeline.data.tokenize_pool import tokenize_many, tokenize_processes
from dflash_pipeline.data.tokens import TokenizedSample
from dflash_pipeline.extract.background_writer import BackgroundWriter
from dflash_pipeline.extract.config import ExtractConfig
from dflash_pipeline.extract.plan import owns, padded_fraction, plan_batches
from dflash_pipeline.shared.runtime.durable import free_bytes, write_bytes_durably
from dflash_pipeline.shared.runtime.progress import progress_bar, progress_note, silence_library_bars
from dflash_pipeline.shared.store.fp8 import FP8, quantize
from dflash_pipeline.shared.store.layout import SCALED_DTYPES, StoreLayout
from dflash_pipeline.shared.store.writer import StoreWriter
from dflash_pipeline.shared.target.loading import (
    HiddenStateCapture,
    compile_decoder_layers,
    drop_unused_modules,
    forward_hidden_states,
    load_full_target,
    load_truncated_target,
)


@dataclass
class RankSummary:
    rank: int
    samples: int = 0
    tokens: int = 0
    truncated: int = 0
    skipped: dict = field(default_factory=dict)
    resumed_batches: int = 0
    batches: int = 0
    padding: float = 0.0
    seconds: float = 0.0
    computed_tokens: int = 0  # tokens run through the target in this invocation
    forward_seconds: float = 0.0  # ... in this long: the forward and its writes, from the first batch to the last
    writer_wait_s: float = 0.0  # forward stalled on a full write queue (storage slower than the GPU)
    regenerated: dict | None = None  # RegenerateStats of --regenerate
    generated_tokens: int = 0  # --regenerate: tokens generated in this invocation
    generate_seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def compute_dtype(cfg: ExtractConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_owned_samples(
    cfg: ExtractConfig, tokenizer, rank: int, world_size: int, device: torch.device
) -> tuple[list[TokenizedSample], RankSummary, ReadStats]:
    """Read every input record, regenerate replies if asked, tokenize the records this rank owns.
    Rank 0 shows reading and tokenizing as bars: on large data they take minutes before any batch."""
    summary = RankSummary(rank=rank)
    stats = ReadStats()
    records = []
    index = 0
    with progress_bar(desc=f"read rank {rank}", unit=" records", disable=rank != 0) as bar:
        for path in cfg.data:
            for record in iter_records(path, skip_bad=cfg.skip_bad, stats=stats):
                if cfg.limit is not None and index >= cfg.limit:
                    break
                if owns(index, rank, world_size):
                    records.append((index, record))
                index += 1
                bar.update()
    if cfg.regenerate is not None:
        records = regenerate_owned(cfg, records, tokenizer, rank, device, summary)
    processes = cfg.tokenize_processes or tokenize_processes(
        len(records), int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    )
    outcomes = tokenize_many(
        [record for _, record in records], tokenizer, cfg.max_length, processes, cfg.chat_template_kwargs
    )
    owned = progress_bar(
        iterable=zip((index for index, _ in records), outcomes),
        total=len(records),
        desc=f"tokenize rank {rank}" + (f" ({processes} processes)" if processes > 1 else ""),
        unit=" records",
        disable=rank != 0,
    )
    samples = [s for index, outcome in owned if (s := owned_sample(outcome, cfg, index, summary)) is not None]
    return samples, summary, stats


def regenerate_owned(
    cfg: ExtractConfig, records: list, tokenizer, rank: int, device: torch.device, summary: RankSummary
) -> list:
    """The owned records' samples with the target's own replies (`--regenerate`), as (sample index,
    record); the full target is loaded only while generating and freed before extraction loads its
    truncated copy."""
    from dflash_pipeline.extract.regenerate import RegenerateSettings, regenerate_records
    from dflash_pipeline.shared.generation.engine import EngineSettings
    from dflash_pipeline.shared.target.loading import load_full_target

    loaded = []

    def load_model():
        loaded.append(load_full_target(cfg.target, device=device, dtype=compute_dtype(cfg, device)))
        return loaded[-1]

    settings = RegenerateSettings.from_dict(cfg.regenerate)
    engine = EngineSettings(max_batch=cfg.gen_batch_size or (512 if device.type == "cuda" else 16))
    regenerated, stats, timing = regenerate_records(
        records,
        load_model,
        tokenizer,
        settings,
        max_length=cfg.max_length,
        cache=StoreLayout(cfg.out).regenerated_file(rank),
        rank=rank,
        engine=engine,
        template_kwargs=cfg.chat_template_kwargs,
    )
    summary.regenerated = stats.to_dict()
    summary.generated_tokens, summary.generate_seconds = timing.tokens, timing.seconds
    loaded.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return regenerated


def owned_sample(
    outcome: TokenizedSample | DataError, cfg: ExtractConfig, index: int, summary: RankSummary
) -> TokenizedSample | None:
    """A tokenized record as sample `index` of the store, counted; a refused one raised, or counted and
    dropped with --skip-bad."""
    if isinstance(outcome, DataError):
        if not cfg.skip_bad:
            raise outcome
        summary.skipped[outcome.reason] = summary.skipped.get(outcome.reason, 0) + 1
        return None
    summary.truncated += int(outcome.truncated)
    return TokenizedSample(index, outcome.input_ids, outcome.loss_mask, outcome.truncated)


def pad_batch(samples: list[TokenizedSample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, S] and the flat positions of real tokens in the [B*S] view."""
    longest = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    flat = []
    for row, s in enumerate(samples):
        ids[row, : len(s.input_ids)] = torch.from_numpy(s.input_ids.astype(np.int64))
        flat.append(torch.arange(len(s.input_ids)) + row * longest)
    return ids, torch.cat(flat)


def target_topk(model, rows: torch.Tensor, k: int, chunk_rows: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-`k` next-token ids (int32) and log-probs (float32), [R, k] each, from its
    final-normed last states `rows` [R, H]: LM head (and the config's final logit soft-cap, if any),
    log-softmax in float32 over the whole vocabulary, `torch.topk` (descending). `chunk_rows` rows
    at a time, so at most [chunk_rows, vocab] float32 logits exist at once."""
    softcap = getattr(model.config, "final_logit_softcapping", None)
    ids, logprobs = [], []
    for part in rows.split(chunk_rows):
        logits = model.lm_head(part).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        ids.append(top.indices.to(torch.int32))
        logprobs.append(top.values)
    return torch.cat(ids), torch.cat(logprobs)


class BatchRunner:
    """Runs batches through the truncated target and hands the states to the store writer; an fp8
    store's states are quantized on the device, so only codes and scales cross to the host. With
    `topk` > 0 the model is the whole target (final norm and LM head kept) and the target's top-K
    next-token distribution of every token goes with its states (`target_topk`)."""

    def __init__(
        self,
        model,
        layer_ids: list[int],
        device: torch.device,
        store_dtype: torch.dtype,
        pad_id: int,
        topk: int = 0,
    ):
        self.model = model
        self.topk = topk
        self.layers = len(layer_ids)
        self.capture = HiddenStateCapture(model, layer_ids)
        self.device = device
        self.store_dtype = store_dtype
        self.pad_id = pad_id
        self.pin = device.type == "cuda"
        # device->host copies run on their own stream, so they overlap the next batch's forward
        self.copy_stream = torch.cuda.Stream(device) if self.pin else None

    @torch.inference_mode()
    def launch(self, samples: list[TokenizedSample]):
        """Queue the forward and the device->host copy; returns what `finish` needs."""
        ids, flat = pad_batch(samples, self.pad_id)
        if self.pin:
            ids, flat = ids.pin_memory(), flat.pin_memory()
        ids = ids.to(self.device, non_blocking=True)
        flat = flat.to(self.device, non_blocking=True)
        if self.topk:
            last = self.model.model(input_ids=ids, use_cache=False).last_hidden_state
            states = self.capture.take()
        else:
            states = forward_hidden_states(self.model, self.capture, ids)
        rows = torch.cat(states, dim=-1).flatten(0, 1).index_select(0, flat)
        parts = quantize(rows, self.layers) if self.store_dtype == FP8 else (rows.to(self.store_dtype),)
        if self.topk:
            parts = (*parts, *target_topk(self.model, last.flatten(0, 1).index_select(0, flat), self.topk))
        if not self.pin:  # on CPU `parts` are already new host tensors
            return samples, parts, None
        hosts = [torch.empty(part.shape, dtype=part.dtype, pin_memory=True) for part in parts]
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            for host, part in zip(hosts, parts):
                host.copy_(part, non_blocking=True)
                part.record_stream(self.copy_stream)  # its memory is not reused before the copy is done
            event = torch.cuda.Event()
            event.record()
        return samples, hosts, event

    @staticmethod
    def collect(pending) -> list[tuple]:
        """Wait for a launched batch's copy; its (index, ids, mask, states[, scales][, topk ids, topk
        log-probs]) rows for the writer."""
        samples, hosts, event = pending
        if event is not None:
            event.synchronize()
        batch, start = [], 0
        for s in samples:
            n = len(s.input_ids)
            batch.append((s.index, s.input_ids, s.loss_mask, *(host[start : start + n] for host in hosts)))
            start += n
        return batch


def run_batches(
    runner: BatchRunner,
    samples: list[TokenizedSample],
    batches: list[list[int]],
    writer: StoreWriter,
    *,
    queue_depth: int = 2,
    progress: tqdm | None = None,
) -> tuple[int, float]:
    """Forward every batch and store it, batch i+1 queued on the device before batch i is collected.
    Returns (tokens written, seconds the forward waited for the writer)."""
    written, pending = 0, None
    with BackgroundWriter(writer, queue_depth) as sink:
        for batch in [*batches, None]:
            current = runner.launch([samples[i] for i in batch]) if batch is not None else None
            if pending is not None:
                rows = runner.collect(pending)
                sink.submit(rows)
                n = sum(len(r[1]) for r in rows)
                written += n
                if progress is not None:
                    progress.update(n)
            pending = current
    return written, sink.blocked_s


def run_rank(cfg: ExtractConfig, rank: int, world_size: int, device: torch.device, layer_ids: list[int]) -> RankSummary:
    """Extract this rank's share into its store shard; resumes from the last committed batch."""
    from dflash_pipeline.shared.target.assets import export_target_assets, load_tokenizer, target_assets_ready
    from dflash_pipeline.shared.target.loading import load_target_config, text_config

    started = time.perf_counter()
    if rank != 0:
        silence_library_bars()
    root = Path(cfg.out)
    tokenizer = load_tokenizer(cfg.target)
    samples, summary, read_stats = load_owned_samples(cfg, tokenizer, rank, world_size, device)
    lengths = [len(s.input_ids) for s in samples]
    plan = plan_batches(lengths, cfg.batch_tokens, cfg.max_batch_size)
    summary.batches = len(plan.batches)
    summary.padding = padded_fraction(lengths, plan)
    summary.samples, summary.tokens = len(samples), sum(lengths)
    summary.skipped.update({f"read:{k}": v for k, v in read_stats.skipped.items()} if rank == 0 else {})

    needs_export = rank == 0 and not target_assets_ready(root)
    model = None
    target_config = load_target_config(cfg.target)
    hidden_size = text_config(target_config).hidden_size
    writer = StoreWriter(
        root,
        rank,
        hidden_width=hidden_size * len(layer_ids),
        hidden_dtype=cfg.store_dtype,
        capacity_tokens=max(1, summary.tokens),
        capacity_samples=max(1, summary.samples),
        **{
            k: v
            for k, v in (
                ("compression", cfg.compression),
                ("chunk_tokens", cfg.chunk_tokens),
                ("shard_tokens", cfg.shard_tokens),
                ("write_streams", cfg.write_streams),
                ("scale_groups", len(layer_ids) if cfg.store_dtype in SCALED_DTYPES else None),
                ("topk", cfg.store_topk or None),
            )
            if v is not None
        },
    )
    done = writer.resume()
    summary.resumed_batches = done
    todo = plan.batches[done:]
    todo_tokens = sum(lengths[i] for b in todo for i in b)
    if rank == 0 and todo:
        warn_if_short_of_space(root, todo_tokens * world_size, writer.bytes_per_token())
    if todo or needs_export:
        dtype = compute_dtype(cfg, device)
        if cfg.store_topk:  # the top-K distribution needs every layer, the final norm and the LM head
            if rank == 0:
                progress_note(f"extract rank 0: loading the whole target on {device} (--store-topk)")
            model = load_full_target(cfg.target, device=device, dtype=dtype)
        else:
            if rank == 0:
                progress_note(f"extract rank 0: loading the target's layers 0..{max(layer_ids)} on {device}")
            model = load_truncated_target(cfg.target, layer_ids, device=device, dtype=dtype)
        if needs_export:
            export_target_assets(model, tokenizer, target_config, root)
        if not cfg.store_topk:
            drop_unused_modules(model)
        if cfg.compiled:
            compile_decoder_layers(model)
    if todo:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        runner = BatchRunner(model, layer_ids, device, getattr(torch, cfg.store_dtype), pad_id, cfg.store_topk)
        bar = progress_bar(
            total=todo_tokens, unit="tok", unit_scale=True, desc=f"extract rank {rank}", disable=rank != 0
        )
        forward_started = time.perf_counter()
        try:
            summary.computed_tokens, summary.writer_wait_s = run_batches(runner, samples, todo, writer, progress=bar)
        finally:
            summary.forward_seconds = time.perf_counter() - forward_started
            bar.close()
            runner.capture.close()
    if rank == 0:
        progress_note("extract rank 0: sealing the store shard (last writes, fsync)")
    writer.finalize()
    summary.seconds = time.perf_counter() - started
    write_rank_summary(root, summary)
    return summary


def warn_if_short_of_space(root: Path, tokens: int, bytes_per_token: int) -> None:
    """Say at the start, not hours later, when the store's disk cannot hold what is left to write. `tokens`
    is rank 0's share times the ranks (round-robin shares are even); their states dominate a real store's
    size (the codec saves ~15% of bf16 states, the target's files add a few %)."""
    need, free = tokens * bytes_per_token, free_bytes(root)
    if need > free:
        progress_note(
            f"dflash-extract: warning: the store needs about {need / 2**30:.2f} GiB more ({tokens:,} tokens x "
            f"{bytes_per_token:,} B before compression) and {root} has {free / 2**30:.2f} GiB free: it will likely "
            "stop with a full disk; free space or choose another --out"
        )


# Wall-clock times of one invocation: reported by the CLI, kept out of the store so that identical
# runs write identical bytes.
RUN_TIMES = ("seconds", "forward_seconds", "writer_wait_s", "generate_seconds")


def write_rank_summary(root: Path, summary: RankSummary) -> None:
    record = {k: v for k, v in summary.to_dict().items() if k not in RUN_TIMES}
    write_bytes_durably(StoreLayout(root).summary_file(summary.rank), json.dumps(record, indent=1).encode())
