"""Save data path: stream planned items through the staging pool into data files.

Owns: filling buffers in file order (copy the next tensors while earlier buffers are written),
zeroed padding, checksums of the exact bytes written, waiting for every write, fsync.
Does not own: where items go (layout.py), the files' commit (commit.py) or the pool (stage.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from .checksum import new_hasher
from .io import FileHandle, IOBackend
from .layout import align_up
from .options import BLOCK
from .stage import Buffer, BufferPool, copy_out, torch_dtype, typed
from .types import DTYPE_ITEMSIZE, FileInfo, FileLayout, Placement, TensorEntry


class _Writes:
    """Writes in flight; a finished write hands its buffer back to the pool."""

    def __init__(self, pool: BufferPool, backend: IOBackend) -> None:
        self.pool, self.backend = pool, backend
        self.futures: list[Future[int]] = []

    def submit(self, fh: FileHandle, offset: int, buffer: Buffer, nbytes: int) -> None:
        """Hand ``buffer`` to the backend; from here on it belongs to the write (or, if the
        submission itself fails, back to the pool)."""
        try:
            future = self.backend.submit_write(fh, offset, buffer.view[:nbytes])
        except BaseException:
            self.pool.release(buffer)
            raise
        future.add_done_callback(lambda _f: self.pool.release(buffer))
        self.futures.append(future)

    def check(self) -> None:
        """Raise the first failed write, if any; forget finished ones."""
        pending = []
        for future in self.futures:
            if not future.done():
                pending.append(future)
            elif future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        self.futures = pending

    def wait(self) -> None:
        futures, self.futures = self.futures, []
        errors = [f.exception() for f in futures]  # waits for all, even after a failure
        for error in errors:
            if error is not None:
                raise error


class _FileStream:
    """Bytes of one file, in offset order, through a window of one buffer."""

    def __init__(self, fh: FileHandle, writes: _Writes, pool: BufferPool) -> None:
        self.fh, self.writes, self.pool = fh, writes, pool
        self.buffer: Buffer | None = pool.acquire()
        self.start = 0  # file offset of the buffer's first byte
        self.filled = 0  # bytes of the buffer written so far

    def _room(self) -> int:
        assert self.buffer is not None  # internal: finish() or abandon() ends the stream
        if self.filled == self.buffer.nbytes:
            full, self.buffer = self.buffer, None
            self.writes.submit(self.fh, self.start, full, self.filled)
            self.start += self.filled
            self.filled = 0
            self.buffer = self.pool.acquire()
            self.writes.check()
        return self.buffer.nbytes - self.filled

    def pad_to(self, offset: int) -> None:
        while self.start + self.filled < offset:
            n = min(self._room(), offset - self.start - self.filled)
            self.buffer.data[self.filled:self.filled + n].zero_()
            self.filled += n

    def put(self, placement: Placement, source: torch.Tensor, algorithm: str) -> str:
        """Copy the item's elements in; returns the checksum of the bytes as written."""
        self.pad_to(placement.offset)
        item = placement.item
        itemsize = DTYPE_ITEMSIZE[item.dtype]
        dtype = torch_dtype(item.dtype)
        hasher = new_hasher(algorithm)
        done, total = 0, item.nbytes // itemsize
        while done < total:
            count = min(self._room() // itemsize, total - done)
            copy_out(source, done, count, typed(self.buffer, self.filled, count * itemsize, dtype))
            hasher.update(self.buffer.view[self.filled:self.filled + count * itemsize])
            self.filled += count * itemsize
            done += count
        return hasher.hexdigest()

    def finish(self, file_nbytes: int) -> None:
        """Zero the tail up to the padded file size and write the last (BLOCK-aligned) buffer."""
        self.pad_to(file_nbytes)
        buffer, self.buffer = self.buffer, None
        if buffer is not None and self.filled:
            self.writes.submit(self.fh, self.start, buffer, align_up(self.filled, BLOCK))
        elif buffer is not None:
            self.pool.release(buffer)

    def abandon(self) -> None:
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            self.pool.release(buffer)


def write_files(
    directory: str,
    files: Sequence[FileLayout],
    sources: dict[str, torch.Tensor],
    *,
    pool: BufferPool,
    backend: IOBackend,
    algorithm: str,
    rank: int,
) -> tuple[list[TensorEntry], list[FileInfo]]:
    """Write every file, fsync it, and return the manifest rows for what was written.

    On failure every write has finished and every file is closed before the error is raised;
    removing the files is the caller's (commit.discard).
    """
    writes = _Writes(pool, backend)
    handles: list[FileHandle] = []
    entries: list[TensorEntry] = []
    try:
        with torch.no_grad():  # sources may require grad; copying them must not build a graph
            _write_all(directory, files, sources, writes, handles, entries, pool, backend, algorithm)
        writes.wait()
        for fh in list(handles):
            handles.remove(fh)
            backend.close(fh, sync=True)
    except BaseException:
        _abandon(writes, handles, backend)
        raise
    return entries, [FileInfo(f.name, f.nbytes, rank) for f in files]


def _write_all(directory: str, files: Sequence[FileLayout], sources: dict[str, torch.Tensor],
               writes: _Writes, handles: list[FileHandle], entries: list[TensorEntry],
               pool: BufferPool, backend: IOBackend, algorithm: str) -> None:
    stream: _FileStream | None = None
    try:
        for layout in files:
            fh = backend.open_write(os.path.join(directory, layout.name), layout.nbytes)
            handles.append(fh)
            stream = _FileStream(fh, writes, pool)
            for placement in layout.placements:
                item = placement.item
                checksum = stream.put(placement, sources[item.key], algorithm)
                entries.append(TensorEntry(item.key, item.kind, item.dtype, item.shape, item.chunk,
                                           layout.name, placement.offset, item.nbytes, checksum))
            stream.finish(layout.nbytes)
    except BaseException:
        if stream is not None:
            stream.abandon()
        raise


def _abandon(writes: _Writes, handles: list[FileHandle], backend: IOBackend) -> None:
    for future in writes.futures:
        future.exception()  # let in-flight writes finish before their buffers are reused
    writes.futures = []
    for fh in handles:
        backend.close(fh, sync=False)
