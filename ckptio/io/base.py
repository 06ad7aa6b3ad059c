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
    path: str
    fd: int
    direct: bool  # O_DIRECT: offsets, lengths and buffer addresses must be BLOCK-aligned


@runtime_checkable
class IOBackend(Protocol):
    name: str

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        """Create ``path`` (it must not exist) with ``nbytes`` preallocated."""
        ...

    def open_read(self, path: str) -> FileHandle: ...

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        """Write all of ``data`` at ``offset``; the future gives len(data) or raises StorageIOError."""
        ...

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        """Fill ``into`` from ``offset``; the future gives the bytes read (fewer only at end of file)."""
        ...

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        """Close, after fsync when ``sync`` (the data is durable when this returns)."""
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
