"""Where every file of a feature store lies (docs/FORMAT.md): one value that every reader and writer asks,
so no path is spelled by hand twice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1  # of the manifest and of the progress records
TOKEN_ARRAYS = ("input_ids", "loss_mask", "hidden_states")  # [T] / [T, W] arrays of a rank group
SAMPLE_ARRAYS = ("sample_offsets", "sample_index")  # its [N + 1] / [N] arrays


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
