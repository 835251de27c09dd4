"""Durable, atomic replacement of a small file: a reader (or a reboot) sees the old file or the
whole new one, never a torn or empty one.

The bytes go to a temporary file in the same folder, which is fsynced, renamed over the target,
and then the folder is fsynced so the rename itself survives a power loss. Any OSError (ENOSPC,
EIO, ...) propagates after the temporary file is removed; the target is left as it was.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make the entries of `folder` (a rename, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, data: bytes, sync: bool = True) -> None:
    """Replace `path` with `data` atomically and durably (temporary file, fsync, rename, fsync
    of the folder; `sync=False`: atomically only, for a live status file rewritten often).
    Raises OSError (the target unchanged) if any of it fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync:
        fsync_dir(path.parent)
