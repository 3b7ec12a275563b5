"""Each rank's progress record (`shards/rank-XXXXX.progress.json`, docs/FORMAT.md): what the writer
has made durable. The manifest is sealed from these records, and a rerun asks them whether anything
was committed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_pipeline.shared.store.errors import StoreError, StoreIncomplete, StoreMismatch
from dflash_pipeline.shared.store.layout import FORMAT_VERSION, StoreLayout


@dataclass
class ShardEntry:
    """One rank's zarr group, relative to the store root, and what it holds once finished."""

    rank: int
    path: str
    samples: int
    tokens: int


def read_progress(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise StoreIncomplete(f"{path}: no progress record (this rank never started)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{path}: corrupt progress record ({exc})") from None
    if not isinstance(record, dict) or record.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{path}: unknown progress record format (expected format_version {FORMAT_VERSION})")
    return record


def finished_shards(root: str | Path, world_size: int) -> tuple[list[ShardEntry], dict[str, Any]]:
    """The shard list and the common layout of a finished store, from the ranks' progress records.

    Raises StoreIncomplete naming the ranks that are not done, StoreMismatch if layouts differ.
    """
    entries, layouts, unfinished = [], [], []
    for rank in range(world_size):
        record = read_progress(StoreLayout(root).progress_file(rank))
        if not record["done"]:
            unfinished.append(str(rank))
        layouts.append({k: v for k, v in record["layout"].items() if not k.startswith("capacity_")})
        entries.append(
            ShardEntry(
                rank=rank, path=StoreLayout.rank_group_name(rank), samples=record["samples"], tokens=record["tokens"]
            )
        )
    if unfinished:
        raise StoreIncomplete(f"{root}: ranks {', '.join(unfinished)} have not finished")
    if any(layout != layouts[0] for layout in layouts):
        raise StoreMismatch(f"{root}: ranks were written with different layouts ({layouts})")
    return entries, layouts[0] if layouts else {"compression": None, "chunk_tokens": None, "shard_tokens": None}


def any_rank_committed(root: str | Path) -> bool:
    """Whether some rank's progress record holds a committed batch or sample (an unreadable record
    counts as one: it may): a store for which this is False holds nothing worth keeping."""
    for path in StoreLayout(root).progress_files():
        try:
            record = read_progress(path)
        except StoreError:
            return True
        if record.get("batches") or record.get("samples"):
            return True
    return False
