"""Settings of one training run (picklable: every DDP process gets a copy)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TrainConfig:
    store: str
    out: str
    # drafter shape
    num_layers: int = 5
    block_size: int = 16
    mask_token_id: int | None = None  # None: the tokenizer's mask token, else the first unused row
    gamma: float | None = None  # loss decay; None: the reference value for the block size
    # data
    pack_tokens: int = 4096
    num_blocks: int = 256  # blocks (anchors) per pack
    max_anchors_per_sample: int = 512
    packs_per_step: int = 1  # per rank
    eval_samples: int = 64
    loader_workers: int | None = None  # per rank; None: `resolved_loader_workers`
    # optimisation (paper: AdamW 6e-4, cosine, 4% warmup, clip 1.0, 6 epochs)
    epochs: int = 6
    max_steps: int | None = None
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    # execution
    device: str = "auto"  # "auto" (CUDA if there is one), "cuda" or "cpu"
    gpus: tuple[int, ...] = ()
    workers: int = 1  # processes with device=cpu
    collective_timeout: float = 300.0  # seconds a rank may go silent before the others stop
    attention: str = "auto"  # auto | flex_compiled | flex_eager | sdpa_dense
    # bookkeeping
    log_every: int = 1
    eval_every: int = 100
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    resume: bool = False
    target: str | None = None  # optional: refuse a store whose target differs from this one

    @property
    def world_size(self) -> int:
        return len(self.gpus) if self.device == "cuda" else self.workers

    def resolved_loader_workers(self, ranks_per_host: int) -> int:
        """On GPU the loader decodes ~170 MB per 4k pack of an 8B target's states, one pack per
        worker at ~4/s on an H200 host's cores, while a step consumes ~8/s: give each rank its share
        of the host's cores (one kept for the rank itself). On CPU the ranks need the cores: 2."""
        if self.loader_workers is not None:
            return self.loader_workers
        if self.device != "cuda":
            return 2
        return max(2, (os.cpu_count() or 2) // max(1, ranks_per_host) - 1)

    def to_dict(self) -> dict:
        return asdict(self)
