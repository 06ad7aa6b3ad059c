"""Which part of a global tensor a state leaf holds: DTensor shards, TensorShard boxes,
FlatShard slices, a legacy ShardedTensor's local shard (FSDP1's sharded state dicts: one box per
rank, as a TensorShard), a tensor with DCP's CheckpointableTensor fields (one shard: a box), or
(a plain tensor) all of it.

Owns: the user-facing TensorShard / FlatShard wrappers, reading a leaf's global shape and region
(a DTensor's from its placements: mesh_layout.py gives the box torch's own arithmetic makes, so
uneven shards come out as torch made them, and ``_StridedShard``, FSDP2 over tensor
parallelism, as the box its rows form), and refusing what is not a region (several
ShardedTensor shards on one rank; Partial and a strided shard whose rows are not one box:
mesh_layout.py) or not a dense tensor (``check_dense``: sparse, quantized, nested). Does not
own: the mesh arithmetic (mesh_layout.py), who writes which region (globalplan.py) or reading
regions back (loading/read.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ckptio.errors import UnsupportedStateError
from ckptio.format.grid import Grid
from ckptio.format.types import Chunk
from ckptio.planning.mesh_layout import check_box, check_placements, grid_of, local_box, mesh_domain

__all__ = ["FlatShard", "Held", "TensorShard", "check_dense", "held", "is_checkpointable", "is_dtensor",
           "is_sharded_tensor", "local_tensor", "sharded_local"]


@dataclass
class TensorShard:
    """This rank's box of a global tensor: ``local`` is the block at ``offsets`` of a tensor of
    ``global_shape`` (e.g. a tensor-parallel shard made by hand). Save it and load any layout."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass
