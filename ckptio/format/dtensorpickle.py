"""A DTensor as ``torch.save`` pickles it, decoded without torch, and where its shard lies.

A file that ``torch.save`` wrote from one rank of a DTensor state (torch_checkpointing's
``<item>_<rank>.pt``, or a user's own per-rank file) pickles each DTensor as
``torch._tensor._rebuild_from_type_v2(torch._utils._rebuild_wrapper_subclass, DTensor, (global
dtype, size, ...), {"_local_tensor": <tensor>, "_spec": DTensorSpec})``, the spec holding the
``DeviceMesh`` (its layout: one flat layout per mesh dimension; this rank's coordinate on
each), the placements and the tensor's global shape. ``GLOBALS`` maps exactly those globals
(torch 2.13's, found by disassembling real files) to torch-free stand-ins; the unpickler
of format/torchsave.py merges them into its allow-list, so nothing named is imported or run.

``DTensorRef`` is the decoded DTensor; ``box(ref)`` its local shard's place in the global
tensor (offsets, sizes), by DTensor's own rule for ``Shard(d)`` (each mesh dimension in order
splits what the previous ones left into ceil-sized pieces); ``primary(ref)`` whether this
rank's copy is the one to keep (coordinate 0 on every replicated mesh dimension). Refused,
naming the placement: ``Partial`` (a pending reduction), ``_StridedShard`` (FSDP2 over tensor
parallelism: a shard that is not one box) and a non-default shard order.

Owns: those stand-ins and that geometry. Pure. Does not own: the zip, tensors' storages
(torchzip.py), turning the decoded object into a Manifest (loading/torchsave_manifest.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptio.errors import UnsupportedStateError
from ckptio.format.allowlist import DType
from ckptio.format.torchzip import TensorRef

__all__ = ["DTensorRef", "GLOBALS", "box", "primary"]


class _Rec:
    """A record pickle builds with NEWOBJ (its arguments kept) and BUILD (its state kept)."""

    __slots__ = ("args", "state")
    name = ""
    args: tuple[Any, ...]
    state: dict[str, Any]

    def __new__(cls, *args: Any) -> _Rec:
        made = object.__new__(cls)
        made.args, made.state = args, {}
        return made

    def __setstate__(self, state: Any) -> None:
        state = _merged(state)
        if type(state) is not dict:
            raise TypeError(f"{self.name}'s state is not a dict")
        self.state = state

    def get(self, field: str) -> Any:
        if field not in self.state:
            raise TypeError(f"{self.name} has no {field!r}")
        return self.state[field]


def _merged(state: Any) -> Any:
    """A pickled object's state: its dict, or (dict or None, slots) merged into one dict."""
    if type(state) is tuple and len(state) == 2 and all(
            type(part) in (dict, type(None)) for part in state):
        merged = dict(state[0] or {})
        merged.update(state[1] or {})
        return merged
    return state


def _rec(name: str) -> type[_Rec]:
    return type(name, (_Rec,), {"__slots__": (), "name": name})


_DT = "torch.distributed.tensor"
_SPEC, _MESH, _LAYOUT, _FLAT, _META, _ORDER, _SHARD, _REPLICATE, _PARTIAL, _STRIDED = (
    _rec(n) for n in ("DTensorSpec", "DeviceMesh", "_MeshLayout", "_FlatLayout", "TensorMeta",
                      "ShardOrderEntry", "Shard", "Replicate", "Partial", "_StridedShard"))


class _DTensorClass:
    """The DTensor class named in the pickle (nothing but a marker)."""


@dataclass(frozen=True)
class _Wrapper:
    dtype: str
    size: tuple[int, ...]


@dataclass(frozen=True)
class DTensorRef:
    """One rank's DTensor: its local tensor, the global dtype and shape, the mesh's sizes,
    this rank's coordinate on each, and the placements (names, Shard's tensor dim)."""

    local: TensorRef
    dtype: str
    shape: tuple[int, ...]
    mesh: tuple[int, ...]
    coordinate: tuple[int, ...]
    placements: tuple[tuple[str, int], ...]  # ("Shard", dim) or ("Replicate", -1)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list) or not all(type(i) is int and i >= 0 for i in value):
        raise TypeError(f"{what} is not a tuple of ints")
    return tuple(value)


def _wrapper(cls: Any, dtype: Any, size: Any, *rest: Any) -> _Wrapper:
    if cls is not _DTensorClass or type(dtype) is not DType:
        raise TypeError("_rebuild_wrapper_subclass rebuilds a DTensor of a dtype only")
    return _Wrapper(dtype.name, _ints(size, "a DTensor's size"))


