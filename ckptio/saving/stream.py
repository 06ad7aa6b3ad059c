"""Write one file of a precomputed byte layout from windows a producer fills (export).

``write_windows`` creates ``path`` (it must not exist), takes a staging buffer per window from
``pool``, lets ``fill`` put the window's bytes at the buffer's start, and writes the window
BLOCK-aligned (the tail zero-padded) through the I/O backend, keeping up to ``pool.nbuffers``
writes in flight while the next windows are filled. Then the file is cut to its exact size
(a safetensors file must end exactly at its last tensor) and fsynced. Memory is the pool,
whatever the file's size. On any failure the writes in flight are waited for, the file is
removed and the error raised.

Owns: the write loop, the truncation and the durability of one file. Does not own: what the
bytes are (the producer), file names and the commit (ckptio/export.py).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from ckptio.alignment import align_up
from ckptio.errors import StorageIOError
from ckptio.io import IOBackend
from ckptio.io.buffers import Buffer
from ckptio.io.stage import StagingPool
from ckptio.planning.export_plan import Window

__all__ = ["write_windows"]

Fill = Callable[[Window, Buffer], None]


def write_windows(backend: IOBackend, pool: StagingPool, path: str, nbytes: int,
                  windows: Sequence[Window], fill: Fill) -> int:
    """Write file ``path`` of exactly ``nbytes`` bytes window by window (see the module
    docstring); durable when this returns. -> bytes written."""
    fh = backend.open_write(path, align_up(nbytes))
    inflight: deque[tuple[Future[int], Buffer, int]] = deque()
    written = 0
    try:
        for window in windows:
            if len(inflight) >= pool.nbuffers:
                written += _finish(inflight.popleft(), pool, path)
            buffer = pool.acquire()
            try:
                fill(window, buffer)
                length = align_up(window.nbytes)
                if length > buffer.nbytes:
                    raise ValueError(f"window of {length} bytes > buffer")  # internal: planned
                buffer.data[window.nbytes:length].zero_()
                future = backend.submit_write(fh, window.offset, buffer.view[:length])
            except BaseException:
                pool.release(buffer)
                raise
            inflight.append((future, buffer, length))
        while inflight:
            written += _finish(inflight.popleft(), pool, path)
        backend.close(fh, sync=False)
    except BaseException:
        for future, buffer, _length in inflight:
            future.exception()  # the write must end before its buffer is reused
            pool.release(buffer)
        with contextlib.suppress(BaseException):
            backend.close(fh, sync=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    _cut_and_sync(path, nbytes)
    return min(written, nbytes)


def _finish(flight: tuple[Future[int], Buffer, int], pool: StagingPool, path: str) -> int:
    future, buffer, length = flight
    try:
        got = future.result()
    finally:
        pool.release(buffer)
    if got != length:
        raise StorageIOError(f"writing {path}: {got} of {length} bytes written")
    return got


def _cut_and_sync(path: str, nbytes: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise StorageIOError(f"truncating and syncing {path} to {nbytes} bytes: {exc}") from None
