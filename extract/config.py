"""Settings of one extraction run (picklable: every worker process gets a copy)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class ExtractConfig:
    target: str
    data: tuple[str, ...]
    out: str
    layers: str | None = None  # "1,9,17" or None for the reference default
    max_length: int = 3072
    batch_tokens: int = 16384
    max_batch_size: int = 64
    skip_bad: bool = False
    limit: int | None = None  # use only the first N records (smoke runs)
    device: str = "auto"  # "auto" (CUDA if there is one), "cuda" or "cpu"
    gpus: tuple[int, ...] = ()  # physical GPU ids, one process each
    workers: int = 1  # processes on CPU
    dtype: str = "auto"  # compute dtype: auto = bf16 on GPU, fp32 on CPU
    store_dtype: str = "bfloat16"
    compile: bool | None = None  # compile the decoder layers; None: on GPU only
    compression: str | None = None  # None: the store's measured default
    chunk_tokens: int | None = None
    shard_tokens: int | None = None
    write_streams: int | None = None  # shard files written at once per rank; None: the store's default
    overwrite: bool = False
    regenerate: dict | None = field(default=None)  # RegenerateSettings.to_dict() of --regenerate
    gen_batch_size: int | None = None  # --regenerate: requests decoded together; None: 512 on GPU, 16 on CPU
    chat_template_kwargs: dict | None = None  # options of the chat template, e.g. {"enable_thinking": False}
    collective_timeout: float = 300.0  # torchrun: seconds a rank may go silent before the others stop

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
