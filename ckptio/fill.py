"""Match a manifest to what a load should produce: fresh objects, or the caller's own state.

Owns: key selection, the strict/missing/unexpected/mismatch rules, dtype and shape checks,
building fresh tensors and Python values, assigning immutable values back into the caller's
containers, the pickle opt-in on load, and the LoadReport. Does not own: reading bytes (it is
handed a ``read`` function, see restore.py).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from . import values
from .errors import ManifestError, PickleRefusedError, StateMismatchError
from .flatten import FlatState, Leaf, unflatten
from .restore import Target
from .stage import torch_dtype
from .types import Manifest, ObjectEntry, TensorEntry

KeyFilter = Union[None, str, Iterable[str], Callable[[str], bool]]
ReadFn = Callable[[list[Target]], int]


@dataclass(frozen=True)
class LoadReport:
    """What an in-place load did. ``missing``: in the state, not in the checkpoint;
    ``unexpected``: in the checkpoint, not in the state; ``mismatched``: in both but not
    loadable (dtype, shape, type), one "key: why" line each. All three stay empty under
    strict=True, which raises instead."""

    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    nbytes_read: int
    mismatched: tuple[str, ...] = ()
    seconds: float = 0.0


def _selector(keys: KeyFilter) -> Callable[[str], bool]:
    if keys is None:
        return lambda _k: True
    if callable(keys):
        return keys
    wanted = (keys,) if isinstance(keys, str) else tuple(keys)
    return lambda k: any(k == w or k.startswith(w + ".") for w in wanted)


class _Sources:
    """The checkpoint's keys, each resolved to the entry or object that holds its value."""

    def __init__(self, record: Manifest) -> None:
        self.tensors = {t.key: t for t in record.tensors}
        self.objects = {o.key: o for o in record.objects}
        self.aliases = dict(record.aliases)

    def keys(self) -> list[str]:
        return [*self.tensors, *self.objects, *self.aliases]

    def get(self, key: str) -> TensorEntry | ObjectEntry:
        if key in self.objects:
            return self.objects[key]
        return self.tensors[self.aliases.get(key, key)]


def _refuse_pickles(entries: Iterable[TensorEntry], allow_pickle: bool) -> None:
    pickled = sorted(e.key for e in entries if e.kind == "pickle")
    if pickled and not allow_pickle:
        raise PickleRefusedError(
            f"keys {pickled[:10]} were saved pickled; unpickling runs arbitrary code, so it needs "
            "load(..., allow_pickle=True) for a file you trust (or exclude them with keys=...)")


def _decode_object(entry: ObjectEntry) -> Any:
    try:
        return values.decode(entry.value)
    except ValueError as exc:
        raise ManifestError(f"key {entry.key!r}: stored value is malformed: {exc}") from None


def _value(entry: TensorEntry, tensor: torch.Tensor) -> Any:
    """The stored Python value of a data entry, from the tensor its bytes were read into."""
    if entry.kind == "tensor":
        return tensor
    if entry.kind == "numpy":
        return tensor.numpy()
    if entry.kind == "numpy_scalar":
        return tensor.numpy()[()]
    raw = tensor.numpy().tobytes()
    return pickle.loads(raw) if entry.kind == "pickle" else raw


def _empty(entry: TensorEntry) -> torch.Tensor:
    return torch.empty(entry.chunk.sizes, dtype=torch_dtype(entry.dtype))


def fill_fresh(record: Manifest, read: ReadFn, *, keys: KeyFilter, allow_pickle: bool) -> Any:
    """Build the saved state as new CPU tensors and Python values."""
    select = _selector(keys)
    sources = _Sources(record)
    wanted = [k for k in sources.keys() if select(k)]
    entries = {}
    for key in wanted:
        source = sources.get(key)
        if isinstance(source, TensorEntry):
            entries[source.key] = source
    _refuse_pickles(entries.values(), allow_pickle)
    targets = {k: Target(e, [_empty(e)]) for k, e in entries.items()}
    read(list(targets.values()))
    out: dict[str, Any] = {}
    for key in wanted:
        source = sources.get(key)
        if isinstance(source, ObjectEntry):
            out[key] = _decode_object(source)
        else:
            out[key] = _value(source, targets[source.key].dests[0])
    return unflatten(record.tree, out)


@dataclass
class _InPlace:
    targets: dict[str, Target] = field(default_factory=dict)
    casts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dest, staged)
    # (key, leaf, makes the stored value): values replaced in their container, not copied into
    assign: list[tuple[str, Leaf, Callable[[], Any]]] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)  # key -> what does not match

    def target(self, entry: TensorEntry) -> Target:
        return self.targets.setdefault(entry.key, Target(entry, []))


