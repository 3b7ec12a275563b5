"""Settings of one training run (picklable: every DDP process gets a copy)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import click

from dflash_pipeline.shared.model.config import LAYER_TYPES
from dflash_pipeline.shared.runtime.config import ChoiceList, ConfigError, IntList, check_options, option
from dflash_pipeline.shared.runtime.device import DEVICE_CHOICES, DEVICE_HELP

RESUME_HINT = "rerun with --resume to continue from the last checkpoint"  # what a stopped run says


@dataclass(frozen=True)
class TrainConfig:
    """`dflash-train`'s options: each field is one (see `shared.runtime.config.option`). The field order
    is the key order of a run's train_config.json."""

    store: str = option(type=click.Path(file_okay=False), help="Store written by dflash-extract.")
    out: str = option(type=click.Path(file_okay=False), help="Run folder: checkpoints, metrics, drafter/.")
    # drafter shape
    num_layers: int = option(5, range=(1, None), help="Drafter decoder layers.")
    block_size: int = option(16, range=(2, None), help="Tokens per draft block.")
    mask_token_id: int | None = option(None, help="[default: tokenizer mask token, else first unused row]")
    gamma: float | None = option(None, help="Loss decay over block positions [default: 7 for B=16].")
    # data
    pack_tokens: int = option(4096, range=(128, None), help="Context tokens per pack (multiple of 128).")
    num_blocks: int = option(256, range=(1, None), help="Blocks (anchors) per pack.")
    max_anchors_per_sample: int = option(512, range=(1, None))
    packs_per_step: int = option(1, range=(1, None), help="Packs per GPU per optimizer step.")
    eval_samples: int = option(64, range=(0, None), help="Held-out samples for offline acceptance.")
    eval_decode: bool = option(
        True,
        flag="--eval-decode/--no-eval-decode",
        help="Also log tau_decode: a block at every anchor of the held-out replies, walked along the chain "
        "greedy decoding takes (~30x the evaluation's drafter forwards; minutes per evaluation on a CPU).",
    )
    eval_decode_head: int = option(
        96,
        range=(1, None),
        help="Also log tau_decode_head: the chain's steps within the first N tokens of each held-out reply, "
        "what an online evaluation of N new tokens decodes.",
    )
    loader_workers: int | None = option(  # None: `resolved_loader_workers`
        None,
        range=(0, None),
        help="DataLoader worker processes per rank [default: on GPU the host's cores shared by its ranks, on CPU 2].",
    )
    # optimisation (paper: AdamW 6e-4, cosine, 4% warmup, clip 1.0, 6 epochs)
    epochs: int = option(6, range=(1, None))
    max_steps: int | None = option(None, range=(1, None))
    lr: float = option(6e-4)
    min_lr_ratio: float = option(0.0)
    warmup_ratio: float = option(0.04)
    weight_decay: float = option(0.0)
    grad_clip: float = option(1.0)
    seed: int = option(0)
    # execution
    device: str = option("auto", choices=DEVICE_CHOICES, help=DEVICE_HELP)
    gpus: tuple[int, ...] = option(
        (), type=IntList(), help="GPU ids, one DDP process each [default: 3 if available, else all]."
    )
    workers: int = option(1, range=(1, None), help="DDP processes with --device cpu (gloo).")
    collective_timeout: float = option(
        300.0,
        range=(1, None),
        help="Several processes: seconds a rank may go without answering (frozen or cut-off "
        "node) before the others stop naming it; slow work is waited for while its rank answers.",
    )
    attention: str = option(
        "auto",
        choices=("auto", "flex_compiled", "flex_eager", "sdpa_dense"),
        help="auto: compiled flex_attention on GPU, dense SDPA on CPU.",
    )
    # bookkeeping
    log_every: int = option(1, range=(1, None))
    eval_every: int = option(100, range=(1, None))
    checkpoint_every: int = option(200, range=(1, None))
    keep_checkpoints: int = option(2, range=(1, None))
    resume: bool = option(False, help="Continue from the latest checkpoint in --out.")
    target: str | None = option(None, help="Optional: refuse the store unless it was extracted from this target.")
    # drafter architecture (appended last: train_config.json's earlier keys keep their order)
    arch: str = option(
        "dflash",
        choices=("dflash", "dflash2"),
        help="dflash: DFlashDraftModel; dflash2: DFlash2DraftModel (block convolutions, candidate selector).",
    )
    # DFlash-2 only (ignored with --arch dflash); defaults of a released DFlash-2 drafter
    conv_kernel_size: int = option(2, range=(1, None), help="DFlash-2: causal convolution kernel size.")
    conv_group_size: int = option(
        16, range=(1, None), help="DFlash-2: channels per convolution group (must divide the target hidden size)."
    )
    selector_rank: int = option(256, range=(1, None), help="DFlash-2: rank of the candidate selector's codebooks.")
    selector_top_k: int = option(16, range=(1, None), help="DFlash-2: draft candidates the selector re-ranks.")
    selector_loss_weight: float = option(
        1.0, range=(0, None), help="DFlash-2: weight of the selector's loss next to the draft CE."
    )
    # attention of the drafter's layers (either arch), saved in config.json where the reference reads it
    sliding_window: int | None = option(
        None, range=(1, None), help="Attention window of the sliding_attention layers [default: no window]."
    )
    layer_types: tuple[str, ...] = option(
        (),
        type=ChoiceList(LAYER_TYPES),
        help="full_attention or sliding_attention for each drafter layer, comma-separated "
        "[default: every layer sliding_attention with --sliding-window, else full_attention].",
    )
    is_causal: bool = option(False, help="Causal attention inside the draft block, in every layer.")
    # the draft loss (appended last, as above)
    loss: str = option(
        "ce",
        choices=("ce", "kl", "mix"),
        help="Draft loss: ce on the stored tokens; kl from the target's stored top-K distribution "
        "(renormalised; needs a store made with dflash-extract --store-topk); mix: (1-w)*ce + w*kl, "
        "w = --kl-weight. Same position weights; DFlash-2: the draft term only.",
    )
    kl_weight: float = option(0.5, range=(0, 1), help="--loss mix: the weight w of the KL term.")
    # how the step runs (appended last, as above)
    compile_drafter: bool | None = option(
        None,
        flag="--compile-drafter/--no-compile-drafter",
        help="Compile the drafter's training forward and backward as one graph (attention inside it) "
        "and the loss's chunks: fewer, fused kernels for a step whose small drafter leaves the GPU "
        "waiting on the host [default: on a GPU; on a CPU compiling takes longer than a short run].",
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.pack_tokens % 128 or (self.num_blocks * self.block_size) % 128:
            raise ConfigError(
                f"--pack-tokens ({self.pack_tokens}) and --num-blocks x --block-size "
                f"({self.num_blocks * self.block_size}) must be multiples of 128 (flex_attention block granularity)"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"--layer-types names {len(self.layer_types)} layers, --num-layers is {self.num_layers}")
        sliding = "sliding_attention" in self.layer_types
        if self.layer_types and (self.sliding_window is not None) != sliding:
            raise ConfigError(
                "--layer-types sliding_attention needs --sliding-window"
                if self.sliding_window is None
                else "--sliding-window needs a sliding_attention layer in --layer-types"
            )

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

    def compiles_drafter(self, device_type: str) -> bool:
        """--compile-drafter / --no-compile-drafter, else on a GPU only: there it halves the step of a
        small drafter (bench/RESULTS.md); on a CPU compiling takes longer than a short run gains."""
        return device_type == "cuda" if self.compile_drafter is None else self.compile_drafter

    def to_dict(self) -> dict:
        return asdict(self)
