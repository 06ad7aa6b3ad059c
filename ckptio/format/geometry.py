"""Flat ranges of a row-major tensor, and the boxes they are made of.

A flat range (``FlatRange``: elements [start, start+length) of the row-major flattened global
tensor, a ZeRO / FSDP1 flat partition that need not fall on row boundaries) is the union of at most
2*ndim-1 boxes (``Chunk``), each contiguous in the flattened tensor and in the same element order
(``flat_boxes``).

Owns: the box (``Chunk``, also named by format/types.py), that decomposition and the row-major
flat index. Used by the manifest's tiling check
(tiling.py) and by resharding reads (planning/reshard.py), which re-exports these names.
Pure: integers and dataclasses in and out; no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

__all__ = ["Chunk", "FlatRange", "flat_boxes", "flat_index"]


@dataclass(frozen=True)
class Chunk:
    """The region of the global tensor a stored entry holds: a box (offsets and sizes per
    dimension), or with ``flat`` elements [offsets[0], offsets[0] + sizes[0]) of the row-major
    flattened tensor (a ZeRO / FSDP1 flat partition, not necessarily on row boundaries)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: bool = False

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Chunk:
        return Chunk(offsets=(0,) * len(shape), sizes=tuple(shape))

    @property
    def numel(self) -> int:
        n = 1
        for size in self.sizes:
            n *= size
        return n

    def fits(self, shape: tuple[int, ...]) -> bool:
        """Whether this region lies inside a tensor of ``shape``."""
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            return False
        if self.flat:
            return (len(self.offsets) == len(self.sizes) == 1
                    and self.offsets[0] + self.sizes[0] <= Chunk.whole(shape).numel)
        return len(self.offsets) == len(shape) == len(self.sizes) and all(
            o + s <= d for o, s, d in zip(self.offsets, self.sizes, shape))


@dataclass(frozen=True)
class FlatRange:
    """Elements [start, start+length) of the row-major flattened global tensor."""

    start: int
    length: int

    @property
    def numel(self) -> int:
        return self.length


def flat_index(index: Sequence[int], shape: Sequence[int]) -> int:
    """Row-major flat index of ``index`` in a tensor of ``shape``."""
    flat = 0
    for i, size in zip(index, shape):
        flat = flat * size + i
    return flat


def flat_boxes(flat: FlatRange, shape: tuple[int, ...]) -> list[tuple[int, Chunk]]:
    """``flat`` as (first flat index, box) pairs in order: at most 2*ndim-1 boxes, each contiguous
    in the flattened tensor and in the same element order (leading dims of size 1, one partial
    dim, full trailing dims)."""
    out: list[Chunk] = []
    _flat_boxes(flat.start, flat.length, shape, (), out)
    return [(flat_index(box.offsets, shape), box) for box in out]


def _flat_boxes(start: int, count: int, shape: tuple[int, ...], prefix: tuple[int, ...],
                out: list[Chunk]) -> None:
    if count <= 0:
        return
    lead = (1,) * len(prefix)
    if len(shape) <= 1:
        out.append(Chunk(prefix + (start,) * len(shape), lead + (count,) * len(shape)))
        return
    inner = shape[1:]
    row = prod(inner)
    first, head = divmod(start, row)
    last, tail = divmod(start + count, row)
    if first == last:
        _flat_boxes(head, count, inner, prefix + (first,), out)
        return
    if head:
        _flat_boxes(head, row - head, inner, prefix + (first,), out)
        first += 1
    if last > first:
        out.append(Chunk(prefix + (first,) + (0,) * len(inner), lead + (last - first,) + inner))
    if tail:
        _flat_boxes(0, tail, inner, prefix + (last,), out)
