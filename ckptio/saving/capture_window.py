"""One file's bytes of a save's capture, in offset order, through one buffer at a time.

Call order: persist.SaveJob.capture opens a ``Window`` per data file, ``put``s each placed item
at its offset (zeroed padding between; runs of small plain host tensors by ``put_run``, with
no Python per tensor, into a mapped save's regions and the pool's buffers alike), ``close``s
it at the padded file size, and ``abandon``s it in any case; each full buffer goes back to the
job through ``Sink.hand_off``.

Owns: filling a buffer (runs of memmoves, grouped copies of the small host tensors a run
refuses, one memmove, one copy_, or a large tensor split across buffers), the pieces of each
buffer (which entry, where, how many bytes), zeroed padding. Does not own: the buffers (the
job's pool or its file mappings), the checksums, writes and streams (persist.py,
copy_streams.py), where items go (layout.py).
"""

from __future__ import annotations

import ctypes
import operator
from bisect import bisect_right
from collections.abc import Sequence
from itertools import repeat
from typing import Any, Protocol

import torch

from ckptio.alignment import align_up
from ckptio.format.types import DTYPE_ITEMSIZE
from ckptio.io.buffers import Buffer, copy_out, move_many, move_out, torch_dtype, typed
from ckptio.saving.grouped import Groups
from ckptio.saving.mapped_regions import MappedTarget

__all__ = ["MEMMOVE_MAX_NBYTES", "Piece", "Sink", "Window"]

Piece = tuple[int, int, int]  # (entry index, start in buffer, nbytes)
MEMMOVE_MAX_NBYTES = 1 << 20  # a host tensor up to this: one memmove; larger: copy_ (threads)


class Sink(Protocol):
    """What a window fills and hands its full buffers to (persist.SaveJob)."""

    mapped: MappedTarget | None  # a mapped save's file mappings (None: pool buffers)

    @property
    def async_copies(self) -> bool: ...

    def region(self, file: int, start: int) -> Buffer: ...

    def release(self, buffer: Buffer) -> None: ...

    def hand_off(self, file: int, offset: int, buffer: Buffer, nbytes: int,
                 pieces: list[Piece]) -> None: ...


