"""A regular DTensor layout, described once per tensor instead of once per chunk.

A DTensor whose placements are only Shard(d) and Replicate holds, on the rank at mesh
coordinate c, the chunk torch's chunk arithmetic gives for c: mesh dims are applied in order,
each splitting the current size of its tensor dim into ceil(size / n)-element pieces (the last
ones shorter or empty), as torch.chunk and Shard do. So a ``Grid`` (the mesh's shape, its global
ranks and, per mesh dim, the tensor dim it shards) and the global shape name every chunk, and
every holder: ranks whose coordinates differ only along Replicate mesh dims hold the same
chunk. Of those replicas one writes it, chosen from the key alone (``writer``), so every rank
knows what it writes and what every other rank wrote without being told.

A rank uses a Grid only where its own chunk is what the grid gives (sharding.py checks against
torch) and the tensor has elements (every rank decides that alike from the shape). Chunks may
be empty (a nested or uneven split leaves some ranks none): nothing is written for them.
Everything else keeps the per-chunk path.

Owns: that arithmetic, for saves and for loads (a manifest of version 3 stores grids:
format/regular_section.py). Pure: no torch, no I/O. Does not own: recognising a DTensor
(planning/sharding.py), checking that ranks agree (planning/regular_items.py), or messages (wire.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import xxhash

from ckptio.format.geometry import Chunk

__all__ = ["REPLICATE", "Grid", "split"]

REPLICATE = -1  # a mesh dim along which the tensor is replicated, not sharded


def split(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` of ``size`` elements cut into ``parts`` as torch.chunk
    and Shard cut them: pieces of ceil(size / parts), the last ones shorter or empty."""
    piece = -(-size // parts)
    start = min(size, piece * index)
    return start, max(0, min(size, start + piece) - start)


@dataclass(frozen=True)
class Grid:
    """A device mesh and how one tensor is laid over it. ``ranks``: the mesh's global ranks,
    row-major over ``shape``; ``dims[m]``: the tensor dim mesh dim m shards, or REPLICATE."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    dims: tuple[int, ...]
    _position: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s coordinate in the mesh, or None if the mesh does not hold it."""
        if not self._position:
            self._position.update((r, i) for i, r in enumerate(self.ranks))
        flat = self._position.get(rank)
        if flat is None:
            return None
        coordinate = []
        for size in reversed(self.shape):
            flat, at = divmod(flat, size)
            coordinate.append(at)
        return tuple(reversed(coordinate))

    def chunk(self, shape: tuple[int, ...], coordinate: tuple[int, ...]) -> Chunk:
        """The chunk of a tensor of ``shape`` the holder at ``coordinate`` has. An empty one is
        placed at the end of its dim, as torch places it."""
        offsets, sizes = [0] * len(shape), list(shape)
        for parts, dim, index in zip(self.shape, self.dims, coordinate):
            if dim == REPLICATE:
                continue
            start, sizes[dim] = split(sizes[dim], parts, index)
            offsets[dim] = offsets[dim] + start if sizes[dim] else shape[dim]
        return Chunk(tuple(offsets), tuple(sizes))

    @cached_property
    def replicas(self) -> int:
        """How many ranks hold each chunk."""
        n = 1
        for parts, dim in zip(self.shape, self.dims):
            if dim == REPLICATE:
                n *= parts
        return n

    def replica(self, coordinate: tuple[int, ...]) -> int:
        """Which of its chunk's replicas the holder at ``coordinate`` is (0 .. replicas - 1)."""
        index = 0
        for parts, dim, at in zip(self.shape, self.dims, coordinate):
            if dim == REPLICATE:
                index = index * parts + at
        return index

    def writer(self, key: str) -> int:
        """Which replica writes each chunk of ``key``: number hash(key) mod replicas, so
        replicated tensors spread over their holders."""
        if self.replicas == 1:
            return 0
        return xxhash.xxh3_64_intdigest(key.encode()) % self.replicas
