"""A DTensor's placements on its device mesh as planning needs them: this rank's box of the
tensor (torch's own local-shape arithmetic, once per shape and placements of a mesh), whether
the placements hold a region at all (Partial is refused; a ``_StridedShard`` is checked to
hold one box), the layout as a regular Grid (a ``_StridedShard`` in its cutting order) and a
short name of the mesh's ranks (DTensors of one mesh holding one region are replicas).

Owns: that arithmetic and its per-mesh answers (held weakly: a mesh holds its process groups).
Does not own: which leaf is a DTensor and the region record it gives (sharding.py), who writes
which region (globalplan.py).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import xxhash

from ckptio.errors import UnsupportedStateError
from ckptio.format.grid import REPLICATE, Grid
from ckptio.format.types import Chunk

__all__ = ["check_box", "check_placements", "grid_of", "local_box", "mesh_domain"]


def local_box(shape: tuple[int, ...], mesh: Any,
         placements: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's (sizes, offsets) of a DTensor of ``shape`` on ``mesh``: torch's arithmetic
    (compute_local_shape_and_global_offset), once per shape and placements of a mesh (it builds
    index tensors per call; a model's layers repeat a few shapes many times over)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    known = _BOXES.setdefault(mesh, {})
    box = known.get((shape, placements))
    if box is None:
        sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        box = known[shape, placements] = (tuple(int(n) for n in sizes),
                                          tuple(int(o) for o in offsets))
    return box


def check_placements(placements: Any, key: str) -> bool:
    """Whether ``placements`` hold a ``_StridedShard``; UnsupportedStateError for one that is
    no region of the tensor (Partial: each rank holds an addend, not a part)."""
    strided = False
    for placement in placements:
        name = type(placement).__name__
        if placement.is_partial():
            raise UnsupportedStateError(
                f"key {key!r}: DTensor placement {placement!r} holds a pending reduction (each "
                "rank an addend of the value), not a region of the tensor; ckptio does not "
                "reduce on save (that would be a collective hidden in the save): reduce it "
                "first, e.g. t.redistribute(placements=[Replicate()] * t.device_mesh.ndim), or "
                "save t.full_tensor()")
        if name == "_StridedShard":
            strided = True
        elif name not in ("Shard", "Replicate"):
            raise UnsupportedStateError(
                f"key {key!r}: DTensor placement {placement!r} is not one ckptio knows (Shard, "
                "Replicate, _StridedShard are); redistribute it first, e.g. "
                "t.redistribute(placements=[Shard(0)]) or t.full_tensor()")
    return strided


def check_box(shape: tuple[int, ...], mesh: Any, placements: Any, chunk: Chunk,
               key: str) -> None:
    """UnsupportedStateError unless the elements a ``_StridedShard`` DTensor holds on this rank
    are the box ``chunk``: on each sharded dim the global indices torch's arithmetic gives are
    consecutive. FSDP2 over tensor parallelism (``(_StridedShard(d, sf=tp), Shard(d))``) always
    holds one box (a block of this rank's TP block); ``(Shard(d), _StridedShard(d, sf))`` made
    by hand interleaves rows, which is no box."""
    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    except ImportError as exc:  # a private helper of torch 2.9+: its name may move
        raise UnsupportedStateError(
            f"key {key!r}: this torch ({torch.__version__}) lacks the index arithmetic of "
            f"_StridedShard ckptio checks ({exc}); redistribute it first, e.g. "
            "t.redistribute(placements=[Shard(0)] * t.device_mesh.ndim)") from exc
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return
    sizes, indices = list(shape), {}  # type: tuple[list[int], dict[int, Any]]
    for mesh_dim, placement in enumerate(placements):
        if type(placement).__name__ not in ("Shard", "_StridedShard"):
            continue
        d = int(placement.dim) % len(shape)
        sizes[d], indices[d] = _get_shard_size_and_offsets(
            sizes[d], mesh.size(mesh_dim), coordinate[mesh_dim], placement, indices.get(d),
            shape[d], False)
    for d, rows in indices.items():
        got = rows[:sizes[d]]
        if not torch.equal(got, torch.arange(chunk.offsets[d], chunk.offsets[d] + chunk.sizes[d],
                                             dtype=got.dtype)):
            shown = got[:8].tolist() + (["..."] if len(got) > 8 else [])
            raise UnsupportedStateError(
                f"key {key!r}: DTensor placements {tuple(placements)!r} give this rank indices "
                f"{shown} of dim {d} (of {shape[d]}), not one block; ckptio stores a shard as "
                "one box of the tensor. Redistribute it first, e.g. "
                "t.redistribute(placements=[Shard(0)] * t.device_mesh.ndim)")


def grid_of(mesh: Any, placements: Any, shape: tuple[int, ...], chunk: Chunk) -> Grid | None:
    """The DTensor's layout as a Grid, if it is regular: the tensor has elements, and this
    rank's chunk is the one the grid's arithmetic gives (what torch computed: never assumed).
    A ``_StridedShard`` is a grid over the mesh with its dims in cutting order (``_cut_order``)."""
    coordinate = mesh.get_coordinate()
    order = _cut_order(mesh, placements)
    if coordinate is None or 0 in shape or order is None:
        return None
    known = _MESHES.setdefault(mesh, {})
    shape_and_ranks = known.get(order)
    if shape_and_ranks is None:
        ranks = mesh.mesh.permute(order)
        shape_and_ranks = known[order] = (
            tuple(int(d) for d in ranks.shape), tuple(int(r) for r in ranks.flatten().tolist()))
    dims = tuple(REPLICATE if type(placements[m]).__name__ == "Replicate"
                 else int(placements[m].dim) % len(shape) for m in order)
    grid = _GRIDS.setdefault(mesh, {}).setdefault(
        (order, dims), Grid(shape_and_ranks[0], shape_and_ranks[1], dims))
    mine = grid.chunk(shape, tuple(int(coordinate[m]) for m in order))
    if mine != chunk and not mine.numel == chunk.numel == 0:  # torch versions place an empty
        return None  # piece differently; it is never written, so where does not matter
    return grid


def _cut_order(mesh: Any, placements: Any) -> tuple[int, ...] | None:
    """The mesh dims in the order they cut the tensor: their own order, but a
    ``_StridedShard(d, sf)`` cuts after the later ``Shard(d)`` dims whose sizes multiply to
    ``sf`` (FSDP2 over TP: ``(_StridedShard(0, sf=tp), Shard(0))`` on (dp, tp) cuts by tp
    first, then dp). None when a split factor matches no such dims."""
    order = list(range(len(placements)))
    for m, placement in enumerate(placements):
        if type(placement).__name__ != "_StridedShard":
            continue
        later = [j for j in range(m + 1, len(placements))
                 if type(placements[j]).__name__ == "Shard" and placements[j].dim == placement.dim]
        if not later or math.prod(mesh.size(j) for j in later) != int(placement.split_factor):
            return None
        order.remove(m)
        order.insert(order.index(later[-1]) + 1, m)
    return tuple(order)


# Per device mesh, held weakly: a mesh holds its process groups, which destroy_process_group
# must free before exit (a group alive at interpreter exit may abort it from its gloo threads).
# mesh -> cut order -> (the permuted mesh's shape, its ranks)
_MESHES: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...],
                                             tuple[tuple[int, ...], tuple[int, ...]]]] = (
    weakref.WeakKeyDictionary())
_GRIDS: weakref.WeakKeyDictionary[Any, dict[tuple[tuple[int, ...], tuple[int, ...]], Grid]] = (
    weakref.WeakKeyDictionary())  # mesh -> (cut order, dims) -> its grid
_DOMAINS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()  # mesh -> domain
# mesh -> (shape, placements) -> this rank's (sizes, offsets) (local_box)
_BOXES: weakref.WeakKeyDictionary[Any, dict[tuple[tuple[int, ...], tuple[Any, ...]],
                                            tuple[tuple[int, ...], tuple[int, ...]]]] = (
    weakref.WeakKeyDictionary())


def mesh_domain(mesh: Any) -> str:
    """A short name of a device mesh's ranks: DTensors on the same mesh holding the same region
    are replicas; on different meshes they are different tensors."""
    domain = _DOMAINS.get(mesh)
    if domain is None:
        ranks = str(mesh.mesh.tolist()).encode()
        domain = _DOMAINS[mesh] = f"mesh-{xxhash.xxh3_64_hexdigest(ranks)}"
    return domain