class Window:
    """Bytes of one file, in offset order, through one buffer at a time."""

    def __init__(self, job: Sink, file: int) -> None:
        self.job, self.file = job, file
        self.buffer: Buffer | None = job.region(file, 0)
        self.start = 0  # file offset of the buffer's first byte
        self.filled = 0
        self.pieces: list[Piece] = []
        self.groups = Groups()  # small host tensors' copies, made before a hand-off
        # only into the pool's buffers, whose views are made once and kept (Buffer.view_at): a
        # mapped save's regions come and go with its files, and would keep a view per tensor
        self.grouping = job.mapped is None

    def _room(self) -> Buffer:
        assert self.buffer is not None  # internal: close() or abandon() ends the window
        if self.filled == self.buffer.nbytes:
            self.groups.flush()
            full, self.buffer = self.buffer, None
            self.job.hand_off(self.file, self.start, full, self.filled, self.pieces)
            self.start, self.filled, self.pieces = self.start + self.filled, 0, []
            self.buffer = self.job.region(self.file, self.start)
        return self.buffer

    def pad_to(self, offset: int) -> None:
        while self.start + self.filled < offset:
            buffer = self._room()
            n = min(buffer.nbytes - self.filled, offset - self.start - self.filled)
            buffer.data[self.filled:self.filled + n].zero_()
            self.filled += n

    def put(self, offset: int, item: Any, source: torch.Tensor, index: int) -> None:
        if offset != self.start + self.filled:
            self.pad_to(offset)
        nbytes, filled, buffer = item.nbytes, self.filled, self.buffer
        dtype = torch_dtype(item.dtype)
        if (self.grouping and buffer is not None and nbytes and filled + nbytes <= buffer.nbytes
                and Groups.takes(source, dtype, nbytes)):  # one copy per dtype (grouped.py)
            self.groups.add(buffer.view_at(filled, dtype, source.shape), source)
            self.pieces.append((index, filled, nbytes))
            self.filled = filled + nbytes
            return
        moved = bool(buffer is not None and nbytes and filled + nbytes <= buffer.nbytes
                 and nbytes <= MEMMOVE_MAX_NBYTES and move_out(source, dtype, buffer, filled,
                                                               nbytes))
        if moved or (buffer is not None and nbytes and filled + nbytes <= buffer.nbytes
                     and source.is_contiguous()):
            # The common case in one copy and three views (a state has thousands of small
            # tensors: per-tensor Python work is what the caller waits for after the copy); a
            # small host tensor in one memmove (move_out), no torch kernel at all.
            if not moved:
                assert buffer is not None  # (for mypy: checked above)
                buffer.view_at(filled, dtype, source.shape).copy_(
                    source, non_blocking=source.is_cuda and self.job.async_copies)
            self.pieces.append((index, filled, nbytes))
            self.filled = filled + nbytes
            return
        itemsize = DTYPE_ITEMSIZE[item.dtype]
        done, total = 0, item.nbytes // itemsize
        while done < total:
            buffer = self._room()
            count = min((buffer.nbytes - self.filled) // itemsize, total - done)
            copy_out(source, done, count, typed(buffer, self.filled, count * itemsize, dtype))
            self.pieces.append((index, self.filled, count * itemsize))
            self.filled += count * itemsize
            done += count

    def put_run(self, offsets: Sequence[int], sizes: Sequence[int], ends: Sequence[int],
                sources: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], first: int,
                stop: int, index: int) -> int:
        """The placed items from ``first`` (before ``stop``; the file's offsets, byte sizes,
        ends, sources and dtypes in placement order, entry indices from ``index``) that lie in
        the current buffer and are small plain host tensors, each copied by one memmove, read
        and copied by ``map`` over the run (buffers.move_many; zeroed padding between them
        once); -> how many (0: none, ``put`` takes the next one: into the pool's buffers, a
        small host tensor the run refuses, a strided or conjugate view say, joins its dtype's
        group there). Into a mapped save's regions and the pool's buffers alike."""
        buffer = self.buffer
        if buffer is None or self.filled == buffer.nbytes:
            return 0
        start = self.start
        last = bisect_right(ends, start + buffer.nbytes, first, stop)
        if last - first < 2 or offsets[first] < start + self.filled:
            return 0
        if offsets[first] != start + self.filled:
            self.pad_to(offsets[first])
        at = list(map(operator.sub, offsets[first:last], repeat(start)))
        count = move_many(sources[first:last], dtypes[first:last], buffer, at,
                          sizes[first:last], MEMMOVE_MAX_NBYTES)
        if not count:
            return 0
        end = first + count
        if offsets[first + 1:end] != ends[first:end - 1]:  # padding between: zeroed, once
            for gap, following in zip(ends[first:end - 1], offsets[first + 1:end]):
                if following != gap:
                    ctypes.memset(buffer.address + gap - start, 0, following - gap)
        self.pieces.extend(zip(range(index, index + count), at, sizes[first:end]))
        self.filled = ends[end - 1] - start
        return count

    def close(self, file_nbytes: int) -> None:
        """Zero the tail up to the padded file size and hand off the last (BLOCK-aligned) buffer."""
        self.pad_to(file_nbytes)
        self.groups.flush()
        buffer, self.buffer = self.buffer, None
        if buffer is not None and self.filled:
            self.job.hand_off(self.file, self.start, buffer, align_up(self.filled),
                              self.pieces)
        elif buffer is not None:
            self.job.release(buffer)

    def abandon(self) -> None:
        self.groups.drop()
        buffer, self.buffer = self.buffer, None
        if buffer is not None:
            self.job.release(buffer)
