"""Flat state -> this rank's save plan: which bytes are written, which leaves go inline.

Owns: an item per leaf and writing each storage view once (tied weights become aliases), and
the plan's reuse while the state keeps its layout (PlanCache). Produces frozen dataclasses plus
the host-side tensors whose bytes the items name. Does not own: what kind each leaf is and the
bytes that hold it (leaves.py), where bytes go (layout.py) or how they are copied (stage.py).
No I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.format.flatten import FlatCache, FlatState
from ckptio.format.grid import Grid
from ckptio.format.types import DTYPE_ITEMSIZE, Chunk, Json, ObjectEntry, WriteItem
from ckptio.planning.leaves import check_tensor, classify, dtype_name
from ckptio.planning.reuse import NOTHING, SCALARS, Reuse, object_again
from ckptio.planning.sharding import (
    FlatShard,
    TensorShard,
    check_dense,
    held,
    is_dtensor,
    is_sharded_tensor,
    local_tensor,
    sharded_local,
)

__all__ = ["PlanCache", "SavePlan", "build_plan"]


@dataclass(frozen=True)
class SavePlan:
    items: tuple[WriteItem, ...]
    objects: tuple[ObjectEntry, ...]
    aliases: tuple[tuple[str, str], ...]
    # keys held as shards (DTensor, TensorShard, FlatShard): ranks holding the same region are
    # replicas. Every other item is this rank's whole value, replicated only if equal everywhere.
    sharded: frozenset[str] = frozenset()
    # key -> the mesh of a DTensor item: ranks holding its region on the same mesh are
    # replicas. Sharded items without one (TensorShard, FlatShard) are replicas only where
    # their bytes are equal.
    domains: dict[str, str] = field(default_factory=dict)
    # key -> the Grid of a regular DTensor item (grid.py): planned once per tensor
    grids: dict[str, Grid] = field(default_factory=dict)


def _view_identity(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Two tensors with equal identity are the same view of the same memory."""
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype,
            tuple(t.shape), t.stride())


@dataclass
class PlanCache:
    """The tensor part of the last plan, reused while every tensor leaf keeps its key, type,
    device, dtype, shape, strides and offset, and the same keys share memory (a training
    loop's state_dict, save after save, with a fresh RNG state or step tensor each time).

    Only metadata is reused: which keys are items or aliases, their dtype, shape and size. The
    bytes always come from the state passed to this save (``sources`` is rebuilt every time), so
    a reused plan can never write an earlier save's values. Non-tensor leaves are classified
    afresh every time (their values and sizes may change); an object leaf whose encoded value
    equals the last one's, and a tree equal to the last one, are the last save's objects: a
    save then leaves no new per-leaf objects alive for the collector to promote and walk.
    """

    signature: tuple[Any, ...] | None = None
    tensor_items: dict[str, WriteItem] = field(default_factory=dict)
    alias_of: dict[str, str] = field(default_factory=dict)
    sharded: frozenset[str] = frozenset()
    domains: dict[str, str] = field(default_factory=dict)
    grids: dict[str, Grid] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)  # key -> an int/str/bool/None leaf
    plan: SavePlan | None = None  # the last plan (``_again``)
    tree: Json = None
    hits: int = 0
    flat: FlatCache = field(default_factory=FlatCache)  # the state's structure (flatten.py)
    reuse: Reuse | None = None  # the last plan's fields, checked all at once (reuse.py)


def _is_tensor_leaf(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, TensorShard, FlatShard))


def _tensor_signature(t: torch.Tensor, storages: dict[int, int]) -> tuple[Any, ...]:
    """What planning a tensor depends on. Its storage enters only as the number of its storage
    in order of first appearance in this save, so which keys share memory is part of the
    layout, but a tensor made afresh each save (torch.get_rng_state(), a step counter) does
    not make the layout look new."""
    ptr = t.untyped_storage().data_ptr() if t.numel() else 0
    return (type(t), t.layout, t.device, t.dtype, tuple(t.shape), t.stride(), t.storage_offset(),
            storages.setdefault(ptr, len(storages)))


def _signature(flat: FlatState) -> tuple[Any, ...]:
    storages: dict[int, int] = {}  # storage address -> its position in this save
    return tuple(_part(key, value, storages) for key, value in flat.leaves.items())


