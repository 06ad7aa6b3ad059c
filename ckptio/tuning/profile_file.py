"""Writing the profile file safely: whole (a temp file renamed over it), under a lock, and
asking beforehand whether its folder can be written.

Owns: those three mechanics, on any path given. Does not own: the file's content, its location
or its versions (profile.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_write", "locked", "unwritable"]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the profile file's folder (flock) while store() reads, changes and
    replaces the file. A filesystem that refuses to lock a folder (NFS emulates flock with
    locks that need a file open for writing) locks a hidden file beside the profile instead."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _flocked(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    if fd is None:
        fd = _flocked(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, strict=True)
    assert fd is not None
    try:
        yield
    finally:
        os.close(fd)


def _flocked(path: Path, flags: int, *, strict: bool = False) -> int | None:
    """``path`` opened and locked (flock, exclusive); None where the lock is refused, unless
    ``strict`` (then the error is raised)."""
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        if strict:
            raise
        return None
    return fd


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` whole: a temp file beside it, fsync, rename (a reader sees
    the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def unwritable(path: Path) -> str | None:
    """Why a file cannot be written at ``path`` (its folder made where missing, a temp file
    made and removed there), or None where it can."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(prefix=f".{path.name}.", dir=path.parent):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)
