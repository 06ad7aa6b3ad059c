"""A local file or directory made durable by path: written and fsynced, or fsynced alone.

The small files a commit writes whole (a manifest under a temporary name, an export's index)
are created, written and fsynced before they are renamed into place;
the directory a rename or create happened in is fsynced after it, so the new name survives a
crash too.

Call order: local_store.py's commit (the manifest, then its directory and the parent's),
folder.py, export.py, convert_writers.py and lightning.py where they put a file into place.

Owns: those two system-call sequences. Does not own: the temporary names and the renames
(each caller), data files (the IOBackends of io/), the directory's layout (local_store.py).
"""

from __future__ import annotations

import os

__all__ = ["fsync_path", "write_durably"]


def write_durably(file: str, data: bytes | memoryview) -> None:
    """Create ``file`` (it must not exist), write ``data``, fsync it."""
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    """fsync a file or a directory (its entries: a rename or create in it) by path."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
