"""Checksum blocks a load wants only part of, read through the page cache, the rest direct.

A resharding load verifies whole checksum blocks (read.py), so a rank that wants part of a
block reads all of it; on one host the rank that wants the block's other part reads it too
(2 -> 4: every stored half is split inside a block; the over-read is on docs/BENCH_LIMIT.md,
"The 2->4 over-read"). Read with O_DIRECT, each of those reads goes to
the disk. Here one aligned read of a data file is cut into parts: the partly wanted blocks at
the edges of its block spans go through a handle opened ``cached`` (the page cache, read-ahead
off), everything else through the O_DIRECT handle, into the same buffer; the parts finish as
one future. The first process to read such a block fetches it from the disk, the other finds
it in memory. Within one process, a block two spans of one entry share (a span boundary inside
a block) is fetched once for the same reason. Nothing about checking changes: the buffer holds
the same bytes either way and is checked whole as before.

Blocks the load already holds (``known``: blocks another rank read and sent, or this rank read
first to send, planning/shared_reads.py) are copied into the buffer from memory, not read
(their 4 KiB-aligned inside; a partial 4 KiB page at an edge is still read).

Owns: which byte ranges of a read go through the cache or come from memory, submitting the parts (joined by
io.backend_contract.all_of). Does not own: the spans (read.py), opening files (the store's StoreFiles) or
the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from ckptio.alignment import align_down, align_up, merged
from ckptio.distributed.readshare import Known
from ckptio.format.types import ReadRange
from ckptio.io import FileHandle
from ckptio.io.backend_contract import all_of
from ckptio.storage.files import StoreFiles

__all__ = ["CACHED", "DIRECT", "MEMORY", "Seen", "submit_parts"]

DIRECT, CACHED, MEMORY = 0, 1, 2  # how a part's bytes come: O_DIRECT, page cache, held bytes
Part = tuple[int, int, int]  # file offset, bytes, how (DIRECT, CACHED or MEMORY)


class _Piece(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class _Entry(Protocol):
    @property
    def offset(self) -> int: ...


class Span(Protocol):
    """What this module reads of read.py's spans."""

    @property
    def entry(self) -> _Entry: ...

    @property
    def offset(self) -> int: ...

    @property
    def whole(self) -> bool: ...

    @property
    def end(self) -> int: ...

    @property
    def pieces(self) -> Sequence[tuple[_Piece, object]]: ...


def submit_parts(source: StoreFiles, handles: dict[tuple[str, bool], FileHandle],
                 rng: ReadRange[Span], into: memoryview, block_nbytes: int,
                 known: Known | None = None,
                 seen: Seen | None = None) -> tuple[Future[int], int]:
    """Read ``rng`` into ``into`` (its ``nbytes`` bytes): one read through its direct handle,
    or, where it holds partly wanted blocks or ``known`` ones, parts of it through a cached
    handle or copied from memory too. -> a future of the bytes in ``into`` from ``rng.offset``
    on (fewer only at end of file), and how many of them storage did not serve: copied from
    memory, or read through the cache again (a part in ``seen``, the cached parts read before
    by the same load, which adds this read's)."""
    direct = _handle(source, handles, rng.file, False)
    parts = cut(rng, block_nbytes, known) if direct.direct else []
    if all(how == DIRECT for _, _, how in parts):
        return source.submit_read(direct, rng.offset, into), 0
    cached = _handle(source, handles, rng.file, True) if any(
        how == CACHED for _, _, how in parts) else direct
    submitted: list[Future[int]] = []
    held = 0
    try:
        for offset, nbytes, how in parts:
            at = offset - rng.offset
            if how == MEMORY:
                submitted.append(_copied(known or {}, rng.file, offset, into[at:at + nbytes]))
                held += nbytes
                continue
            if how == CACHED and seen is not None:
                held += nbytes - seen.add(rng.file, offset, offset + nbytes)
            submitted.append(source.submit_read(cached if how == CACHED else direct, offset,
                                                into[at:at + nbytes]))
    except BaseException:
        for future in submitted:  # the buffer is not given back under a read in flight
            future.exception()
        raise
    return all_of(submitted), held  # consecutive parts: a short one (end of file) ends the bytes


