"""The last save plan proved unchanged with one C-level pass per field, not Python per leaf.

Owns: ``Reuse``, recorded from a plan's signature (plan.py) once it is planned, and its
``check`` of the next save's flat state: the leaves' keys in order, and for every tensor leaf
its type, instance attributes, nesting, layout, dtype, shape, strides, storage offset, device
and which leaves share a storage (compared as a partition, so fresh storages each save do not
count as a change), each read afresh from this save's tensors by ``map`` over all of them and
compared with the recorded list; the scalar leaves (int, str, bool, None) by type and value.
Nothing is trusted that is not read again, and the check is exact: any difference (or a leaf
it does not cover: DTensors, shards, tensor subclasses, empty tensors, bytes) leaves the
decision to plan._again's per-leaf walk. ``object_again``: a scalar object leaf's entry, kept
while its value is the same. Does not own: planning, or the bytes (the sources are this save's
tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter, methodcaller
from typing import Any

import torch

from ckptio.format import values as encoding
from ckptio.format.types import ObjectEntry

__all__ = ["NOTHING", "SCALARS", "Reuse", "object_again"]

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
SCALARS = frozenset({int, str, bool, type(None)})  # equal values of one type are equal leaves
NOTHING = object()  # no value recorded

_DICT = attrgetter("__dict__")
_NESTED = attrgetter("is_nested")
_LAYOUT = attrgetter("layout")
_DTYPE = attrgetter("dtype")
_SHAPE = attrgetter("shape")
_DEVICE = attrgetter("device")
_STRIDE = methodcaller("stride")
_OFFSET = methodcaller("storage_offset")
_STORAGE = methodcaller("untyped_storage")
_DATA_PTR = methodcaller("data_ptr")

# (sources by key, the object leaves to look at one by one as (object index, key, value), the
# scalar leaves' values now)
Checked = tuple[dict[str, torch.Tensor], list[tuple[int, str, Any]], list[Any]]


@dataclass
class Reuse:
    """What the last plan depends on, field by field, as lists in leaf order (see the module)."""

    keys: list[str]
    tensors: list[int]  # positions of the tensor leaves among all leaves
    fields: list[list[Any]]  # per field (_FIELDS' order): its value for each tensor leaf
    firsts: list[int]  # per tensor leaf: the index of the first tensor leaf of its storage
    groups: int  # distinct storages
    sources: list[int]  # indices among the tensor leaves of the items (aliases left out)
    source_keys: list[str]
    scalars: list[int]  # positions of the int/str/bool/None object leaves
    scalar_index: list[int]  # their index among the plan's objects
    scalar_values: list[Any]
    scalar_types: list[type]
    others: list[tuple[int, int]]  # (position, object index) of the float object leaves

    @classmethod
    def of(cls, leaves: dict[str, Any], signature: tuple[Any, ...], alias_of: dict[str, str],
           object_keys: list[str]) -> Reuse | None:
        """The record of a planned state, or None where ``check`` could not prove it unchanged
        (a leaf it does not cover)."""
        keys, values = list(leaves), list(leaves.values())
        tensors: list[int] = []
        objects: list[int] = []
        for position, (value, part) in enumerate(zip(values, signature)):
            if part[1] is None:
                objects.append(position)
            elif (type(value) in _PLAIN and len(part[1]) == 8 and value.layout is torch.strided
                  and not value.is_nested and not value.__dict__ and value.numel()):
                tensors.append(position)
            else:
                return None
        if [keys[p] for p in objects] != object_keys:  # a leaf neither tensor nor object
            return None
        ts = [values[p] for p in tensors]
        storages = [signature[p][1][7] for p in tensors]
        first: dict[int, int] = {}
        firsts = [first.setdefault(n, i) for i, n in enumerate(storages)]
        sources = [i for i, p in enumerate(tensors) if keys[p] not in alias_of]
        scalars, scalar_index, others = [], [], []
        for index, position in enumerate(objects):
            kind = type(values[position])
            if kind in SCALARS:
                scalars.append(position)
                scalar_index.append(index)
            elif kind is float:
                others.append((position, index))
            else:
                return None
        scalar_values = [values[p] for p in scalars]
        return cls(keys, tensors, _fields(ts), firsts, len(first), sources,
                   [keys[tensors[i]] for i in sources], scalars, scalar_index, scalar_values,
                   list(map(type, scalar_values)), others)

    def check(self, leaves: dict[str, Any]) -> Checked | None:
        """This save's sources and the object leaves to look at, or None where a key, a tensor
        leaf's field or the storage sharing differs (or a scalar changed type)."""
        if len(leaves) != len(self.keys) or list(leaves) != self.keys:
            return None
        values = list(leaves.values())
        ts = list(map(values.__getitem__, self.tensors))
        if list(map(type, ts)) != self.fields[0] or any(map(_DICT, ts)) or any(map(_NESTED, ts)):
            return None
        for getter, recorded in zip(_GETTERS, self.fields[1:]):
            if list(map(getter, ts)) != recorded:
                return None
        ptrs = list(map(_DATA_PTR, map(_STORAGE, ts)))
        if list(map(ptrs.__getitem__, self.firsts)) != ptrs or len(set(ptrs)) != self.groups:
            return None
        now = list(map(values.__getitem__, self.scalars))
        if list(map(type, now)) != self.scalar_types:
            return None
        differing = _differing(now, self.scalar_values)
        redo = [(self.scalar_index[i], self.keys[self.scalars[i]], value)
                for i, value in differing]
        if not differing:  # the record's own list: nothing new kept alive
            now = self.scalar_values
        redo += [(index, self.keys[p], values[p]) for p, index in self.others]
        return dict(zip(self.source_keys, map(ts.__getitem__, self.sources))), redo, now


_GETTERS: tuple[Callable[[torch.Tensor], Any], ...] = (_LAYOUT, _DTYPE, _SHAPE, _STRIDE, _OFFSET,
                                                      _DEVICE)


def _fields(ts: list[torch.Tensor]) -> list[list[Any]]:
    """Each field ``check`` compares, for each tensor: the type, then _GETTERS' fields."""
    return [list(map(type, ts))] + [list(map(getter, ts)) for getter in _GETTERS]


def _differing(now: list[Any], last: list[Any]) -> list[tuple[int, Any]]:
    """(index, value) of each scalar that differs from the last save's (same types: checked)."""
    if now == last:
        return []
    return [(i, value) for i, (value, old) in enumerate(zip(now, last)) if value != old]


def object_again(key: str, value: Any, objects: dict[str, ObjectEntry],
                 scalars: dict[str, Any]) -> ObjectEntry | None:
    """The entry of a leaf that was an object in the last plan (``objects``, by key) and is a
    scalar now: the last one while the value is the same (``objects`` and ``scalars``, the
    last values, updated otherwise); None for any other leaf."""
    cls = type(value)
    entry = objects.get(key)
    if entry is None or (cls not in SCALARS and cls is not float):
        return None
    if cls is not float:  # equal floats may differ (-0.0): compared by their encoding
        old = scalars.get(key, NOTHING)
        if type(old) is cls and old == value:
            return entry
        scalars[key] = value
    payload = encoding.encode(value)
    if entry.value != payload:
        entry = objects[key] = ObjectEntry(key, payload)
    return entry
