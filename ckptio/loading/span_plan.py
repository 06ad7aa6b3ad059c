"""A load's Reads as spans of stored entries, the unit one checksum covers: pure planning, no
I/O.

Call order: read.py's read_regions calls ``plan_spans`` (the rules are on it), then coalesces
the spans into reads (layout.coalesce_reads, asking ``in_one_read`` which spans must stay within
one read) and runs its read-ahead loop over them.

Owns: Reads -> spans (a whole entry as one span, other regions as pieces widened to whole
checksum blocks), the Span record the loop checks and copies out. Does not own: the piece
arithmetic (reshard.py), coalescing (layout.py), reading, checking or copying (read.py,
checks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ckptio.alignment import BLOCK, align_down, align_up
from ckptio.errors import CorruptCheckpointError
from ckptio.format.types import DTYPE_ITEMSIZE, Chunk, Read, TensorEntry
from ckptio.planning.reshard import Piece, plan_reads, region_of, stored_from_entry

__all__ = ["Dest", "Span", "in_one_read", "plan_spans"]

Dest = torch.Tensor | None  # None: read and verified, copied nowhere
Parts = dict[int, tuple[TensorEntry, list[tuple[Piece, Dest]]]]  # id(entry) -> its pieces


@dataclass(eq=False)
class Span:
    """Bytes [offset, offset + nbytes) of stored entry ``entry`` that one check covers: the whole
    entry (``whole``: its checksum; copied into each of ``dests``, maybe over several reads) or
    whole checksum blocks of it (within one read; copied out as ``pieces``)."""

    entry: TensorEntry
    offset: int
    nbytes: int
    whole: bool
    dests: list[torch.Tensor] = field(default_factory=list)
    pieces: list[tuple[Piece, Dest]] = field(default_factory=list)

    @property
    def file(self) -> str:
        return self.entry.file

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def plan_spans(reads: Sequence[Read], block_nbytes: int, buffer_bytes: int) -> list[Span]:
    """Every read as spans: a whole entry as one span (however many reads want it), other
    regions as pieces widened to whole blocks and grouped per entry into spans that fit one
    buffer with their alignment. An entry wanted whole and in part is planned in part only.

    * a Read of one whole entry (the same layout) is one span over the entry, checked against
      the entry's whole checksum; it may spread over several reads, and its bytes are copied in
      as they arrive (an entry within one read is checked before a byte of it is copied);
    * any other Read is cut into pieces (reshard.plan_reads), each widened to whole checksum
      blocks of its entry (Manifest.block_nbytes) and grouped per entry into spans that fit
      one buffer, whose blocks are checked before a byte of them is copied out.

    An entry one Read wants whole and another in part is read in part (block by block) only,
    so no byte is read twice. An entry whose bytes lie in another order of its dims
    (``TensorEntry.order``: a DCP or torch.save tensor saved transposed) is read whole into a
    tensor in that order, and the region wanted of it is copied out permuted back once the
    read is done (read_regions)."""
    limit = max(buffer_bytes - 2 * BLOCK, 4 * block_nbytes)  # larger than a buffer: a one-off
    max_read = limit - 2 * block_nbytes
    wholes: dict[int, Span] = {}
    parts: Parts = {}
    for read in reads:
        entry = read.whole
        if entry is None:
            _add_pieces(parts, read.key, read.entries, read.region, read.dest, max_read)
            continue
        span = wholes.setdefault(id(entry), Span(entry, entry.offset, entry.nbytes, True))
        if read.dest is not None:
            span.dests.append(read.dest)
    for key in [key for key in wholes if key in parts]:  # one plan for the entry: none read twice
        span = wholes.pop(key)
        dests: list[torch.Tensor | None] = [*span.dests] or [None]
        for dest in dests:
            _add_pieces(parts, span.entry.key, (span.entry,), span.entry.chunk, dest, max_read)
    return [*wholes.values(), *_block_spans(parts, block_nbytes, limit)]


def _add_pieces(parts: Parts, key: str, entries: tuple[TensorEntry, ...], region: Chunk,
                dest: Dest, max_read: int) -> None:
    """The pieces (reshard.plan_reads) that fill ``region`` of ``key`` from ``entries``."""
    head = entries[0]
    try:
        stored = [stored_from_entry(e) for e in entries]
        pieces = plan_reads(stored, region_of(region), head.shape, DTYPE_ITEMSIZE[head.dtype],
                            max_read)
    except ValueError as exc:
        raise CorruptCheckpointError(f"key {key!r}: {exc}") from None
    for piece in pieces:
        entry = entries[piece.source]
        parts.setdefault(id(entry), (entry, []))[1].append((piece, dest))


def _block_spans(parts: Parts, block_nbytes: int, limit: int) -> list[Span]:
    """Each entry's pieces, widened to whole blocks, as spans of at most ``limit`` bytes."""
    spans: list[Span] = []
    for entry, pieces in parts.values():
        current: Span | None = None
        for piece, dest in sorted(pieces, key=lambda pd: pd[0].offset):
            lo, hi = _blocks(entry, piece, block_nbytes)
            if current is not None and max(hi, current.end) - current.offset <= limit:
                current.nbytes = max(hi, current.end) - current.offset
            else:
                current = Span(entry, lo, hi - lo, False)
                spans.append(current)
            current.pieces.append((piece, dest))
    return spans


def _blocks(entry: TensorEntry, piece: Piece, block_nbytes: int) -> tuple[int, int]:
    """The piece's byte range widened to whole blocks of its entry (file offsets)."""
    start = piece.offset - entry.offset
    lo = align_down(start, block_nbytes)
    hi = min(align_up(start + piece.nbytes, block_nbytes), entry.nbytes)
    return entry.offset + lo, entry.offset + hi


def in_one_read(span: Span) -> bool:
    """Block spans are checked whole within one read; a whole entry may spread over several,
    except one at an offset that is not a multiple of its itemsize (a foreign checkpoint's, e.g.
    DCP's) going to a non-contiguous destination: read boundaries would cut its elements, which
    only a contiguous destination takes byte by byte (_copy_whole)."""
    if not span.whole:
        return True
    return _misaligned(span.entry) and any(not d.is_contiguous() for d in span.dests)


def _misaligned(entry: TensorEntry) -> bool:
    return entry.offset % DTYPE_ITEMSIZE[entry.dtype] != 0