def _mesh_sizes(mesh: Any) -> tuple[int, ...]:
    layout = mesh.get("_layout") if type(mesh) is _MESH else None
    if type(layout) is not _LAYOUT:
        raise TypeError("a DTensor's mesh has no torch 2.13 layout")
    sizes = []
    for axis in layout.get("axes"):
        if type(axis) is not _FLAT:
            raise TypeError("a mesh axis is not a flat layout")
        size = 1
        for n in _ints(axis.get("shape"), "a mesh axis's shape"):
            size *= n
        sizes.append(size)
    return tuple(sizes)


def _placement(p: Any) -> tuple[str, int]:
    if type(p) is _SHARD and type(p.get("dim")) is int:
        return ("Shard", p.get("dim"))
    if type(p) is _REPLICATE:
        return ("Replicate", -1)
    if type(p) in (_PARTIAL, _STRIDED):
        return (p.name, -1)
    raise TypeError("a DTensor placement is not Shard, Replicate, Partial or _StridedShard")


def _from_type(func: Any, new_type: Any, args: Any, state: Any) -> DTensorRef:
    if func is not _wrapper or new_type is not _DTensorClass or type(args) is not tuple:
        raise TypeError("_rebuild_from_type_v2 rebuilds a DTensor only")
    wrapper = _wrapper(*args)
    state = _merged(state)
    if type(state) is not dict or type(state.get("_local_tensor")) is not TensorRef:
        raise TypeError("a DTensor's state has no local tensor")
    spec = state.get("_spec")
    if type(spec) is not _SPEC:
        raise TypeError("a DTensor's state has no DTensorSpec")
    mesh = spec.get("mesh")
    coordinate = mesh.get("_coordinate_on_dim") if type(mesh) is _MESH else None
    placements = tuple(_placement(p) for p in spec.get("placements"))
    sizes = _mesh_sizes(mesh)
    order = spec.state.get("shard_order") or ()
    for entry in order:
        if type(entry) is not _ORDER or len(entry.args) != 2 or \
                list(entry.args[1]) != sorted(entry.args[1]):
            raise UnsupportedStateError("a DTensor was saved with a non-default shard order, "
                                        "which ckptio does not read")
    if coordinate is None or len(_ints(coordinate, "a mesh coordinate")) != len(sizes) or \
            len(placements) != len(sizes):
        raise TypeError("a DTensor's mesh coordinate or placements do not match its mesh")
    return DTensorRef(state["_local_tensor"], wrapper.dtype, wrapper.size, sizes,
                      tuple(coordinate), placements)


class TorchLayout:
    """torch.strided as a DTensor's rebuild passes it (and ignored there): no plain value, so
    a layout stored as a value elsewhere is refused rather than read as the str 'strided'."""


def _layout_name(*args: Any) -> TorchLayout:
    if args != ("torch.strided",):
        raise TypeError("a DTensor's layout is not torch.strided")
    return TorchLayout()


GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type,
    ("torch._utils", "_rebuild_wrapper_subclass"): _wrapper,
    (_DT, "DTensor"): _DTensorClass,
    (f"{_DT}._api", "DTensor"): _DTensorClass,
    ("torch.serialization", "_get_layout"): _layout_name,
    (f"{_DT}._dtensor_spec", "DTensorSpec"): _SPEC,
    (f"{_DT}._dtensor_spec", "TensorMeta"): _META,
    (f"{_DT}._dtensor_spec", "ShardOrderEntry"): _ORDER,
    ("torch.distributed.device_mesh", "DeviceMesh"): _MESH,
    ("torch.distributed._mesh_layout", "_MeshLayout"): _LAYOUT,
    ("torch.distributed._mesh_layout", "_FlatLayout"): _FLAT,
    **{(f"{_DT}.placement_types", r.name): r for r in (_SHARD, _REPLICATE, _PARTIAL, _STRIDED)},
}


def box(ref: DTensorRef, key: str, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, sizes) of this rank's shard of ``ref`` in the global tensor."""
    offsets, sizes = [0] * len(ref.shape), list(ref.shape)
    for (name, dim), n, c in zip(ref.placements, ref.mesh, ref.coordinate):
        if name == "Replicate":
            continue
        if name != "Shard" or not 0 <= dim < len(sizes):
            raise UnsupportedStateError(
                f"{where}: key {key!r} is a DTensor placed {name}({dim if dim >= 0 else ''}), "
                "which ckptio does not read from torch.save files (a Partial sum pending, or "
                "FSDP2 over tensor parallelism's _StridedShard); load it with the library that "
                "saved it, or save full_tensor() / a DCP checkpoint")
        full = -(-sizes[dim] // n) if n else 0
        start = min(full * c, sizes[dim])
        offsets[dim] += start
        sizes[dim] = max(0, min(sizes[dim], start + full) - start)
    return tuple(offsets), tuple(sizes)


def primary(ref: DTensorRef) -> bool:
    """Whether this rank's copy is the one kept: coordinate 0 where the tensor is replicated."""
    return all(c == 0 for (name, _), c in zip(ref.placements, ref.coordinate)
               if name == "Replicate")
