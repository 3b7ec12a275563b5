"""The feature store's manifest: one JSON file saying what a store holds and whether it is complete.

Stage two trusts a store only through this file, so it is written atomically (temp file, fsync,
rename, directory fsync) and read strictly: a missing, corrupt or newer-format manifest is a clear
one-line error, never a guess. `check_compatible` is the single place where a consumer states what it
expects (target config, layer ids, hidden size) and gets a `StoreMismatch` naming the store and the
first field that differs. See docs/FORMAT.md for every field.

API: `Manifest` (dataclass; `to_dict`/`from_dict`), `new_manifest(...)` at the start of a run,
`resume_differences(existing, fresh)` before continuing one, `mark_complete(root, manifest, shards=...)`
at the end (checks the ranks' progress records, then writes: the store's commit point),
`write_manifest`, `load_manifest`, `check_compatible`, and the errors `ManifestError`,
`StoreIncomplete`, `StoreMismatch` (all `StoreError`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_pipeline.shared.runtime.durable import write_bytes_durably
from dflash_pipeline.shared.store.errors import ManifestError, StoreError, StoreIncomplete, StoreMismatch
from dflash_pipeline.shared.store.layout import (
    FORMAT_VERSIONS,
    SCALED_DTYPES,
    StoreLayout,
    format_version,
)
from dflash_pipeline.shared.store.progress import ShardEntry, finished_shards

# The physical zarr dtype that carries each logical hidden-state dtype (zarr 3.1 has neither bfloat16
# nor float8: their bit patterns are stored).
STORAGE_DTYPES = {"bfloat16": "uint16", "float16": "float16", "float32": "float32", "float8_e4m3fn": "uint8"}
TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}

__all__ = [
    "Manifest",
    "ManifestError",
    "STORAGE_DTYPES",
    "ShardEntry",
    "StoreError",
    "TORCH_DTYPES",
    "StoreIncomplete",
    "StoreMismatch",
    "check_compatible",
    "load_manifest",
    "mark_complete",
    "new_manifest",
    "resume_differences",
    "write_manifest",
]


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# Keys of `Manifest.target`; `weights_fingerprint` is filled when the store is marked complete.
TARGET_KEYS = ("name_or_path", "architecture", "config_hash", "num_layers", "hidden_size", "layer_ids", "vocab_size")


@dataclass
class Manifest:
    target: dict[str, Any]
    hidden_dtype: str
    world_size: int
    tokenizer_fingerprint: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    shards: list[ShardEntry] = field(default_factory=list)
    complete: bool = False
    created: str = field(default_factory=utc_now)
    finished: str | None = None
    # The layout the rank groups were written with; recorded from their progress records at completion.
    compression: str | None = None
    chunk_tokens: int | None = None
    shard_tokens: int | None = None
    target_dir: str = StoreLayout.TARGET
    format_version: int | None = None  # None: the version of `hidden_dtype` and `store_topk` (layout.format_version)
    # K of the target's top-K next-token distribution stored at every token (--store-topk); 0: none.
    # Serialized only when set, so stores without it keep their manifest bytes.
    store_topk: int = 0
    # Where the manifest was loaded from; used in error messages, never serialized.
    root: str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        where = self.root or "manifest"
        if self.hidden_dtype not in STORAGE_DTYPES:
            raise ManifestError(f"{where}: hidden_dtype {self.hidden_dtype!r} is not one of {sorted(STORAGE_DTYPES)}")
        if not isinstance(self.store_topk, int) or self.store_topk < 0:
            raise ManifestError(f"{where}: store_topk {self.store_topk!r} is not a count >= 0")
        version = format_version(self.hidden_dtype, self.store_topk)
        if self.format_version not in (None, version):
            raise ManifestError(
                f"{where}: format_version {self.format_version} does not hold hidden_dtype {self.hidden_dtype!r}"
                f" with store_topk {self.store_topk}"
            )
        self.format_version = version
        missing = [k for k in TARGET_KEYS if k not in self.target]
        if missing:
            raise ManifestError(f"{where}: target lacks {', '.join(missing)}")
        self.target = {**self.target, "layer_ids": [int(i) for i in self.target["layer_ids"]]}
        self.target.setdefault("weights_fingerprint", "")
        self.shards = [s if isinstance(s, ShardEntry) else ShardEntry(**s) for s in self.shards]

    @property
    def storage_dtype(self) -> str:
        return STORAGE_DTYPES[self.hidden_dtype]

    @property
    def layer_ids(self) -> list[int]:
        return list(self.target["layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.target["hidden_size"])

    @property
    def hidden_width(self) -> int:
        """W of the stored [tokens, W] hidden states: the chosen layers side by side."""
        return len(self.layer_ids) * self.hidden_size

    @property
    def scale_groups(self) -> int:
        """Scales per token in `hidden_scales` (one per stored layer); 0 for stores without scales."""
        return len(self.layer_ids) if self.hidden_dtype in SCALED_DTYPES else 0

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("root")
        if not self.store_topk:
            out.pop("store_topk")
        out["storage_dtype"] = self.storage_dtype
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, root: str | None = None) -> Manifest:
        where = root or "manifest"
        version = d.get("format_version")
        if version not in FORMAT_VERSIONS:
            raise ManifestError(
                f"{where}: format_version {version!r} is not supported "
                f"(this code reads {', '.join(map(str, FORMAT_VERSIONS))})"
            )
        try:
            manifest = cls(**{k: v for k, v in d.items() if k != "storage_dtype"}, root=root)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"{where}: malformed manifest ({exc.__class__.__name__}: {exc})") from exc
        if d.get("storage_dtype", manifest.storage_dtype) != manifest.storage_dtype:
            raise ManifestError(
                f"{where}: storage_dtype {d['storage_dtype']!r} does not carry hidden_dtype {manifest.hidden_dtype!r}"
            )
        return manifest


def new_manifest(
    *,
    target: dict[str, Any],
    hidden_dtype: str,
    world_size: int,
    tokenizer_fingerprint: str = "",
    data: dict[str, Any] | None = None,
    settings: dict[str, Any] | None = None,
    store_topk: int = 0,
) -> Manifest:
    """The manifest an extraction starts with: incomplete, no shards, created now."""
    return Manifest(
        store_topk=store_topk,
        target=dict(target),
        hidden_dtype=hidden_dtype,
        world_size=world_size,
        tokenizer_fingerprint=tokenizer_fingerprint,
        data=dict(data or {}),
        settings=dict(settings or {}),
    )


# Filled in at completion, so they may differ between a running store and a rerun's fresh manifest.
_SET_AT_COMPLETION = {
    "complete",
    "created",
    "finished",
    "shards",
    "compression",
    "chunk_tokens",
    "shard_tokens",
    "storage_dtype",
    "target.weights_fingerprint",
    "data.counts",
}
# Paths as the user typed them, kept for people: the same files spelled another way (relative, `./`,
# through a symlink) must resume, so what they name is compared through `data.fingerprint` (content)
# and `target.location` (the resolved target) instead.
_AS_TYPED = {"data.paths", "target.name_or_path"}
_NOT_COMPARED = _SET_AT_COMPLETION | _AS_TYPED


def resume_differences(existing: Manifest, fresh: Manifest) -> list[str]:
    """What differs between a store's manifest and the one a rerun would write, one "field: old -> new"
    per differing leaf of the nested settings (so a message names the one knob that changed, not two
    whole dicts; a dict against anything else is one line); empty when the rerun may continue the store."""
    absent = _Absent()

    def diff(old: Any, new: Any, key: str) -> list[str]:
        if any(key == s or key.startswith(s + ".") for s in _NOT_COMPARED):
            return []
        if isinstance(old, dict) and isinstance(new, dict):
            names = sorted(old.keys() | new.keys())
            return [
                line
                for name in names
                for line in diff(old.get(name, absent), new.get(name, absent), f"{key}.{name}" if key else name)
            ]
        return [] if old == new else [f"{key}: {old!r} -> {new!r}"]

    return diff(existing.to_dict(), fresh.to_dict(), "")


class _Absent:
    """A field one of the two manifests lacks, said so in `resume_differences`' lines."""

    def __repr__(self) -> str:
        return "(absent)"


