"""The chunks of a regular tensor that overlap a region, found from its grid alone.

A regular tensor (format/regular_section.py) lists no chunks: its grid (grid.py) names every
one and its writer. ``overlapping`` walks the mesh dims and visits, along each sharded dim,
only the pieces that reach the region, and along each replicated dim only the coordinate of the
replica that writes the key, so a reader that wants a small region of a large mesh visits only
the chunks it needs.

Call order: format/regular_section.py ``expand`` (a load's wanted regions -> the chunks and
their writers' index files) and loading/resolve_regular.py call ``overlapping`` per key.

Owns: that walk. Pure: no torch, no I/O. Does not own: the grid's arithmetic (grid.py), the
index files and rows of the chunks found (regular_section.py), which regions a load wants
(loading/resolve_regular.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ckptio.format.geometry import Chunk
from ckptio.format.grid import REPLICATE, Grid, split
from ckptio.format.types import RegularTensor

__all__ = ["overlapping"]


def overlapping(grid: Grid, tensor: RegularTensor, region: Chunk | None) -> Iterator[
        tuple[int, Chunk]]:
    """(writer rank, chunk) of each non-empty chunk of ``tensor`` that overlaps ``region``
    (None: all): along each mesh dim only the pieces that reach the region are visited, and
    along replicated dims only the writer's coordinate (Grid.writer)."""
    shape = tensor.shape
    if region is not None and (region.flat or not region.fits(shape)):
        region = None
    if region is not None and not region.numel:
        return
    fixed = _writer_digits(grid, tensor.key)
    walk = _Walk(grid, shape, fixed, region, [0] * len(grid.shape))
    yield from walk.chunks(0, [0] * len(shape), list(shape))


@dataclass
class _Walk:
    """overlapping's walk over the mesh dims (an object, not a recursive closure, so no
    reference cycle outlives the call)."""

    grid: Grid
    shape: tuple[int, ...]
    fixed: dict[int, int]
    region: Chunk | None
    coordinate: list[int]

    def chunks(self, m: int, offsets: list[int], sizes: list[int]) -> Iterator[
            tuple[int, Chunk]]:
        grid, coordinate = self.grid, self.coordinate
        if m == len(grid.shape):
            if all(sizes):
                yield grid.ranks[_flat(grid, coordinate)], grid.chunk(self.shape,
                                                                      tuple(coordinate))
            return
        dim, parts = grid.dims[m], grid.shape[m]
        if dim == REPLICATE:
            coordinate[m] = self.fixed[m]
            yield from self.chunks(m + 1, offsets, sizes)
            return
        for index in _reaching(parts, offsets[dim], sizes[dim], self.region, dim):
            start, length = split(sizes[dim], parts, index)
            coordinate[m] = index
            yield from self.chunks(m + 1, _set(offsets, dim, offsets[dim] + start),
                                   _set(sizes, dim, length))


def _reaching(parts: int, base: int, size: int, region: Chunk | None, dim: int) -> range:
    """The pieces (of ``size`` elements from ``base`` cut into ``parts``) that reach the
    region along ``dim``."""
    if region is None or size == 0:
        return range(parts)
    piece = -(-size // parts)
    lo = region.offsets[dim] - base
    hi = lo + region.sizes[dim]
    return range(max(0, lo // piece), min(parts, max(0, -(-hi // piece))))


def _writer_digits(grid: Grid, key: str) -> dict[int, int]:
    """The coordinate, along each replicated mesh dim, of the replica that writes ``key``."""
    writer, digits = grid.writer(key), {}
    for m in reversed(range(len(grid.shape))):
        if grid.dims[m] == REPLICATE:
            writer, digits[m] = divmod(writer, grid.shape[m])
    return digits


def _flat(grid: Grid, coordinate: list[int]) -> int:
    flat = 0
    for size, at in zip(grid.shape, coordinate):
        flat = flat * size + at
    return flat


def _set(values: list[int], at: int, value: int) -> list[int]:
    out = list(values)
    out[at] = value
    return out

