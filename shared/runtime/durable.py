"""Durable replacement of files and folders: after a crash, a path holds its old or its new content.

A rename alone is not enough: without an fsync of the new file first, a crash can leave the renamed
name pointing at empty or partial data; without an fsync of the folder, the rename itself may be lost.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflash_pipeline.shared.runtime.errors import DiskFull, is_disk_full


def fsync_path(path: Path) -> None:
    """fsync a file, or a folder (which makes the creations and renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_durably(path: Path, data: bytes) -> None:
    """Replace `path` by `data`: temp file in the same folder, fsync, rename, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def replace_dir_durably(tmp: Path, final: Path) -> None:
    """Make the filled folder `tmp` durable (every file and folder in it), then put it at `final`
    (a folder already there is removed first) and fsync the parent so the rename survives a crash."""
    tmp, final = Path(tmp), Path(final)
    for path in sorted(tmp.rglob("*"), key=lambda p: -len(p.parts)):  # deepest first, each folder after its files
        fsync_path(path)
    fsync_path(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_path(final.parent)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (none if it does not exist)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def free_bytes(path: Path) -> int:
    """Free bytes for this user on the filesystem holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


@contextmanager
def filling_folder(tmp: Path, what: str, then: str) -> Iterator[Path]:
    """The block writes `what` into the fresh folder `tmp` (and puts it in place). If it fails, `tmp` is
    removed, so no half-written folder stays, and a full disk becomes one `DiskFull` line naming `what`,
    the folder, the space left and `then` (what to do)."""
    tmp = Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except Exception as exc:
        full = disk_full_error(exc, tmp, f"{what} into {tmp.parent}", then)  # measured before the cleanup
        shutil.rmtree(tmp, ignore_errors=True)
        if full is None:
            raise
        raise full from exc


def disk_full_error(exc: Exception, path: Path, what: str, then: str) -> DiskFull | None:
    """The one line for a write of `what` near `path` that failed for a full disk (the space left measured
    now), or None if `exc` is something else or already says so."""
    free = free_bytes(path)
    if isinstance(exc, DiskFull) or not is_disk_full(exc, free):
        return None
    return DiskFull(f"writing {what} failed: the disk is full ({free / 2**20:.1f} MiB free); {then}")
