"""Settings of one training run (picklable: every DDP process gets a copy)."""

from __future__ import annotations

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
    loader_workers: int = 2
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
    device: str = "cuda"
    gpus: tuple[int, ...] = ()
    workers: int = 1  # processes with device=cpu
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

    def to_dict(self) -> dict:
        return asdict(self)