class FlatShard:
    """Elements [start, start + local.numel()) of the row-major flattened global tensor of
    ``global_shape``; ``local`` is 1-D. A ZeRO / FSDP1 flat-parameter partition, which need not
    start or end on a row boundary."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    start: int


@dataclass(frozen=True)
class Held:
    """A tensor leaf as stored: ``local`` holds ``chunk`` of a global tensor of ``shape``.
    ``sharded``: from a DTensor / TensorShard / FlatShard (replicas are ranks holding the same
    region); else a plain tensor (replicated only where every rank holds the same bytes)."""

    local: torch.Tensor
    shape: tuple[int, ...]
    chunk: Chunk
    sharded: bool
    domain: str | None = None  # a DTensor's mesh (its ranks): replicas share it
    grid: Grid | None = None  # a regular DTensor layout (grid.py): described once per tensor


def is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


def is_sharded_tensor(value: Any) -> bool:
    """A legacy ShardedTensor (torch.distributed._shard; FSDP1's sharded state dicts)."""
    return type(value).__name__ == "ShardedTensor" and isinstance(value, torch.Tensor)


_PROTOCOL = ("global_shape", "global_offsets", "local_offsets", "local_sizes")


def is_checkpointable(value: Any) -> bool:
    """A tensor with the fields of DCP's ``CheckpointableTensor`` protocol (torch 2.14+,
    ``torch.distributed.checkpoint.CheckpointableTensor``): a local tensor that declares the
    global shape and where its shards sit, checked by name as torch's runtime protocol does."""
    return isinstance(value, torch.Tensor) and all(hasattr(value, f) for f in _PROTOCOL)


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def local_tensor(value: Any) -> torch.Tensor:
    """The tensor holding a leaf's bytes: a DTensor's or wrapper's local shard, else itself."""
    if type(value) in _PLAIN and not value.__dict__:  # most leaves: no protocol fields
        return value
    if isinstance(value, (TensorShard, FlatShard)):
        return value.local
    if is_dtensor(value):
        return value.to_local()
    if is_sharded_tensor(value):
        return sharded_local(value, "?")[0]
    if is_checkpointable(value):
        return _checkpointable(value, "?").local
    return value


_SPARSE = {torch.sparse_coo: "sparse COO", torch.sparse_csr: "sparse CSR",
           torch.sparse_csc: "sparse CSC", torch.sparse_bsr: "sparse BSR",
           torch.sparse_bsc: "sparse BSC"}


def _undense(t: torch.Tensor) -> str | None:
    """What makes ``t`` no dense tensor ckptio stores, and the fix; None when it is one."""
    if t.layout in _SPARSE:
        return (f"a {_SPARSE[t.layout]} tensor (layout {t.layout}), which ckptio does not "
                "store (dense tensors only); save t.to_dense(), or its index and value tensors "
                "(t.indices() and t.values() for COO; crow_indices(), col_indices() and "
                "values() for CSR) as separate keys")
    if t.is_quantized:
        return (f"a quantized tensor (dtype {t.dtype}, {t.qscheme()}), which ckptio neither saves "
                "nor loads into; save t.dequantize(), or t.int_repr() with its scale and zero point "
                "(t.q_scale(), t.q_zero_point(), or the per-channel ones) as separate keys")
    if t.is_nested:
        return (f"a nested tensor (layout {t.layout}), which ckptio does not store; save "
                "list(t.unbind()) (a list of tensors) instead")
    if t.layout != torch.strided:
        return f"a tensor of layout {t.layout}, which ckptio does not store; save t.to_dense()"
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and not is_dtensor(t):
        return (f"a {type(t).__module__}.{type(t).__qualname__} (a tensor subclass), which ckptio "
                "does not store as such; pass a plain tensor (e.g. t.detach().clone() of its "
                "data), a DTensor, or a ckptio.TensorShard / FlatShard")
    return None


def check_dense(t: torch.Tensor, key: str) -> None:
    """UnsupportedStateError naming ``key``, the layout and the fix unless ``t`` is a dense
    (strided) plain tensor, Parameter or DTensor: what a save stores and a load fills."""
    if is_sharded_tensor(t):  # its local shard is what is stored or filled
        t = sharded_local(t, key)[0]
    why = _undense(t)
    if why is not None:
        raise UnsupportedStateError(f"key {key!r}: {why}")


def held(value: Any, key: str) -> Held | None:
    """The region ``value`` holds, or None when it is not a tensor leaf. UnsupportedStateError
    for a tensor that is not dense (``check_dense``)."""
    if isinstance(value, (TensorShard, FlatShard)):
        return _wrapped(value, key)
    if not isinstance(value, torch.Tensor):
        return None
    if is_sharded_tensor(value):
        local, chunk = sharded_local(value, key)
        check_dense(local, key)
        return Held(local, tuple(int(d) for d in value.size()), chunk, sharded=True)
    check_dense(value, key)
    if is_dtensor(value):
        return _dtensor(value, key)
    if is_checkpointable(value):
        return _checkpointable(value, key)
    shape = tuple(value.shape)
    return Held(value, shape, Chunk.whole(shape), sharded=False)


def sharded_local(value: Any, key: str) -> tuple[torch.Tensor, Chunk]:
    """A ShardedTensor's one local shard and its box (none here: an empty box), as a
    TensorShard; several local shards on one rank are refused, naming the fix."""
    shards = value.local_shards()
    if len(shards) > 1:
        raise UnsupportedStateError(
            f"key {key!r}: a ShardedTensor with {len(shards)} local shards on this rank; ckptio "
            "stores one box per rank and key: pass each as its own key, e.g. "
            "ckptio.TensorShard(shard.tensor, st.size(), shard.metadata.shard_offsets)")
    ndim = len(value.size())
    if not shards:
        return (torch.empty((0,) * ndim, dtype=value.dtype),
                Chunk((0,) * ndim, (0,) * ndim))
    meta = shards[0].metadata
    chunk = Chunk(tuple(int(o) for o in meta.shard_offsets),
                  tuple(int(n) for n in meta.shard_sizes))
    local = shards[0].tensor
    if tuple(local.shape) != chunk.sizes:
        raise UnsupportedStateError(f"key {key!r}: a ShardedTensor's local shard has shape "
                                    f"{tuple(local.shape)}, its metadata {chunk.sizes}")
    return local, chunk


def _wrapped(value: TensorShard | FlatShard, key: str) -> Held:
    shape = tuple(int(d) for d in value.global_shape)
    local = value.local
    if not isinstance(local, torch.Tensor) or is_dtensor(local):
        raise UnsupportedStateError(f"key {key!r}: {type(value).__name__}.local must be a plain "
                                    "tensor")
    check_dense(local, key)
    if isinstance(value, FlatShard):
        chunk = Chunk((int(value.start),), (local.numel(),), flat=True)
        if local.dim() != 1 or not chunk.fits(shape):
            raise UnsupportedStateError(
                f"key {key!r}: FlatShard of {local.numel()} elements at {value.start} does not fit "
                f"a tensor of shape {shape} (local must be 1-D)")
        return Held(local, shape, chunk, sharded=True)
    chunk = Chunk(tuple(int(o) for o in value.offsets), tuple(local.shape))
    if not chunk.fits(shape):
        raise UnsupportedStateError(
            f"key {key!r}: TensorShard of shape {chunk.sizes} at offsets {chunk.offsets} does not "
            f"fit a tensor of shape {shape}")
    return Held(local, shape, chunk, sharded=True)


def _checkpointable(value: torch.Tensor, key: str) -> Held:
    """A CheckpointableTensor's shard as one box: ``value[local_offsets[0] : + local_sizes[0]]``
    is the block at ``global_offsets[0]`` of a tensor of ``global_shape`` (no shard: an empty
    box). Several shards in one tensor are refused, naming the fix."""
    try:
        shape = tuple(int(d) for d in value.global_shape)  # type: ignore[attr-defined]
        shards = [(tuple(int(o) for o in g), tuple(int(o) for o in lo), tuple(int(n) for n in ls))
                  for g, lo, ls in zip(value.global_offsets, value.local_offsets,  # type: ignore[attr-defined]
                                       value.local_sizes, strict=True)]  # type: ignore[attr-defined]
    except (TypeError, ValueError) as exc:
        raise UnsupportedStateError(
            f"key {key!r}: a CheckpointableTensor whose global_shape, global_offsets, "
            f"local_offsets and local_sizes are not tuples of ints of one length ({exc})") from None
    if not shards:
        return Held(value[(slice(0, 0),) * value.dim()], shape,
                    Chunk((0,) * len(shape), (0,) * len(shape)), sharded=True)
    if len(shards) > 1:
        raise UnsupportedStateError(
            f"key {key!r}: a CheckpointableTensor holding {len(shards)} shards; ckptio stores one "
            "box per rank and key: save each shard as its own key, e.g. ckptio.TensorShard("
            "t[slices], t.global_shape, t.global_offsets[i]), or save the state with dcp.save "
            "and ckptio.DcpWriter")
    offsets, local_at, sizes = shards[0]
    chunk = Chunk(offsets, sizes)
    inside = Chunk(local_at, sizes).fits(tuple(value.shape)) if local_at else (
        sizes == tuple(value.shape))  # no local offsets: the whole local tensor (as in torch)
    if not (inside and chunk.fits(shape)):
        raise UnsupportedStateError(
            f"key {key!r}: a CheckpointableTensor's shard of sizes {sizes} at local offsets "
            f"{local_at} of its {tuple(value.shape)} tensor and at global offsets {offsets} does "
            f"not fit them or its global shape {shape}")
    local = value[tuple(slice(o, o + n) for o, n in zip(local_at, sizes))] if local_at else value
    return Held(local, shape, chunk, sharded=True)


def _dtensor(value: torch.Tensor, key: str) -> Held:
    placements = value.placements  # type: ignore[attr-defined]
    strided = check_placements(placements, key)
    shape = tuple(value.shape)
    local = value.to_local()  # type: ignore[attr-defined]
    mesh = value.device_mesh  # type: ignore[attr-defined]
    sizes, offsets = local_box(shape, mesh, tuple(placements))
    if tuple(local.shape) != tuple(sizes):
        raise UnsupportedStateError(
            f"key {key!r}: DTensor local shard has shape {tuple(local.shape)}, its placements "
            f"give {tuple(sizes)}; a padded or hand-made local tensor cannot be saved as is")
    chunk = Chunk(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))
    if strided:
        check_box(shape, mesh, placements, chunk, key)
    return Held(local, shape, chunk, sharded=True, domain=mesh_domain(mesh),
                grid=grid_of(mesh, placements, shape, chunk))
