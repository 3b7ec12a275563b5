"""A store's regenerated replies as one compressed file, so that another machine builds the same store
without generating them again (`quality_scale pack-replies`, then `regenerate --replies-archive`).

Regeneration is most of a store's build (on the lent GPU: 239 of 376 s for issue 18's store), and
each session's machine starts bare: the replies carried in are device time saved every session, and
every session trains on the very same conversations. The archive holds the store's complete
manifest (what the replies were made with: target, data and reply settings, checked again by
dflash-extract when the store is resumed from it) and its reply cache files (`regenerated/`, see
extract/regenerate.py), nothing else."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

from dflash_pipeline.shared.store import manifest as mf
from dflash_pipeline.shared.store.layout import StoreLayout

REPLIES = StoreLayout(Path()).regenerated_dir.name  # the store's folder of reply cache files, as named in archives


def pack_replies(store: Path, archive: Path) -> int:
    """Write complete store `store`'s manifest and reply cache files to the xz tar `archive` (through a
    partial file, renamed when whole); its size in bytes."""
    manifest = mf.load_manifest(store)
    if not manifest.complete:
        sys.exit(f"pack-replies: store {store} is not complete; regenerate it first")
    files = sorted(p for p in StoreLayout(store).regenerated_dir.glob("*.jsonl") if p.is_file())
    if not files:
        sys.exit(f"pack-replies: store {store} has no regenerated replies (was it made with --regenerate?)")
    partial = archive.with_name(archive.name + ".partial")
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(partial, "w:xz") as tar:
        tar.add(StoreLayout(store).manifest, StoreLayout.MANIFEST)
        for path in files:
            tar.add(path, f"{REPLIES}/{path.name}")
    partial.rename(archive)
    return archive.stat().st_size


def unpack_replies(archive: Path, into: Path) -> mf.Manifest:
    """Extract `archive` (made by `pack_replies`) into the empty folder `into`, laid out as the store
    was (`StoreLayout(into)`: its manifest and `regenerated_dir`); the archived store's manifest. One line and exit 1 for a missing file or one that is not such an archive."""
    if not archive.is_file():
        sys.exit(f"--replies-archive {archive}: no such file")
    try:
        with tarfile.open(archive, "r:xz") as tar:
            members = tar.getmembers()
            names = {m.name for m in members}
            replies = [m for m in members if m.name.startswith(f"{REPLIES}/") and m.name.endswith(".jsonl")]
            if StoreLayout.MANIFEST not in names or not replies or len(replies) + 1 != len(members):
                sys.exit(
                    f"--replies-archive {archive}: not a replies archive "
                    f"(holds {sorted(names)[:4]}; expected {StoreLayout.MANIFEST} and {REPLIES}/*.jsonl only)"
                )
            if not all(m.isfile() and "/" not in m.name.removeprefix(f"{REPLIES}/") for m in members):
                sys.exit(f"--replies-archive {archive}: not a replies archive (a member is no plain file)")
            tar.extractall(into, filter="data")
    except (tarfile.TarError, EOFError, OSError) as e:
        sys.exit(f"--replies-archive {archive}: unreadable ({e})")
    manifest = mf.load_manifest(into)
    if not manifest.complete:
        sys.exit(f"--replies-archive {archive}: its store was not complete")
    return manifest
