"""One run at a time per output folder.

Two runs writing one folder (a second `dflash-train --resume` while the first still trains, two
`dflash-extract` into one store) would remove each other's temporary files and interleave their
checkpoints or shards. So the process that starts a run holds an exclusive `flock` on `FOLDER/.lock`
for the whole run, and a second run is refused in one line that names the holder's pid. The kernel
drops a flock when its holder ends in any way, kill -9 included: a crashed run never blocks its rerun,
which takes over the lock file the crash left.

The holder removes the file (still locked) when it ends, so a finished run leaves the folder as it
would without the lock; a run that locked a file removed in between takes the new one. Nothing else
may remove the file while it is held: `empty_locked_folder` keeps it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from dflash_pipeline.shared.runtime.errors import UserError

LOCK_NAME = ".lock"
# what flock says on a filesystem without locks (NFS without lockd, Lustre mounted without -o flock)
NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


class RunLockError(UserError, RuntimeError):
    """Another run holds the output folder, or its lock file cannot be made; the message is one line."""


@contextmanager
def run_lock(folder: Path, cli: str) -> Iterator[None]:
    """Hold `folder`'s run lock while the block runs. The folder is made if missing, and removed
    again if the run left it empty: a run that failed before writing leaves no folder behind."""
    folder = Path(folder)
    made = not folder.exists()
    fd = _take(folder / LOCK_NAME, cli)
    try:
        yield
    finally:
        if fd is not None:
            (folder / LOCK_NAME).unlink(missing_ok=True)
            os.close(fd)
        if made:
            with suppress(OSError):  # not empty: the run wrote something
                folder.rmdir()


def empty_locked_folder(folder: Path) -> None:
    """Remove everything in `folder` but its lock file (removing that would let a second run in)."""
    for entry in Path(folder).iterdir():
        if entry.name == LOCK_NAME:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _take(path: Path, cli: str) -> int | None:
    """The lock file's descriptor, flock-ed, with the holder written in; None (after a warning)
    where the filesystem has no locks."""
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            continue  # the folder was removed by a run that just ended having written nothing
        except OSError as exc:
            raise RunLockError(f"{path}: cannot create the run lock ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 256).decode(errors="replace").strip() or "pid not written yet"
            os.close(fd)
            raise RunLockError(
                f"{path.parent}: another run is using this folder ({holder}); "
                "wait for it to end or stop it, or choose another --out"
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in NO_LOCKS:
                raise
            path.unlink(missing_ok=True)
            print(
                f"{cli}: warning: {path.parent}: its filesystem has no file locks ({exc.strerror}); "
                "a second run on this folder would not be refused",
                file=sys.stderr,
            )
            return None
        if _is_file_at(fd, path):
            break
        os.close(fd)  # its last holder removed it between our open and our lock: lock the one there now
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    return fd


def _is_file_at(fd: int, path: Path) -> bool:
    """True when the open file `fd` is the file that `path` names now."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