def _part(key: str, t: Any, storages: dict[int, int]) -> tuple[Any, ...]:
    """One leaf's part of the signature: its key and what planning it depends on."""
    if is_dtensor(t):
        return (key, tuple(t.placements), id(t.device_mesh), tuple(t.shape),
                _tensor_signature(t.to_local(), storages))
    if isinstance(t, TensorShard):
        return (key, "box", tuple(t.global_shape), tuple(t.offsets),
                _tensor_signature(t.local, storages))
    if isinstance(t, FlatShard):
        return (key, "flat", tuple(t.global_shape), t.start, _tensor_signature(t.local, storages))
    if is_sharded_tensor(t):
        local, chunk = sharded_local(t, key)
        return (key, "sharded", tuple(t.size()), chunk, _tensor_signature(local, storages))
    if isinstance(t, torch.Tensor):
        check_dense(t, key)  # before its storage is asked for (a sparse tensor has none)
        return (key, _tensor_signature(t, storages))
    return (key, None)


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def _again(flat: FlatState, cache: PlanCache) -> tuple[SavePlan, dict[str, torch.Tensor]] | None:
    """The last plan again in one pass over the leaves, or None at the first leaf that needs
    planning (the full path then plans): every tensor leaf with the last save's signature,
    every object leaf of the last plan an int, str, bool, None or float now. A scalar equal to
    the last save's keeps its entry; the plan is the last one itself unless a value changed."""
    last, signature = cache.plan, cache.signature
    if last is None or signature is None or len(signature) != len(flat.leaves):
        return None
    storages: dict[int, int] = {}
    sources: dict[str, torch.Tensor] = {}
    objects: list[ObjectEntry] = []
    changed = False
    alias_of, strided = cache.alias_of, torch.strided
    scalars, entries = cache.scalars, cache.objects
    for (key, value), part in zip(flat.leaves.items(), signature):
        was = part[1]
        if was is None:  # no tensor last time
            old = scalars.get(key, NOTHING)  # object_again's first case, inline
            entry = (entries[key] if type(old) is type(value) and type(value) in SCALARS
                     and old == value else object_again(key, value, cache.objects, cache.scalars))
            if entry is None:
                return None
            changed = changed or entry is not last.objects[len(objects)]
            objects.append(entry)
            continue
        cls = type(value)
        if (cls in _PLAIN and value.layout is strided and not value.is_nested
                and not value.__dict__):  # dense, no CheckpointableTensor fields
            # _tensor_signature inline, compared field by field (the cheapest first): this
            # loop is the save's Python per tensor
            if (part[0] != key or len(was) != 8 or was[0] is not cls
                    or was[3] is not value.dtype or was[4] != value.shape
                    or was[5] != value.stride() or was[6] != value.storage_offset()
                    or was[2] != value.device or was[1] is not strided
                    or was[7] != storages.setdefault(
                        value.untyped_storage().data_ptr() if value.numel() else 0,
                        len(storages))):
                return None
            if key not in alias_of:
                sources[key] = value
            continue
        if part != _part(key, value, storages):
            return None
        if key not in alias_of:
            sources[key] = local_tensor(value)
    if changed:
        cache.plan = last = dataclasses.replace(last, objects=tuple(objects))
    return last, sources


def build_plan(flat: FlatState, *, allow_pickle: bool,
               cache: PlanCache | None = None) -> tuple[SavePlan, dict[str, torch.Tensor]]:
    """-> (plan, sources): sources maps each item's key to the tensor holding its bytes.

    With a ``cache``, an unchanged tensor layout skips re-planning its tensors."""
    if cache is None:
        return _build(flat, allow_pickle, None)
    if flat.tree == cache.tree:
        flat.tree = cache.tree
    cache.tree = flat.tree
    recorded = cache.reuse is not None  # None: the state has leaves Reuse does not cover
    again = _reused(flat, cache)
    if again is None:
        again = _again(flat, cache)
        if again is not None and recorded:  # the walk may have changed what the record holds
            _record(cache, flat)
    if again is not None:
        cache.hits += 1
        return again
    signature = _signature(flat)
    if signature == cache.signature:
        cache.hits += 1
        return _remember(cache, flat, *_build(flat, allow_pickle, cache))
    cache.signature, cache.tensor_items, cache.alias_of = None, {}, {}
    plan, sources = _build(flat, allow_pickle, None)
    for item in plan.items:
        if item.kind == "tensor":
            cache.tensor_items[item.key] = item
    cache.alias_of = dict(plan.aliases)
    cache.sharded, cache.domains, cache.grids = plan.sharded, plan.domains, plan.grids
    cache.signature = signature
    return _remember(cache, flat, plan, sources)


