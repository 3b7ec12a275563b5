"""Stage two end to end: one process per GPU (spawned here or by torchrun), or CPU processes."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from dflash_pipeline.shared.runtime.cluster import torchrun_refusal
from dflash_pipeline.shared.runtime.device import pick_device, resolve_devices
from dflash_pipeline.shared.runtime.launch import RankFailed, free_port, spawn_ranks
from dflash_pipeline.shared.runtime.run_lock import run_lock
from dflash_pipeline.shared.store.reader import FeatureStore
from dflash_pipeline.train.config import RESUME_HINT, TrainConfig
from dflash_pipeline.train.loop import RankResult, TrainingError, rank_entry
from dflash_pipeline.train.setup import check_store_target


def run_training(cfg: TrainConfig) -> RankResult | None:
    """Train as configured; returns rank 0's result (None on other torchrun ranks). The process
    that starts the ranks holds --out's run lock for them; under torchrun, which starts them, rank 0."""
    if cfg.target is not None:  # once per node, before any rank starts
        check_store_target(FeatureStore(cfg.store), cfg.target)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if refusal := torchrun_refusal(cfg.gpus, cfg.workers):
            raise TrainingError(refusal)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        cfg = replace(cfg, device=pick_device(cfg.device))
        result = rank_entry(rank, world, cfg, None, torchrun=True)
        return result if rank == 0 else None
    device, gpus = resolve_devices(cfg.device, cfg.gpus, default_gpus=3)
    cfg = replace(cfg, device=device, gpus=gpus)
    with run_lock(Path(cfg.out), "dflash-train"):  # held here for the ranks this process starts
        if cfg.world_size == 1:
            return rank_entry(0, 1, cfg, None)
        init = f"tcp://127.0.0.1:{free_port()}"
        try:
            return spawn_ranks(rank_entry, cfg.world_size, (cfg.world_size, cfg, init))[0]
        except RankFailed as exc:
            # a UserError's line says itself what to do (a stopped rank's names --resume); a crash's does not
            hint = "" if exc.user_error or RESUME_HINT in str(exc) else f"; {RESUME_HINT}"
            raise TrainingError(f"{exc}{hint}") from exc
