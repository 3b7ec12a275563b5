"""Stage one end to end: prepare the store, run one process per device, seal the manifest.

Two ways to get the processes, same code per rank:
- spawned here (`--gpus 0,1,2,3,4` or `--device cpu --workers N`): this process prepares the
  manifest, starts the workers (torch.multiprocessing, spawn), waits, then marks the store complete;
- under torchrun (RANK/WORLD_SIZE set, also multi-node): rank 0 prepares and seals, all ranks meet at
  gloo barriers (no tensors cross processes; each rank owns its own shard).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dflash.data import data_fingerprint, tokenizer_fingerprint
from dflash.extract.assets import load_tokenizer, weights_fingerprint
from dflash.extract.config import ExtractConfig
from dflash.extract.target import config_hash, load_target_config, parse_layer_ids, text_config
from dflash.extract.worker import RankSummary, run_rank
from dflash.shared import manifest as mf
from dflash.shared.drafter import default_target_layer_ids
from dflash.shared.launch import RankFailed, UserError, spawn_ranks

BARRIER_TIMEOUT = timedelta(days=7)  # ranks finish at different times; never time out a long run


class ExtractError(UserError, RuntimeError):
    """A run that cannot start or did not finish; the message is meant for the user as is."""


@dataclass
class RunSummary:
    root: Path
    samples: int
    tokens: int
    truncated: int
    skipped: dict
    computed_tokens: int
    seconds: float
    store_bytes: int
    resumed: bool
    already_complete: bool = False
    regenerated: dict | None = None
    writer_wait_s: float = 0.0  # the longest any rank's forward waited for its store writer

    def lines(self) -> list[str]:
        rate = self.computed_tokens / self.seconds if self.seconds > 0 else 0.0
        per_token = self.store_bytes / max(1, self.tokens)
        skipped = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return [
            f"store      {self.root}" + ("  (already complete: nothing to do)" if self.already_complete else ""),
            f"samples    {self.samples}   tokens {self.tokens}   truncated {self.truncated}   skipped {skipped}",
            f"computed   {self.computed_tokens} tokens in {self.seconds:.1f} s ({rate:,.0f} tok/s)"
            + ("   resumed from committed batches" if self.resumed else "")
            + (f"   (forward waited {self.writer_wait_s:.1f} s for storage)" if self.writer_wait_s >= 0.1 else ""),
            f"on disk    {self.store_bytes / 2**20:,.1f} MiB ({per_token:,.0f} B/token)",
        ] + ([] if not self.regenerated else [
            "regenerated " + "   ".join(f"{k} {v}" for k, v in self.regenerated.items()),
        ])


def resolve_devices(cfg: ExtractConfig) -> ExtractConfig:
    """Default GPUs: the first five visible (or all, if fewer); CPU when there is no CUDA."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        if cfg.gpus:
            raise ExtractError(f"--gpus {','.join(map(str, cfg.gpus))} given but CUDA is not available")
        return replace(cfg, device="cpu")
    if cfg.device == "cuda" and not cfg.gpus:
        return replace(cfg, gpus=tuple(range(min(5, torch.cuda.device_count()))))
    if cfg.device == "cuda":
        bad = [g for g in cfg.gpus if g >= torch.cuda.device_count()]
        if bad:
            raise ExtractError(f"--gpus: GPU {bad[0]} does not exist ({torch.cuda.device_count()} visible)")
    return cfg


def plan_identity(cfg: ExtractConfig, layer_ids: list[int], world_size: int) -> dict:
    """Everything that must be equal for a rerun to continue the same store."""
    return {
        "layer_ids": layer_ids,
        "world_size": world_size,
        "batch_tokens": cfg.batch_tokens,
        "max_batch_size": cfg.max_batch_size,
        "compute_dtype": cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cfg.device == "cuda" else "float32"),
        "store_dtype": cfg.store_dtype,
        "compiled": cfg.compiled,  # compiled and eager kernels round differently
        "compression": cfg.compression,
        "chunk_tokens": cfg.chunk_tokens,
        "shard_tokens": cfg.shard_tokens,
    }


def prepare_store(cfg: ExtractConfig, world_size: int) -> tuple[list[int], bool]:
    """Create or validate `ROOT/manifest.json`; returns (layer ids, store already complete)."""
    root = Path(cfg.out)
    target_config = load_target_config(cfg.target)
    tc = text_config(target_config)
    layer_ids = parse_layer_ids(cfg.layers, tc.num_hidden_layers, default_target_layer_ids(tc.num_hidden_layers))
    tokenizer = load_tokenizer(cfg.target)
    fresh = mf.new_manifest(
        target={
            "name_or_path": str(cfg.target),
            "architecture": (target_config.architectures or [type(target_config).__name__])[0],
            "config_hash": config_hash(target_config),
            "num_layers": tc.num_hidden_layers,
            "hidden_size": tc.hidden_size,
            "vocab_size": tc.vocab_size,
            "layer_ids": layer_ids,
        },
        hidden_dtype=cfg.store_dtype,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        data={
            "paths": [str(p) for p in cfg.data],
            "fingerprint": data_fingerprint([Path(p) for p in cfg.data], cfg.data_settings()),
            **cfg.data_settings(),
        },
        settings={"plan": plan_identity(cfg, layer_ids, world_size), "regenerate": cfg.regenerate},
        world_size=world_size,
    )
    if (root / mf.MANIFEST_FILE).exists() and cfg.overwrite:
        shutil.rmtree(root)
    if (root / mf.MANIFEST_FILE).exists():
        existing = mf.load_manifest(root)
        differences = mf.resume_differences(existing, fresh)
        if differences:
            raise ExtractError(
                f"{root}: holds a store made with other settings ({'; '.join(differences)}); "
                "use another --out, or --overwrite to replace it"
            )
        return layer_ids, existing.complete
    if root.exists() and any(root.iterdir()):
        raise ExtractError(f"{root}: exists, is not empty and holds no dflash store; choose an empty --out")
    root.mkdir(parents=True, exist_ok=True)
    mf.write_manifest(root, fresh)
    return layer_ids, False