def _remember(cache: PlanCache, flat: FlatState, plan: SavePlan,
              sources: dict[str, torch.Tensor]) -> tuple[SavePlan, dict[str, torch.Tensor]]:
    """Keep ``plan`` and its scalar leaves' values for the next save's ``_again``."""
    cache.objects = {entry.key: entry for entry in plan.objects}
    cache.scalars = {entry.key: flat.leaves[entry.key] for entry in plan.objects
                     if type(flat.leaves[entry.key]) in SCALARS}
    cache.plan = plan
    _record(cache, flat)
    return plan, sources


def _record(cache: PlanCache, flat: FlatState) -> None:
    """The last plan's Reuse record, made from this state (its plan and signature)."""
    cache.reuse = None
    if cache.signature is not None and cache.plan is not None:
        cache.reuse = Reuse.of(flat.leaves, cache.signature, cache.alias_of,
                               [entry.key for entry in cache.plan.objects])


def _reused(flat: FlatState, cache: PlanCache
            ) -> tuple[SavePlan, dict[str, torch.Tensor]] | None:
    """The last plan again where Reuse.check proves every tensor leaf and key unchanged (the
    scalars that changed, and the floats, get their entries as in _again); None otherwise."""
    last, reuse = cache.plan, cache.reuse
    if last is None or reuse is None:
        return None
    checked = reuse.check(flat.leaves)
    if checked is None:
        return None
    sources, redo, scalars = checked
    objects: list[ObjectEntry] | None = None
    for index, key, value in redo:
        entry = object_again(key, value, cache.objects, cache.scalars)
        if entry is None:
            return None
        if entry is not last.objects[index]:
            objects = list(last.objects) if objects is None else objects
            objects[index] = entry
    if objects is not None:
        cache.plan = last = dataclasses.replace(last, objects=tuple(objects))
    reuse.scalar_values = scalars
    return last, sources


def _build(flat: FlatState, allow_pickle: bool,
           reuse: PlanCache | None) -> tuple[SavePlan, dict[str, torch.Tensor]]:
    items: list[WriteItem] = []
    objects: list[ObjectEntry] = []
    aliases: list[tuple[str, str]] = []
    sources: dict[str, torch.Tensor] = {}
    sharded: set[str] = set()
    domains: dict[str, str] = {}
    grids: dict[str, Grid] = {}
    first_key_of_view: dict[tuple[Any, ...], str] = {}
    for key, value in flat.leaves.items():
        if reuse is not None and _is_tensor_leaf(value):
            if key in reuse.alias_of:
                aliases.append((key, reuse.alias_of[key]))
            else:
                items.append(reuse.tensor_items[key])
                sources[key] = local_tensor(value)  # this save's tensor: never a cached one
            continue
        region = held(value, key)
        if region is not None and region.sharded:
            kind, payload = "tensor", region.local
            check_tensor(payload, key)
        else:
            kind, payload = classify(value, key, allow_pickle)
        if kind == "object":
            last = reuse.objects.get(key) if reuse is not None else None
            objects.append(last if last is not None and last.value == payload
                           else ObjectEntry(key, payload))
            continue
        identity = _view_identity(payload) if kind == "tensor" else None
        if identity is not None and identity in first_key_of_view:
            aliases.append((key, first_key_of_view[identity]))
            continue
        if identity is not None:
            first_key_of_view[identity] = key
        name = dtype_name(payload.dtype, key)
        nbytes = payload.numel() * DTYPE_ITEMSIZE[name]
        if region is not None and region.sharded:
            sharded.add(key)
            if region.domain is not None:
                domains[key] = region.domain
            if region.grid is not None:
                grids[key] = region.grid
            items.append(WriteItem(key, kind, name, region.shape, region.chunk, nbytes))
        else:
            shape = tuple(payload.shape)
            items.append(WriteItem(key, kind, name, shape, Chunk.whole(shape), nbytes))
        sources[key] = payload
    if reuse is not None:
        return SavePlan(tuple(items), tuple(objects), tuple(aliases), reuse.sharded,
                        reuse.domains, reuse.grids), sources
    return SavePlan(tuple(items), tuple(objects), tuple(aliases), frozenset(sharded),
                    domains, grids), sources