def _tensor_into(plan: _InPlace, key: str, dest: torch.Tensor, entry: TensorEntry, cast: bool) -> None:
    if tuple(dest.shape) != entry.chunk.sizes:
        plan.problems[key] = (f"{key}: shape {tuple(dest.shape)} in the state, "
                              f"{entry.chunk.sizes} in the checkpoint")
        return
    dtype = torch_dtype(entry.dtype)
    if dest.dtype == dtype:
        plan.target(entry).dests.append(dest)
    elif cast:
        staged = _empty(entry)
        plan.target(entry).dests.append(staged)
        plan.casts.append((dest, staged))
    else:
        plan.problems[key] = (f"{key}: dtype {dest.dtype} in the state, {dtype} in the "
                              "checkpoint (pass cast=True to convert)")


def _numpy_dest(value: Any) -> torch.Tensor | None:
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray" and value.flags.writeable:
        try:
            return torch.from_numpy(value)
        except TypeError:
            return None
    return None


def _immutable(key: str, leaf: Leaf) -> str:
    return (f"{key}: a {type(leaf.value).__name__} inside a tuple differs from the checkpoint and "
            "cannot be replaced in place; hold it in a dict or list")


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)  # numpy scalars, bytes, unpickled objects
    except (TypeError, ValueError):  # == that is not a plain bool (arrays): treat as different
        return False


def _same(value: Any, source: ObjectEntry) -> bool:
    try:
        return bool(values.encode(value) == source.value)
    except values.NotEncodable:
        return False


def _plan_in_place(sources: _Sources, flat: FlatState, common: list[str], cast: bool) -> _InPlace:
    plan = _InPlace()
    for key in common:
        leaf, source = flat.leaves[key], sources.get(key)
        if isinstance(source, TensorEntry) and source.kind == "tensor":
            if isinstance(leaf.value, torch.Tensor):
                _tensor_into(plan, key, leaf.value, source, cast)
                continue
            plan.problems[key] = (f"{key}: the checkpoint holds a tensor, the state a "
                                  f"{type(leaf.value).__name__}")
            continue
        dest = _numpy_dest(leaf.value) if isinstance(source, TensorEntry) and source.kind == "numpy" else None
        if dest is not None:
            _tensor_into(plan, key, dest, source, cast=False)  # type: ignore[arg-type]
        elif leaf.parent is None and isinstance(source, ObjectEntry):
            if not _same(leaf.value, source):
                plan.problems[key] = _immutable(key, leaf)
        else:  # replaced in its container once read; inside a tuple, compared (fill_in_place)
            if isinstance(source, TensorEntry):
                staged = _empty(source)
                plan.target(source).dests.append(staged)
                plan.assign.append((key, leaf, lambda e=source, t=staged: _value(e, t)))
            else:
                plan.assign.append((key, leaf, lambda o=source: _decode_object(o)))
    return plan


def fill_in_place(record: Manifest, flat: FlatState, read: ReadFn, *, keys: KeyFilter,
                  strict: bool, cast: bool, allow_pickle: bool) -> LoadReport:
    """Copy the checkpoint into the tensors of ``flat``; put other values into their containers."""
    select = _selector(keys)
    sources = _Sources(record)
    saved = [k for k in sources.keys() if select(k)]
    present = [k for k in flat.leaves if select(k)]
    saved_set = set(saved)
    missing = tuple(k for k in present if k not in saved_set)
    unexpected = tuple(k for k in saved if k not in flat.leaves)
    if strict and (missing or unexpected):
        raise StateMismatchError(
            f"state and checkpoint keys differ: missing from the checkpoint {list(missing[:10])}"
            f"{'...' if len(missing) > 10 else ''}, not in the state {list(unexpected[:10])}"
            f"{'...' if len(unexpected) > 10 else ''}. Pass strict=False to load the keys both "
            "have, or keys=... to choose which to load")
    common = [k for k in present if k in saved_set]
    plan = _plan_in_place(sources, flat, common, cast)
    if plan.problems and strict:
        raise _mismatch(plan.problems)
    _refuse_pickles((t.entry for t in plan.targets.values()), allow_pickle)
    with torch.no_grad():
        nbytes = read(list(plan.targets.values()))
        for dest, staged in plan.casts:
            dest.copy_(staged)
    for key, leaf, make_value in plan.assign:
        value = make_value()
        if leaf.parent is not None:
            leaf.parent[leaf.slot] = value
        elif not _equal(leaf.value, value):
            plan.problems[key] = _immutable(key, leaf)
            if strict:
                raise _mismatch({key: plan.problems[key]})
    for _prefix, obj, inner in reversed(flat.statefuls):
        obj.load_state_dict(inner)
    loaded = tuple(k for k in common if k not in plan.problems)
    return LoadReport(loaded, missing, unexpected, nbytes, tuple(plan.problems.values()))


def _mismatch(problems: dict[str, str]) -> StateMismatchError:
    return StateMismatchError(
        f"{len(problems)} key(s) do not match the checkpoint: "
        + "; ".join(list(problems.values())[:10])
        + ". Fix the state, or pass strict=False to load the rest and skip these")
