"""The IOBackend contract: open files, submit positioned reads and writes, get futures back.

Owns: the Protocol every backend implements and the FileHandle it hands out. A backend may run
requests on threads (posix) or a ring (io_uring); callers only see futures, so both fit.
Does not own: what is written (persist.py) or when a checkpoint counts (the Store, storage/).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["FileHandle", "IOBackend", "completed"]


@dataclass
class FileHandle:
    """An open file of a backend, as its callers hold it: opaque but for what messages name
    and the alignment its transfers need. Callers get handles from a store (storage/files.py:
    a file name in, a handle out), never from a path of their own."""

    path: str  # what messages name (the store's path_of the file)
    token: int  # the backend's own number for the open file (a descriptor, or a table key)
    direct: bool  # offsets, lengths and buffer addresses must be BLOCK-aligned (O_DIRECT)


@runtime_checkable
class IOBackend(Protocol):
    name: str

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        """Create ``path`` (it must not exist) with ``nbytes`` preallocated."""
        ...

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:
        """Open ``path`` for reading. ``cached``: through the host's page cache, never
        O_DIRECT (for bytes another process on this host reads too: the second read is served
        from memory); a backend with no page cache ignores it."""
        ...

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        """Write all of ``data`` at ``offset``; the future gives len(data) or raises StorageIOError."""
        ...

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        """Fill ``into`` from ``offset``; the future gives the bytes read (fewer only at end of file)."""
        ...

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        """Close, after fsync when ``sync`` (the data is durable when this returns)."""
        ...

    def register_buffers(self, view: memoryview) -> bool:
        """Pin ``view`` (the whole staging pool) for transfers that skip per-request mapping
        (io_uring fixed buffers); False where the backend has no such thing (then nothing
        changes)."""
        ...

    def shutdown(self) -> None:
        """Stop worker threads or rings; the backend may be used again afterwards."""
        ...


def completed(result: int = 0, error: BaseException | None = None) -> Future[int]:
    """A future already done with ``result`` (or failed with ``error``): for backends whose
    request finished, or failed, inside submit."""
    future: Future[int] = Future()
    future.set_running_or_notify_cancel()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return future
