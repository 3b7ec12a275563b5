"""Where every file of a feature store lies (docs/FORMAT.md): one value that every reader and writer asks,
so no path is spelled by hand twice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1  # of the progress records, and of the manifest and groups of stores without scales
# Of the manifest and groups of fp8 stores, which carry `hidden_scales`: a reader of version 1 refuses
# them instead of taking their codes for features. Readers accept both; other stores stay version 1.
SCALED_FORMAT_VERSION = 2
# Of the manifest and groups of stores carrying the target's top-K next-token distribution
# (`dflash-extract --store-topk K`), fp8 or not: a reader of versions 1-2 refuses them. Readers accept 1-3.
TOPK_FORMAT_VERSION = 3
SCALED_DTYPES = ("float8_e4m3fn",)  # hidden dtypes stored with one scale per (token, stored layer)
TOKEN_ARRAYS = ("input_ids", "loss_mask", "hidden_states")  # [T] / [T, W] arrays of a rank group
SCALES = "hidden_scales"  # [T, n_layers] float32 array of the groups of SCALED_DTYPES stores
# [T, K] int32 ids and float32 log-probs of the target's top-K next-token distribution at each token
# (row t predicts token t+1), in stores extracted with --store-topk K
TOPK_IDS = "target_topk_ids"
TOPK_LOGPROBS = "target_topk_logprobs"
TOPK_ARRAYS = (TOPK_IDS, TOPK_LOGPROBS)
SAMPLE_ARRAYS = ("sample_offsets", "sample_index")  # its [N + 1] / [N] arrays
FORMAT_VERSIONS = (FORMAT_VERSION, SCALED_FORMAT_VERSION, TOPK_FORMAT_VERSION)  # what readers accept


def format_version(hidden_dtype: str, topk: int = 0) -> int:
    """The format version of a store (manifest and groups) holding states of `hidden_dtype` and,
    with `topk` > 0, the target's top-`topk` distribution."""
    if topk:
        return TOPK_FORMAT_VERSION
    return SCALED_FORMAT_VERSION if hidden_dtype in SCALED_DTYPES else FORMAT_VERSION


def token_arrays(hidden_dtype: str, topk: int = 0) -> tuple[str, ...]:
    """The token-major arrays of a group holding states of `hidden_dtype` (and the top-`topk`
    distribution when `topk` > 0), in the writer's order."""
    return TOKEN_ARRAYS + ((SCALES,) if hidden_dtype in SCALED_DTYPES else ()) + (TOPK_ARRAYS if topk else ())


@dataclass(frozen=True)
class StoreLayout:
    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    MANIFEST = "manifest.json"
    TARGET = "target"
    HEAD = "target_head.safetensors"
    SHARDS = "shards"

    @property
    def manifest(self) -> Path:
        return self.root / self.MANIFEST

    @property
    def target_dir(self) -> Path:
        """The target's config, tokenizer and frozen head, so stage two never needs the checkpoint."""
        return self.root / self.TARGET

    @property
    def target_head(self) -> Path:
        return self.target_dir / self.HEAD

    TOKENIZER = "tokenizer"

    @property
    def tokenizer_dir(self) -> Path:
        return self.target_dir / self.TOKENIZER

    @property
    def shards_dir(self) -> Path:
        return self.root / self.SHARDS

    @staticmethod
    def rank_group_name(rank: int) -> str:
        """A rank's zarr group relative to the root, as the manifest records it."""
        return f"{StoreLayout.SHARDS}/rank-{rank:05d}.zarr"

    def rank_group(self, rank: int) -> Path:
        return self.root / self.rank_group_name(rank)

    def progress_file(self, rank: int) -> Path:
        return self.shards_dir / f"rank-{rank:05d}.progress.json"

    def summary_file(self, rank: int) -> Path:
        """A rank's run summary (counts, timings) for the summary rank 0 prints; not part of the data."""
        return self.shards_dir / f"rank-{rank:05d}.summary.json"

    @property
    def regenerated_dir(self) -> Path:
        """`--regenerate`: the target-written conversations, kept so a rerun does not generate them again."""
        return self.root / "regenerated"

    def regenerated_file(self, rank: int) -> Path:
        return self.regenerated_dir / f"rank-{rank:05d}.jsonl"

    def progress_files(self) -> list[Path]:
        return sorted(self.shards_dir.glob("rank-*.progress.json"))
