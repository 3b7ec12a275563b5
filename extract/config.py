"""Settings of one extraction run (picklable: every worker process gets a copy)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import click

from dflash_pipeline.extract.regenerate import RegenerateSettings
from dflash_pipeline.shared.runtime.config import ConfigError, IntList, JsonObject, check_options, option
from dflash_pipeline.shared.runtime.device import DEVICE_CHOICES, DEVICE_HELP


@dataclass(frozen=True)
class ExtractConfig:
    """`dflash-extract`'s options: each field is one (see `shared.runtime.config.option`)."""

    target: str = option(help="HF model folder (or a folder with one .gguf) of the frozen target.")
    data: tuple[str, ...] = option(
        multiple=True, help="JSONL/JSON/Parquet/Arrow file or folder of them; repeat for several."
    )
    out: str = option(type=click.Path(file_okay=False), help="Store folder (created; reruns resume it).")
    layers: str | None = option(None, help="Target layer ids to store, e.g. 1,9,17,25,33 [default: reference spacing].")
    max_length: int = option(3072, range=(2, None), help="Truncate samples to this many tokens.")
    batch_tokens: int = option(16384, range=(1, None), help="Padded tokens per forward batch.")
    max_batch_size: int = option(64, range=(1, None), help="Samples per forward batch at most.")
    skip_bad: bool = option(False, help="Skip and count malformed records instead of failing.")
    limit: int | None = option(None, range=(1, None), help="Use only the first N records.")
    chat_template_kwargs: dict | None = option(
        None, type=JsonObject(), help="Options of the chat template, e.g. '{\"enable_thinking\": false}' for Qwen3."
    )
    gpus: tuple[int, ...] = option(
        (), type=IntList(), help="GPU ids, one process each [default: 5 if available, else all]."
    )
    device: str = option("auto", choices=DEVICE_CHOICES, help=DEVICE_HELP)
    workers: int = option(1, range=(1, None), help="Processes with --device cpu.")
    collective_timeout: float = option(
        300.0,
        range=(1, None),
        help="torchrun: seconds a rank may go without answering (frozen or cut-off node) "
        "before the others stop naming it; slow work is waited for while its rank answers.",
    )
    dtype: str = option(
        "auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="Compute dtype (auto: bf16 on GPU, fp32 on CPU).",
    )
    store_dtype: str = option(
        "bfloat16",
        choices=("bfloat16", "float16", "float32", "float8_e4m3fn"),
        help="dtype of the stored states; float8_e4m3fn halves bf16's bytes (one scale per token and layer).",
    )
    store_topk: int = option(
        0,
        range=(0, None),
        help="Also store the target's top-K next-token ids and log-probs at every token (runs the whole "
        "target and its LM head; K=16 adds 128 B/token), for dflash-train --loss kl/mix [default: 0, none].",
    )
    compile: bool | None = option(
        None,
        flag="--compile/--no-compile",
        help="Compile the decoder layers (fused norms/activations) [default: on GPU, off on CPU].",
    )
    compression: str | None = option(
        None, help="Store codec, e.g. none, zstd:1 [default: the store's measured default]."
    )
    chunk_tokens: int | None = option(None, range=(1, None), help="Tokens per zarr chunk.")
    shard_tokens: int | None = option(None, range=(1, None), help="Tokens per zarr shard (multiple of chunk).")
    write_streams: int | None = option(
        None,
        range=(1, None),
        help="Shard files each rank writes at once (more for disks that want deeper queues) [default: 4].",
    )
    overwrite: bool = option(False, help="Replace an existing store made with other settings.")
    # RegenerateSettings.to_dict() of --regenerate; its options follow this flag's
    regenerate: dict | None = option(
        None, settings=RegenerateSettings, help="First replace every assistant reply by the target's own."
    )
    gen_batch_size: int | None = option(
        None,
        range=(1, None),
        help="--regenerate: requests decoded together (continuous batching) [default: 512 on GPU, 16 on CPU].",
    )
    tokenize_processes: int | None = option(
        None,
        range=(1, None),
        help="Processes tokenizing each rank's records (chat templates are pure Python: a few hundred "
        "conversations a second each) [default: the rank's share of the host's cores, at most one per "
        "1,000 records].",
    )

    def __post_init__(self) -> None:
        check_options(self)
        if self.chunk_tokens and self.shard_tokens and self.shard_tokens % self.chunk_tokens:
            raise ConfigError(
                f"--shard-tokens {self.shard_tokens} is not a multiple of --chunk-tokens {self.chunk_tokens}"
            )

    @property
    def compiled(self) -> bool:
        return self.compile if self.compile is not None else self.device == "cuda"

    @property
    def world_size(self) -> int:
        return len(self.gpus) if self.device == "cuda" else self.workers

    def data_settings(self) -> dict:
        """What, besides the input bytes, decides which tokens are stored."""
        return {
            "max_length": self.max_length,
            "skip_bad": self.skip_bad,
            "limit": self.limit,
            "regenerate": self.regenerate,
            "chat_template_kwargs": self.chat_template_kwargs,
        }

    def to_dict(self) -> dict:
        return asdict(self)
