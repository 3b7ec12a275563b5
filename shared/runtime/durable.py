"""Durable replacement of files and folders: after a crash, a path holds its old or its new content.

A rename alone is not enough: without an fsync of the new file first, a crash can leave the renamed
name pointing at empty or partial data; without an fsync of the folder, the rename itself may be lost.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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
