"""Stage two end to end: one process per GPU (spawned here or by torchrun), or CPU processes."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from dflash_pipeline.shared.cluster import torchrun_refusal
from dflash_pipeline.shared.device import gpus_on_cpu, pick_device
from dflash_pipeline.shared.launch import RankFailed, free_port, spawn_ranks
from dflash_pipeline.shared.store import FeatureStore
from dflash_pipeline.train.config import TrainConfig
from dflash_pipeline.train.loop import RESUME_HINT, RankResult, TrainingError, rank_entry
from dflash_pipeline.train.setup import check_store_target


def resolve_devices(cfg: TrainConfig) -> TrainConfig:
    """Default GPUs: three if available (else all visible); `auto` is CUDA when there is one."""
    if refusal := gpus_on_cpu(cfg.gpus, cfg.device):
        raise TrainingError(refusal)
    cfg = replace(cfg, device=pick_device(cfg.device))
    if cfg.device == "cuda" and not cfg.gpus:
        return replace(cfg, gpus=tuple(range(min(3, torch.cuda.device_count()))))
    return cfg


def run_training(cfg: TrainConfig) -> RankResult | None:
    """Train as configured; returns rank 0's result (None on other torchrun ranks)."""
    if cfg.target is not None:  # once per node, before any rank starts
        check_store_target(FeatureStore(cfg.store), cfg.target)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if refusal := torchrun_refusal(cfg.gpus, cfg.workers):
            raise TrainingError(refusal)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        cfg = replace(cfg, device=pick_device(cfg.device))
        result = rank_entry(rank, world, cfg, None)
        return result if rank == 0 else None
    cfg = resolve_devices(cfg)
    if cfg.world_size == 1:
        return rank_entry(0, 1, cfg, None)
    init = f"tcp://127.0.0.1:{free_port()}"
    try:
        return spawn_ranks(rank_entry, cfg.world_size, (cfg.world_size, cfg, init))[0]
    except RankFailed as exc:
        raise TrainingError(f"{exc}; {RESUME_HINT}") from exc
