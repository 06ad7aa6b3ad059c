"""The IOBackend contract: open files, submit positioned reads and writes, get futures back.

Owns: the Protocol every backend implements and the FileHandle it hands out, and the future and
thread-pool helpers backends share (completed, all_of, started_pool). A backend may run requests
on threads (posix) or a ring (io_uring); callers only see futures, so both fit.
Does not own: what is written (persist.py) or when a checkpoint counts (the Store, storage/).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["START_S", "BatchReads", "FileHandle", "Filled", "IOBackend", "all_of", "completed",
           "started_pool"]

START_S = 5.0  # the longest started_pool waits for its threads (then they start on demand)


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

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        """Pin ``view`` (the whole staging pool) for transfers that skip per-request mapping
        (io_uring fixed buffers); ``part_bytes`` > 0: each part of that size is pinned at the
        first transfer inside it, not all at once. False where the backend has no such thing
        (then nothing changes)."""
        ...

    def shutdown(self) -> None:
        """Stop worker threads or rings; the backend may be used again afterwards."""
        ...


Filled = Callable[[int, int, bool], None]  # (read index, bytes of it filled so far, its last call)


@runtime_checkable
class BatchReads(Protocol):
    """What a backend may add to IOBackend: many reads of one file filled in order by one of
    its threads, a callback as each part lands (the caller checks bytes while they are still
    in the core's cache). storage/files.StoreFiles.submit_reads falls back to one submit_read
    per read for a backend without it."""

    def submit_reads(self, fh: FileHandle, reads: Sequence[tuple[int, memoryview]],
                     each: Filled) -> Future[int]:
        """Fill each (offset, into) of ``reads`` in order; after each part of read i lands,
        ``each(i, bytes of it filled so far, last)`` (last: it is complete, or the file ended
        before it was: then filled < len(into)); an exception from ``each`` stops the batch
        and fails the future. The future gives the bytes read."""
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


def started_pool(threads: int, prefix: str) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads, every one started now, before the first request: a pool
    starts a thread per submit, and each start waits for the new thread to run, which on a busy
    box, with the first requests' threads already holding the cores, held up a load's main
    thread per GET thread (docs/BENCH_S3.md, "the read range apart from the part"); started
    together before any request, they start at once."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix=prefix)
    ready = threading.Barrier(threads + 1)
    try:
        for _ in range(threads):  # each holds its thread until all are running
            pool.submit(ready.wait, START_S)
        ready.wait(START_S)
    except threading.BrokenBarrierError:
        pass  # slower than START_S to start: the rest start as requests come, as before
    except BaseException:
        ready.abort()
        pool.shutdown(wait=False)
        raise
    return pool


def all_of(requests: list[Future[int]]) -> Future[int]:
    """One future for the requests that fill one read: their bytes once all are
    done, or the first failure in order (every request has finished by then: the buffer is
    free)."""
    joined: Future[int] = Future()
    left = [len(requests)]
    lock = threading.Lock()

    def one_done(_done: Future[int]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [r.exception() for r in requests]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            joined.set_exception(error)
        else:
            joined.set_result(sum(r.result() for r in requests))

    for request in requests:
        request.add_done_callback(one_done)
    return joined
