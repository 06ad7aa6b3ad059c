"""Load data path for resharded tensors: fill a wanted region of a global tensor from the stored
chunks that overlap it, reading only the bytes it needs.

For each wanted region, reshard.plan_reads gives pieces (a byte range of one stored entry and
one strided copy each). Each piece's range is widened to whole checksum blocks of its entry
(Manifest.block_nbytes), so every byte copied out has been verified; pieces of one entry, and
neighbouring entries of one file, share aligned reads of up to one pool buffer. Reads run
``depth`` ahead of the copying, as in restore.py.

Owns: widening to blocks, grouping into reads, block verification, applying pieces. Does not
own: which regions are wanted (fill.py), the piece arithmetic (reshard.py), the I/O (io).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ckptio.format.checksum import new_hasher
from ckptio.errors import CorruptCheckpointError
from ckptio.io import IOBackend
from ckptio.planning.layout import align_down, align_up
from ckptio.options import BLOCK
from ckptio.planning.reshard import Piece, execute, plan_reads, region_of, stored_from_entry
from ckptio.io.stage import Buffer, BufferPool, torch_dtype
from ckptio.format.types import DTYPE_ITEMSIZE, Job, TensorEntry

MAX_GAP = 512 << 10  # read through gaps up to this size rather than issue another request


@dataclass
class _Span:
    """Whole checksum blocks [lo, hi) (file offsets) of one entry, and the pieces inside them."""

    entry: TensorEntry
    lo: int
    hi: int
    pieces: list[tuple[Piece, torch.Tensor]] = field(default_factory=list)


@dataclass
class _Read:
    file: str
    offset: int
    nbytes: int
    spans: list[_Span] = field(default_factory=list)


def plan_spans(jobs: Sequence[Job], block_nbytes: int, buffer_bytes: int) -> list[_Span]:
    """Every job's pieces, widened to whole blocks and grouped per entry into spans that fit
    one buffer with their alignment."""
    limit = max(buffer_bytes - 2 * BLOCK, 4 * block_nbytes)  # larger than a buffer: a one-off
    max_read = limit - 2 * block_nbytes
    by_entry: dict[int, tuple[TensorEntry, list[tuple[Piece, torch.Tensor]]]] = {}
    for job in jobs:
        head = job.entries[0]
        stored = [stored_from_entry(e) for e in job.entries]
        try:
            pieces = plan_reads(stored, region_of(job.want), head.shape,
                                DTYPE_ITEMSIZE[head.dtype], max_read)
        except ValueError as exc:
            raise CorruptCheckpointError(f"key {job.key!r}: {exc}") from None
        for piece in pieces:
            entry = job.entries[piece.source]
            by_entry.setdefault(id(entry), (entry, []))[1].append((piece, job.dest))
    spans: list[_Span] = []
    for entry, pieces in by_entry.values():
        current: _Span | None = None
        for piece, dest in sorted(pieces, key=lambda pd: pd[0].offset):
            lo, hi = _blocks(entry, piece, block_nbytes)
            if current is not None and max(hi, current.hi) - current.lo <= limit:
                current.hi = max(current.hi, hi)
            else:
                current = _Span(entry, lo, hi)
                spans.append(current)
            current.pieces.append((piece, dest))
    return spans


def _blocks(entry: TensorEntry, piece: Piece, block_nbytes: int) -> tuple[int, int]:
    """The piece's byte range widened to whole blocks of its entry (file offsets)."""
    start = piece.offset - entry.offset
    lo = start // block_nbytes * block_nbytes
    hi = min(-(-(start + piece.nbytes) // block_nbytes) * block_nbytes, entry.nbytes)
    return entry.offset + lo, entry.offset + hi


def group_reads(spans: Sequence[_Span], buffer_bytes: int) -> list[_Read]:
    """Spans of one file within MAX_GAP of each other share one aligned read."""
    reads: list[_Read] = []
    for span in sorted(spans, key=lambda s: (s.entry.file, s.lo)):
        lo, hi = align_down(span.lo, BLOCK), align_up(span.hi, BLOCK)
        last = reads[-1] if reads else None
        if (last is not None and last.file == span.entry.file and lo <= last.offset + last.nbytes
                + MAX_GAP and max(hi, last.offset + last.nbytes) - last.offset <= buffer_bytes):
            last.nbytes = max(hi, last.offset + last.nbytes) - last.offset
        else:
            last = _Read(span.entry.file, lo, hi - lo)
            reads.append(last)
        last.spans.append(span)
    return reads


def read_jobs(directory: str, jobs: Sequence[Job], *, pool: BufferPool, backend: IOBackend,
              algorithm: str | None, block_nbytes: int, depth: int) -> int:
    """Fill every job's destination; ``algorithm`` None skips verification. -> bytes read."""
    reads = deque(group_reads(plan_spans(jobs, block_nbytes, pool.buffer_bytes), pool.buffer_bytes))
    handles = {}
    pending: deque[tuple[_Read, Buffer, BufferPool | None, Future[int]]] = deque()
    ahead = max(1, min(pool.nbuffers, 2 * depth))
    nbytes = 0
    try:
        while reads or pending:
            while reads and len(pending) < ahead:
                read = reads.popleft()
                if read.file not in handles:
                    handles[read.file] = backend.open_read(os.path.join(directory, read.file))
                own = BufferPool(1, align_up(read.nbytes, BLOCK), prefault=False) \
                    if read.nbytes > pool.buffer_bytes else None  # a span larger than a buffer
                buffer = (own or pool).acquire()
                try:
                    future = backend.submit_read(handles[read.file], read.offset, buffer.view[:read.nbytes])
                except BaseException:
                    (own or pool).release(buffer)
                    raise
                pending.append((read, buffer, own, future))
            read, buffer, own, future = pending.popleft()
            try:
                _apply(directory, read, buffer, future.result(), algorithm, block_nbytes)
                nbytes += read.nbytes
            finally:
                _release(pool, own, buffer)
    finally:
        for _read, buffer, own, future in pending:
            future.exception()  # the read must finish before its buffer is reused
            _release(pool, own, buffer)
        for fh in handles.values():
            backend.close(fh, sync=False)
    return nbytes


def _release(pool: BufferPool, own: BufferPool | None, buffer: Buffer) -> None:
    if own is not None:
        own.release(buffer)
        own.close()
    else:
        pool.release(buffer)


def _apply(directory: str, read: _Read, buffer: Buffer, got: int, algorithm: str | None,
           block_nbytes: int) -> None:
    path = os.path.join(directory, read.file)
    for span in read.spans:
        if read.offset + got < span.hi:
            raise CorruptCheckpointError(
                f"data file {path} is truncated: wanted bytes up to {span.hi}, file ends at "
                f"{read.offset + got}; the checkpoint is damaged: load an earlier one")
        start = span.lo - read.offset
        if algorithm is not None:
            _verify(path, span, buffer.view[start:start + span.hi - span.lo], algorithm, block_nbytes)
        data = buffer.data[start:start + span.hi - span.lo]
        for piece, dest in span.pieces:
            at = piece.offset - span.lo
            raw = data[at:at + piece.nbytes].view(torch_dtype(span.entry.dtype))
            execute(piece, raw, dest)


def _verify(path: str, span: _Span, view: memoryview, algorithm: str, block_nbytes: int) -> None:
    entry = span.entry
    if not entry.blocks:  # one block: the span is the whole entry
        expected = [(entry.offset, entry.nbytes, entry.checksum)]
    else:
        first = (span.lo - entry.offset) // block_nbytes
        expected = [(entry.offset + i * block_nbytes,
                     min(block_nbytes, entry.nbytes - i * block_nbytes), entry.blocks[i])
                    for i in range(first, first + -(-(span.hi - span.lo) // block_nbytes))]
    for offset, n, checksum in expected:
        hasher = new_hasher(algorithm)
        hasher.update(view[offset - span.lo:offset - span.lo + n])
        digest = hasher.hexdigest()
        if digest != checksum:
            raise CorruptCheckpointError(
                f"checksum mismatch for key {entry.key!r} in {path} bytes [{offset}, {offset + n}):"
                f" stored {checksum}, read {digest}. The data file is corrupt; load an earlier "
                "checkpoint (any destination tensors of this load may hold partial data)")