def write_manifest(root: str | Path, manifest: Manifest) -> None:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(manifest.to_dict(), indent=2, sort_keys=True).encode() + b"\n"
    write_bytes_durably(StoreLayout(root).manifest, payload)


def load_manifest(root: str | Path) -> Manifest:
    path = StoreLayout(root).manifest
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(
            f"{root}: no {StoreLayout.MANIFEST} (not a feature store, or extraction never started)"
        ) from None
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: corrupt manifest ({exc})") from None
    if not isinstance(d, dict):
        raise ManifestError(f"{path}: corrupt manifest (top level is {type(d).__name__}, not an object)")
    return Manifest.from_dict(d, root=str(root))


def mark_complete(
    root: str | Path,
    manifest: Manifest,
    *,
    shards: list[ShardEntry | dict[str, Any]],
    weights_fingerprint: str | None = None,
    counts: dict[str, Any] | None = None,
) -> Manifest:
    """Seal the store: check `shards` against the ranks' progress records (every rank done, same
    counts), record the layout they were written with, and write the manifest with `complete: true`.
    This write is the store's commit point."""
    given = sorted((s if isinstance(s, ShardEntry) else ShardEntry(**s) for s in shards), key=lambda s: s.rank)
    on_disk, layout = finished_shards(root, manifest.world_size)
    if given != on_disk:
        raise StoreError(f"{root}: shard list {given} disagrees with the ranks' progress records {on_disk}")
    manifest.shards = on_disk
    manifest.compression, manifest.chunk_tokens, manifest.shard_tokens = (
        layout["compression"],
        layout["chunk_tokens"],
        layout["shard_tokens"],
    )
    if weights_fingerprint is not None:
        manifest.target["weights_fingerprint"] = weights_fingerprint
    if counts is not None:
        manifest.data["counts"] = counts
    manifest.complete, manifest.finished = True, utc_now()
    write_manifest(root, manifest)
    return manifest


def check_compatible(
    manifest: Manifest,
    *,
    config_hash: str | None = None,
    layer_ids: list[int] | None = None,
    hidden_size: int | None = None,
    require_complete: bool = True,
    root: str | Path | None = None,
) -> None:
    """Raise `StoreIncomplete` / `StoreMismatch` unless the store is what the caller expects.

    Arguments left as None are not checked; `root` names the store in messages (default: where the
    manifest was loaded from).
    """
    where = root or manifest.root or "store"
    if require_complete and not manifest.complete:
        raise StoreIncomplete(
            f"{where}: store is incomplete (extraction unfinished or interrupted; rerun the same extract command to finish it)"
        )
    expected = {
        "config_hash": (config_hash, manifest.target["config_hash"]),
        "layer_ids": (None if layer_ids is None else [int(i) for i in layer_ids], manifest.layer_ids),
        "hidden_size": (hidden_size, manifest.hidden_size),
    }
    for name, (want, have) in expected.items():
        if want is not None and want != have:
            raise StoreMismatch(
                f"{where}: store was extracted with target {name}={have!r}, expected {want!r} "
                f"(target {manifest.target['name_or_path']!r})"
            )
