"""Whether a tensor's chunks tile its shape: every element in exactly one chunk.

A manifest's chunks of one key must tile the key's shape, so a load fills the whole tensor and
never allocates more than the data files hold (a shape larger than its chunks is refused before
any allocation). Boxes (``Chunk``) and flat ranges (``Chunk.flat``, decomposed into boxes by
geometry.flat_boxes) are checked exactly, in time proportional to the number of chunks for the
layouts saves produce (row, column, grid or flat shards).

Owns: tiling_problem and its sweep. Used by validate.py on every decoded manifest.
Pure: no I/O, no torch.
"""

from __future__ import annotations

from ckptio.format.geometry import FlatRange, flat_boxes
from ckptio.format.types import Chunk

__all__ = ["tiling_problem"]

_Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, end) in every dimension
_TILING_WORK = 64  # per chunk and dimension: the most work tiling_problem spends on a key


def tiling_problem(chunks: list[Chunk], shape: tuple[int, ...]) -> str | None:
    """Why ``chunks`` (each inside ``shape``) do not tile a tensor of ``shape``, or None.

    Exact, and in time proportional to the number of chunks for the layouts saves produce (row,
    column, grid or flat shards): the volumes must add up, flat ranges must follow each other,
    and boxes are swept one dimension at a time (see _sweep)."""
    total = _numel(shape)
    held = sum(chunk.numel for chunk in chunks)
    if held != total:
        return (f"its {len(chunks)} chunk(s) hold {held} of the {total} elements of shape "
                f"{shape} ({'a chunk is missing' if held < total else 'chunks overlap'})")
    if total == 0 or len(chunks) == 1:  # one chunk inside the shape, as large as it: the whole
        return None
    if all(chunk.flat for chunk in chunks):
        return _flat_gap(chunks)
    boxes: list[_Box] = []
    for chunk in chunks:
        parts = ([box for _first, box in
                  flat_boxes(FlatRange(chunk.offsets[0], chunk.sizes[0]), shape)]
                 if chunk.flat else [chunk])
        boxes.extend((box.offsets, tuple(o + s for o, s in zip(box.offsets, box.sizes)))
                     for box in parts if box.numel)
    return _sweep(boxes, shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _flat_gap(chunks: list[Chunk]) -> str | None:
    """Flat ranges (volumes already adding up) tile the tensor iff, in order, each starts where
    the one before ends."""
    end = 0
    for start, size in sorted((ch.offsets[0], ch.sizes[0]) for ch in chunks if ch.sizes[0]):
        if start != end:
            return (f"its flat chunks {'overlap' if start < end else 'leave a gap'} at element "
                    f"{min(start, end)}")
        end = start + size
    return None


def _sweep(boxes: list[_Box], shape: tuple[int, ...]) -> str | None:
    """Boxes inside ``shape`` tile it iff, along one dimension, the boxes crossing each slab
    between consecutive box boundaries tile the slab's cross-section (the other dimensions),
    down to single boxes. Each step sweeps the dimension the fewest box-slab crossings cost;
    a layout that would take more than _TILING_WORK steps per box and dimension is refused."""
    budget = _TILING_WORK * len(boxes) * (len(shape) + 1)
    stack: list[tuple[list[_Box], tuple[int, ...]]] = [(boxes, tuple(range(len(shape))))]
    while stack:
        group, dims = stack.pop()
        dims = tuple(d for d in dims if any(b[0][d] or b[1][d] != shape[d] for b in group))
        if len(dims) <= 1:  # along one dimension (or none), the boxes are intervals
            problem = _interval_gap(group, dims[0] if dims else None, shape)
            if problem is not None:
                return problem
            continue
        costs = {d: _crossings(group, d) for d in dims}
        dim = min(dims, key=costs.__getitem__)
        budget -= len(group) * len(dims) + costs[dim]
        if budget < 0:  # checked before the sweep builds its slabs
            return (f"its {len(boxes)} chunks are laid out too irregularly for this reader to "
                    "check that they tile the tensor")
        rest = tuple(d for d in dims if d != dim)
        for at, crossing in _slabs(group, dim, shape[dim]):
            if not crossing:
                return f"no chunk holds index {at} of dimension {dim} (in part of the tensor)"
            stack.append((crossing, rest))
    return None


def _interval_gap(group: list[_Box], dim: int | None, shape: tuple[int, ...]) -> str | None:
    """Boxes spanning the whole region but along ``dim`` tile it iff their intervals along
    ``dim``, in order, each start where the one before ends, from 0 to the end."""
    if dim is None:
        return None if len(group) == 1 else f"{len(group)} of its chunks overlap"
    end = 0
    for start, stop in sorted((b[0][dim], b[1][dim]) for b in group):
        if start != end:
            break
        end = stop
    else:
        if end == shape[dim]:
            return None
        start = shape[dim]
    return (f"its chunks {'overlap' if start < end else 'leave a gap'} at index "
            f"{min(start, end)} of dimension {dim} (in part of the tensor)")


def _cuts(group: list[_Box], dim: int, extent: int) -> list[int]:
    return sorted({0, extent, *(b[0][dim] for b in group), *(b[1][dim] for b in group)})


def _crossings(group: list[_Box], dim: int) -> int:
    """How many (box, slab) pairs sweeping ``dim`` visits: the cost of choosing it."""
    index = {cut: i for i, cut in enumerate(sorted({*(b[0][dim] for b in group),
                                                     *(b[1][dim] for b in group)}))}
    return sum(index[b[1][dim]] - index[b[0][dim]] for b in group)


def _slabs(group: list[_Box], dim: int, extent: int) -> list[tuple[int, list[_Box]]]:
    """(start, the boxes crossing it) for each slab of ``dim`` between box boundaries."""
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for i, box in enumerate(group):
        starts.setdefault(box[0][dim], []).append(i)
        ends.setdefault(box[1][dim], []).append(i)
    active: dict[int, _Box] = {}
    out: list[tuple[int, list[_Box]]] = []
    for at in _cuts(group, dim, extent)[:-1]:
        for i in ends.get(at, ()):
            del active[i]
        for i in starts.get(at, ()):
            active[i] = group[i]
        out.append((at, list(active.values())))
    return out
