"""Resharding reads: which bytes of which stored entries fill a wanted region of a global tensor,
and how each read is copied into the destination.

A global tensor of shape G (row-major, ``itemsize`` bytes per element) was saved as stored
entries, each holding a *region* of it contiguously in a file: a box (``Chunk``: offsets and
sizes per dimension, DTensor / tensor-parallel shards) or a flat range (``FlatRange``: elements
[start, start+length) of the row-major flattened tensor, ZeRO / FSDP1 flat partitions that need
not fall on row boundaries). A load wants a region too (box or flat) and gets a list of Pieces:
one contiguous byte range of one stored entry's file each, and where its elements go, as data.
Every piece is ONE strided copy, and there are O(ndim) of them per overlapping pair of regions
(why: on ``plan_reads``).

Call order: ``stored_from_entry`` per entry -> ``plan_reads`` (pure) -> the caller coalesces
and reads -> ``execute`` copies each piece (the only function that touches tensors, and only
through their methods: no torch import).

Owns: box intersection and subtraction, coverage checking (each destination element is read
exactly once, from the first stored entry that holds it) and splitting reads to ``max_read``.
The flat<->box decomposition is format/geometry.py's (re-exported here). Does not own:
coalescing pieces into large aligned reads (layout), issuing them (io), checksums
(loading/read), or which regions a rank wants (api / dist).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING

from ckptio.format.geometry import FlatRange, flat_boxes, flat_index
from ckptio.format.types import DTYPE_ITEMSIZE, Chunk, TensorEntry

if TYPE_CHECKING:
    import torch

__all__ = ["FlatRange", "Piece", "Region", "Stored", "dest_view", "execute", "flat_boxes",
           "flat_index", "intersect", "plan_reads", "region_of", "source_view",
           "stored_from_entry", "subtract"]

Region = Chunk | FlatRange


@dataclass(frozen=True)
class Stored:
    """One stored entry: ``region`` of the global tensor, contiguous row-major at ``offset`` of
    ``file`` (``region.numel * itemsize`` bytes)."""

    region: Region
    file: str
    offset: int


@dataclass(frozen=True)
class Piece:
    """One read and the one strided copy that applies it.

    Read: ``nbytes`` bytes at ``offset`` of ``file``, all inside stored entry number ``source``.
    Copy: view those bytes as a row-major tensor of ``src_shape`` and take the block starting at
    ``src_start`` of ``sizes``; it goes to the block starting at ``dst_start`` of the destination,
    viewed as: the destination itself (``dst_base is None``: a box was wanted, shape
    ``want.sizes``), or ``dest[dst_base : dst_base + prod(dst_shape)].view(dst_shape)`` (a flat
    range was wanted; dest is 1-D). ``src_shape``, ``src_start``, ``sizes``, ``dst_start`` and
    ``dst_shape`` all have the global tensor's number of dimensions.
    """

    source: int
    file: str
    offset: int
    nbytes: int
    src_shape: tuple[int, ...]
    src_start: tuple[int, ...]
    sizes: tuple[int, ...]
    dst_start: tuple[int, ...]
    dst_shape: tuple[int, ...]
    dst_base: int | None = None

    @property
    def numel(self) -> int:
        """Elements this piece copies into the destination."""
        return prod(self.sizes)


def region_of(chunk: Chunk) -> Region:
    """A manifest chunk as a region: a box, or a flat range when ``chunk.flat``."""
    return FlatRange(chunk.offsets[0], chunk.sizes[0]) if chunk.flat else chunk


def stored_from_entry(entry: TensorEntry) -> Stored:
    """The Stored form of a manifest entry; checks its byte length against its chunk."""
    itemsize = DTYPE_ITEMSIZE.get(entry.dtype)
    if itemsize is not None and entry.nbytes != entry.chunk.numel * itemsize:
        raise ValueError(
            f"tensor {entry.key!r}: entry in {entry.file} holds {entry.nbytes} bytes but its chunk "
            f"{_describe(entry.chunk)} of {entry.dtype} needs {entry.chunk.numel * itemsize}"
        )
    return Stored(region=region_of(entry.chunk), file=entry.file, offset=entry.offset)


# ------------------------------------------------------------------------------------------------
# boxes


def intersect(a: Chunk, b: Chunk) -> Chunk | None:
    """The common box of ``a`` and ``b``, or None when it is empty."""
    if len(a.offsets) != len(b.offsets):
        raise ValueError(f"cannot intersect boxes of {len(a.offsets)} and {len(b.offsets)} dims")
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Chunk(tuple(offsets), tuple(sizes))


def subtract(box: Chunk, hole: Chunk) -> list[Chunk]:
    """Disjoint boxes covering ``box`` minus ``hole`` (``hole`` inside ``box``): at most 2*ndim,
    slabs along dim 0 first, so a row-sharded remainder stays one box per side."""
    pieces: list[Chunk] = []
    offsets, sizes = list(box.offsets), list(box.sizes)
    for dim, (lo, size) in enumerate(zip(hole.offsets, hole.sizes)):
        start, end = offsets[dim], offsets[dim] + sizes[dim]
        for a, b in ((start, lo), (lo + size, end)):
            if b > a:
                pieces.append(Chunk(tuple(offsets[:dim]) + (a,) + tuple(offsets[dim + 1:]),
                                    tuple(sizes[:dim]) + (b - a,) + tuple(sizes[dim + 1:])))
        offsets[dim], sizes[dim] = lo, size
    return pieces


# ------------------------------------------------------------------------------------------------
# planning


@dataclass(frozen=True)
class _Source:
    """A box of a stored entry, contiguous row-major at byte ``offset`` of ``file``."""

    index: int
    file: str
    offset: int
    box: Chunk


@dataclass(frozen=True)
class _Target:
    """A box of the wanted region and the destination view it lands in (see Piece)."""

    box: Chunk
    base: int | None
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _Read:
    """One read of a row-major box: byte offset in the box, the read's shape, the block copied
    from it (start within the read, sizes) and where that block starts within the box."""

    offset: int
    shape: tuple[int, ...]
    start: tuple[int, ...]
    sizes: tuple[int, ...]
    at: tuple[int, ...]


def plan_reads(
    stored: Sequence[Stored],
    want: Region,
    global_shape: tuple[int, ...],
    itemsize: int,
    max_read: int,
) -> list[Piece]:
    """The pieces that fill ``want`` from ``stored``: each destination element exactly once, from
    the first stored entry (in the given order) that holds it; each read at most ``max_read``
    bytes unless one element is larger.

    Everything is reduced to boxes: a flat range is the union of at most 2*ndim-1 boxes, each
    contiguous and in the same order in the flattened tensor (``flat_boxes``). So every piece,
    whatever the region kinds, is ONE strided copy: the read bytes viewed as a row-major tensor
    (``src_shape``), narrowed to a block (``src_start``, ``sizes``), copied into the
    destination narrowed the same way. The number of pieces is O(ndim) per overlapping pair of
    regions plus whatever ``max_read`` splitting needs, never O(rows) or O(elements).

    Raises ValueError on a malformed region, or when ``stored`` does not cover ``want`` (the
    message names the uncovered boxes and the first uncovered element).
    """
    shape = tuple(global_shape)
    if itemsize < 1 or max_read < 1:
        raise ValueError(f"itemsize ({itemsize}) and max_read ({max_read}) must be positive")
    _check_region(want, shape, "wanted region")
    for i, entry in enumerate(stored):
        _check_region(entry.region, shape, f"stored entry {i} ({entry.file}@{entry.offset})")
    remaining = [(target, target.box) for target in _targets(want, shape)]
    pieces: list[Piece] = []
    for source in _sources(stored, shape, itemsize):
        if not remaining:
            break
        left: list[tuple[_Target, Chunk]] = []
        for target, box in remaining:
            hit = intersect(source.box, box)
            if hit is None:
                left.append((target, box))
                continue
            pieces.extend(_pieces(source, target, hit, itemsize, max_read))
            left.extend((target, rest) for rest in subtract(box, hit))
        remaining = left
    if remaining:
        raise ValueError(_uncovered_message(want, shape, [box for _, box in remaining]))
    return pieces


def _sources(stored: Sequence[Stored], shape: tuple[int, ...], itemsize: int) -> Iterator[_Source]:
    """Every stored entry as boxes with their byte offsets (a flat range gives several)."""
    for index, entry in enumerate(stored):
        region = entry.region
        if isinstance(region, Chunk):
            if region.numel:
                yield _Source(index, entry.file, entry.offset, region)
            continue
        for first, box in flat_boxes(region, shape):
            offset = entry.offset + (first - region.start) * itemsize
            yield _Source(index, entry.file, offset, box)


def _targets(want: Region, shape: tuple[int, ...]) -> list[_Target]:
    if isinstance(want, Chunk):
        return [_Target(want, None, want.sizes)] if want.numel else []
    return [_Target(box, first - want.start, box.sizes) for first, box in flat_boxes(want, shape)]


def _pieces(source: _Source, target: _Target, hit: Chunk, itemsize: int,
            max_read: int) -> Iterator[Piece]:
    """The reads of ``source`` that cover ``hit`` (a box inside both source and target)."""
    lo = tuple(h - s for h, s in zip(hit.offsets, source.box.offsets))
    for read in _reads(source.box.sizes, lo, hit.sizes, itemsize, max_read):
        dst_start = tuple(s + a - t for s, a, t in
                          zip(source.box.offsets, read.at, target.box.offsets))
        yield Piece(
            source=source.index, file=source.file, offset=source.offset + read.offset,
            nbytes=prod(read.shape) * itemsize, src_shape=read.shape, src_start=read.start,
            sizes=read.sizes, dst_start=dst_start, dst_shape=target.shape, dst_base=target.base,
        )


def _reads(sizes: tuple[int, ...], lo: tuple[int, ...], n: tuple[int, ...], itemsize: int,
           max_read: int) -> Iterator[_Read]:
    """Reads of a row-major box of ``sizes`` that cover its sub-box (``lo``, ``n``).

    Whole rows (along dim 0) as many as fit in ``max_read``; when one row is larger, each needed
    row is split the same way along its next dim, down to single elements.
    """
    if not sizes:  # a 0-d tensor: one element
        yield _Read(0, (), (), (), ())
        return
    inner = sizes[1:]
    row = prod(inner) * itemsize
    if row <= max_read or not inner:
        per = max(1, max_read // row)
        for r in range(lo[0], lo[0] + n[0], per):
            k = min(per, lo[0] + n[0] - r)
            yield _Read(r * row, (k,) + inner, (0,) + lo[1:], (k,) + n[1:], (r,) + lo[1:])
        return
    for r in range(lo[0], lo[0] + n[0]):
        for sub in _reads(inner, lo[1:], n[1:], itemsize, max_read):
            yield _Read(r * row + sub.offset, (1,) + sub.shape, (0,) + sub.start,
                        (1,) + sub.sizes, (r,) + sub.at)


# ------------------------------------------------------------------------------------------------
# validation and messages


def _check_region(region: Region, shape: tuple[int, ...], what: str) -> None:
    if isinstance(region, FlatRange):
        total = prod(shape)
        if region.start < 0 or region.length < 0 or region.start + region.length > total:
            raise ValueError(f"{what}: flat range [{region.start}, "
                             f"{region.start + region.length}) is outside a tensor of {total} "
                             f"elements (shape {shape})")
        return
    if not isinstance(region, Chunk):
        raise ValueError(f"{what}: expected a Chunk or a FlatRange, got {type(region).__name__}")
    if len(region.offsets) != len(shape) or len(region.sizes) != len(shape):
        raise ValueError(f"{what}: box {_describe(region)} has the wrong number of dims for "
                         f"global shape {shape}")
    for o, s, g in zip(region.offsets, region.sizes, shape):
        if o < 0 or s < 0 or o + s > g:
            raise ValueError(f"{what}: box {_describe(region)} is outside global shape {shape}")


def _describe(region: Region) -> str:
    if isinstance(region, FlatRange):
        return f"flat [{region.start}, {region.start + region.length})"
    return f"offsets={region.offsets} sizes={region.sizes}"


def _uncovered_message(want: Region, shape: tuple[int, ...], holes: list[Chunk]) -> str:
    first = min(holes, key=lambda box: flat_index(box.offsets, shape))
    shown = ", ".join(_describe(box) for box in holes[:3])
    more = f" and {len(holes) - 3} more" if len(holes) > 3 else ""
    return (
        f"stored chunks do not cover the wanted region {_describe(want)} of a tensor of shape "
        f"{shape}: {sum(box.numel for box in holes)} elements are missing, in box(es) {shown}"
        f"{more}; the first missing element is global index {first.offsets} (flat index "
        f"{flat_index(first.offsets, shape)}). Was the checkpoint saved with every rank's shard?"
    )


# ------------------------------------------------------------------------------------------------
# applying a piece


def source_view(piece: Piece, data: torch.Tensor) -> torch.Tensor:
    """The block of ``data`` (the piece's bytes as a 1-D tensor) that the piece copies."""
    return data.view(piece.src_shape)[_slices(piece.src_start, piece.sizes)]


def dest_view(piece: Piece, dest: torch.Tensor) -> torch.Tensor:
    """The block of ``dest`` the piece fills. A flat destination must be 1-D (any stride)."""
    if piece.dst_base is not None:
        dest = dest[piece.dst_base:piece.dst_base + prod(piece.dst_shape)].view(piece.dst_shape)
    return dest[_slices(piece.dst_start, piece.sizes)]


def execute(piece: Piece, data: torch.Tensor, dest: torch.Tensor) -> None:
    """Copy one read into the destination: one strided ``copy_`` between two views.

    ``data``: the piece's ``nbytes`` bytes as a 1-D tensor of the stored dtype (raw uint8 bytes
    are reinterpreted as ``dest.dtype``). ``dest``: the wanted region's tensor, shape
    ``want.sizes`` (box) or ``(want.length,)`` (flat); any strides, any device.
    """
    if data.dtype != dest.dtype:
        data = data.view(dest.dtype)
    dest_view(piece, dest).copy_(source_view(piece, data))


def _slices(start: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(start, sizes))
