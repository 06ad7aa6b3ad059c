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

Owns: which byte ranges of a read go through the cache, submitting the parts (joined by
io.backend_contract.all_of). Does not own: the spans (read.py), opening files (the store's StoreFiles) or
the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from ckptio.alignment import align_down, align_up
from ckptio.format.types import ReadRange
from ckptio.io import FileHandle
from ckptio.io.backend_contract import all_of
from ckptio.storage.files import StoreFiles

__all__ = ["submit_parts"]

Part = tuple[int, int, bool]  # file offset, bytes, through the page cache


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
                 rng: ReadRange[Span], into: memoryview, block_nbytes: int) -> Future[int]:
    """Read ``rng`` into ``into`` (its ``nbytes`` bytes): one read through its direct handle,
    or, where it holds partly wanted blocks, parts of it through a cached handle too. The
    future gives the bytes read from ``rng.offset`` on (fewer only at end of file)."""
    direct = _handle(source, handles, rng.file, False)
    parts = cut(rng, block_nbytes) if direct.direct else []
    if not any(cached for _, _, cached in parts):
        return source.submit_read(direct, rng.offset, into)
    cached = _handle(source, handles, rng.file, True)
    submitted: list[Future[int]] = []
    try:
        for offset, nbytes, through_cache in parts:
            at = offset - rng.offset
            submitted.append(source.submit_read(cached if through_cache else direct, offset,
                                                into[at:at + nbytes]))
    except BaseException:
        for future in submitted:  # the buffer is not given back under a read in flight
            future.exception()
        raise
    return all_of(submitted)  # consecutive parts: a short one (end of file) ends the bytes


def _handle(source: StoreFiles, handles: dict[tuple[str, bool], FileHandle], name: str,
            cached: bool) -> FileHandle:
    if (name, cached) not in handles:
        handles[name, cached] = source.open_read(name, cached=cached)
    return handles[name, cached]


def cut(rng: ReadRange[Span], block_nbytes: int) -> list[Part]:
    """``rng`` as consecutive parts, each BLOCK-aligned: the partly wanted checksum blocks of
    its block spans through the cache, the bytes between them direct."""
    end = rng.offset + rng.nbytes
    cached = _merged(sorted(
        (max(align_down(lo), rng.offset), min(align_up(hi), end))
        for span in rng.entries for lo, hi in _partly_wanted(span, block_nbytes)))
    parts: list[Part] = []
    pos = rng.offset
    for lo, hi in cached:
        if lo >= hi:
            continue
        if pos < lo:
            parts.append((pos, lo - pos, False))
        parts.append((max(lo, pos), hi - max(lo, pos), True))
        pos = max(pos, hi)
    if pos < end:
        parts.append((pos, end - pos, False))
    return parts


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


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