def seal_store(cfg: ExtractConfig, summaries: list[RankSummary]) -> None:
    """Mark the store complete once every rank has finalized its shard."""
    root = Path(cfg.out)
    manifest = mf.load_manifest(root)
    shards = [
        {"rank": s.rank, "path": f"shards/rank-{s.rank:05d}.zarr", "samples": s.samples, "tokens": s.tokens}
        for s in sorted(summaries, key=lambda s: s.rank)
    ]
    mf.mark_complete(root, manifest, shards=shards, weights_fingerprint=weights_fingerprint(root),
                     counts=merge_counts(summaries))


def merge_counts(summaries: list[RankSummary]) -> dict:
    skipped: dict[str, int] = {}
    for s in summaries:
        for k, v in s.skipped.items():
            skipped[k] = skipped.get(k, 0) + v
    counts = {
        "samples": sum(s.samples for s in summaries),
        "tokens": sum(s.tokens for s in summaries),
        "truncated": sum(s.truncated for s in summaries),
        "skipped": skipped,
    }
    regenerated = [s.regenerated for s in summaries if s.regenerated is not None]
    if regenerated:
        counts["regenerated"] = {k: sum(r[k] for r in regenerated) for k in regenerated[0]}
    return counts


def rank_device(cfg: ExtractConfig, rank: int, local_rank: int | None = None) -> torch.device:
    if cfg.device == "cpu":
        return torch.device("cpu")
    gpu = local_rank if local_rank is not None else cfg.gpus[rank]
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _spawned_rank(rank: int, cfg: ExtractConfig, layer_ids: list[int]) -> RankSummary:
    if cfg.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.world_size))
    return run_rank(cfg, rank, cfg.world_size, rank_device(cfg, rank), layer_ids)


def run_spawned(cfg: ExtractConfig, layer_ids: list[int]) -> list[RankSummary]:
    try:
        return spawn_ranks(_spawned_rank, cfg.world_size, (cfg, layer_ids))
    except RankFailed as exc:
        raise ExtractError(f"{exc}; rerun the same command to resume from the last committed batch") from exc


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_torchrun(cfg: ExtractConfig) -> RunSummary | None:
    """Body of every torchrun process; rank 0 returns the summary."""
    dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    started = time.perf_counter()
    try:
        cfg = replace(cfg, gpus=tuple(range(world)) if cfg.device == "cuda" else (), workers=world)
        status = [None]
        if rank == 0:
            try:
                status = [prepare_store(cfg, world)]
            except Exception as exc:  # noqa: BLE001 - other ranks must learn of it, not hang
                status = [("error", str(exc))]
        dist.broadcast_object_list(status, src=0)
        if status[0][0] == "error":
            raise ExtractError(status[0][1])
        layer_ids, complete = status[0]
        summary = None if complete else run_rank(cfg, rank, world, rank_device(cfg, rank, local_rank), layer_ids)
        gathered = [None] * world
        dist.all_gather_object(gathered, summary)
        if rank == 0 and not complete:
            seal_store(cfg, gathered)
        dist.barrier()
        return summarize(cfg, gathered, started, complete) if rank == 0 else None
    finally:
        dist.destroy_process_group()


def run_extraction(cfg: ExtractConfig) -> RunSummary | None:
    """Run stage one as configured; returns the summary (None on torchrun ranks other than 0)."""
    if under_torchrun():
        return run_torchrun(cfg)
    cfg = resolve_devices(cfg)
    started = time.perf_counter()
    layer_ids, complete = prepare_store(cfg, cfg.world_size)
    if complete:
        return summarize(cfg, [], started, True)
    summaries = run_spawned(cfg, layer_ids) if cfg.world_size > 1 or cfg.device == "cuda" else [
        run_rank(cfg, 0, 1, torch.device("cpu"), layer_ids)
    ]
    seal_store(cfg, summaries)
    return summarize(cfg, summaries, started, False)


def summarize(cfg: ExtractConfig, summaries: list[RankSummary | None], started: float, complete: bool) -> RunSummary:
    root = Path(cfg.out)
    manifest = mf.load_manifest(root)
    counts = manifest.data.get("counts", {})
    done = [s for s in summaries if s is not None]
    return RunSummary(
        root=root,
        samples=counts.get("samples", 0),
        tokens=counts.get("tokens", 0),
        truncated=counts.get("truncated", 0),
        skipped=counts.get("skipped", {}),
        computed_tokens=sum(s.computed_tokens for s in done),
        seconds=time.perf_counter() - started,
        store_bytes=sum(f.stat().st_size for f in root.rglob("*") if f.is_file()),
        resumed=any(s.resumed_batches for s in done),
        already_complete=complete,
        regenerated=counts.get("regenerated"),
        writer_wait_s=max((s.writer_wait_s for s in done), default=0.0),
    )