class Seen:
    """The bytes of each file one load has read through the page cache (read again, the
    host's cache serves them: not counted as read from storage twice)."""

    def __init__(self) -> None:
        self.ranges: dict[str, list[tuple[int, int]]] = {}

    def add(self, file: str, lo: int, hi: int) -> int:
        """Note [lo, hi) of ``file`` read -> how many of its bytes were not read before."""
        ranges = self.ranges.setdefault(file, [])
        old = sum(max(0, min(hi, b) - max(lo, a)) for a, b in ranges)
        ranges[:] = merged(sorted([*ranges, (lo, hi)]))
        return hi - lo - old


def _copied(known: Known, file: str, offset: int, into: memoryview) -> Future[int]:
    """``into`` filled from the held blocks of ``file`` that cover ``offset`` on (``cut``
    makes memory parts of held bytes only; adjacent held blocks may make one part)."""
    out = torch.frombuffer(into, dtype=torch.uint8) if len(into) else None
    end = offset + len(into)
    for lo, data in known.get(file, ()):
        a, b = max(lo, offset), min(lo + data.numel(), end)
        if out is not None and a < b:
            out[a - offset:b - offset].copy_(data[a - lo:b - lo])
    done: Future[int] = Future()
    done.set_result(len(into))
    return done


def _handle(source: StoreFiles, handles: dict[tuple[str, bool], FileHandle], name: str,
            cached: bool) -> FileHandle:
    if (name, cached) not in handles:
        handles[name, cached] = source.open_read(name, cached=cached)
    return handles[name, cached]


def cut(rng: ReadRange[Span], block_nbytes: int, known: Known | None = None) -> list[Part]:
    """``rng`` as consecutive parts, each BLOCK-aligned: the held (``known``) blocks' aligned
    insides from memory, the other partly wanted checksum blocks of its block spans through
    the cache, the bytes between them direct."""
    end = rng.offset + rng.nbytes
    cached = merged(sorted(
        (max(align_down(lo), rng.offset), min(align_up(hi), end))
        for span in rng.entries for lo, hi in _partly_wanted(span, block_nbytes)))
    held = merged(sorted(
        (max(align_up(lo), rng.offset), min(align_down(lo + data.numel()), end))
        for lo, data in (known or {}).get(rng.file, ())
        if lo < end and lo + data.numel() > rng.offset))
    cached, held = [r for r in cached if r[0] < r[1]], [r for r in held if r[0] < r[1]]
    edges = sorted({rng.offset, end, *(x for r in cached + held for x in r)})
    parts: list[Part] = []
    for lo, hi in zip(edges, edges[1:]):
        how = (MEMORY if _inside(held, lo, hi) else CACHED if _inside(cached, lo, hi)
               else DIRECT)
        if parts and parts[-1][2] == how:
            parts[-1] = (parts[-1][0], parts[-1][1] + hi - lo, how)
        else:
            parts.append((lo, hi - lo, how))
    return parts


def _inside(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    return any(a <= lo and hi <= b for a, b in ranges)


def _partly_wanted(span: Span, block_nbytes: int) -> list[tuple[int, int]]:
    """File ranges of the first and last checksum block of a block span when its pieces do
    not start at its first byte or end at its last: another read wants the rest of them."""
    if span.whole or not span.pieces:
        return []
    first = min(piece.offset for piece, _ in span.pieces)
    last = max(piece.offset + piece.nbytes for piece, _ in span.pieces)
    base = span.entry.offset
    out = []
    if first > span.offset:
        out.append((span.offset, min(span.end, span.offset + block_nbytes)))
    if last < span.end:
        out.append((max(span.offset, base + align_down(span.end - 1 - base, block_nbytes)),
                    span.end))
    return out
