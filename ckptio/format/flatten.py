"""Nested state <-> flat {key: leaf}, and the tree that rebuilds the nesting.

Owns: traversal of dicts, lists, tuples and Stateful objects (anything with state_dict and
load_state_dict); dotted keys ("model.layers.0.weight"); the JSON tree recorded in the manifest
(dict keys keep their type: "0" and 0 stay different), with namedtuples and defaultdicts
wrapped in the node that says what they were (containers.py). Does not own: what a leaf is
stored as (plan.py) or how a leaf is filled on load (loading/).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from ckptio.errors import ManifestError, UnsupportedStateError
from ckptio.format import containers, param_names
from ckptio.format.types import MAX_TREE_DEPTH, Json

__all__ = ["FlatCache", "FlatState", "flatten", "is_stateful", "unflatten"]


@dataclass
class FlatCache:
    """Kept between saves: for each dict or list of plain leaves (a module's state_dict, an
    optimizer's parameter indices), its keys, its leaves' dotted keys and its tree node. A save
    finding the same keys records the container's current values with no Python per leaf and
    its tree is the last save's node (no new objects per leaf). Only the structure is kept:
    the values are read from the state every time, and any other key, key type or value type
    walks the container afresh."""

    nodes: dict[str, tuple[Any, tuple[str, ...], Json]] = field(default_factory=dict)


@dataclass
class FlatState:
    # dotted key -> the leaf's value: no object per leaf, so a save of thousands of leaves
    # leaves nothing per leaf for the collector to promote while it runs
    leaves: dict[str, Any] = field(default_factory=dict)
    tree: Json = None
    # (key prefix, object, the dict its state_dict() returned), outermost first
    statefuls: list[tuple[str, Any, dict[Any, Any]]] = field(default_factory=list)
    root: Any = None  # the state that was flattened
    want_names: bool = False  # a save: index-keyed optimizers get their parameters' names
    names: dict[int, str] | None = None  # id(parameter) -> name (param_names.py), when needed
    cache: FlatCache | None = None  # a save's: the containers' structure from the last save
    # a load's: key -> the region its leaf holds (planning/sharding.Held, or None), worked out
    # once for the load's planning steps (loading/resolve_regular.held_leaf)
    regions: dict[str, Any] = field(default_factory=dict)


def is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, (torch.Tensor, dict, list, tuple))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


# Types that are always a leaf (no state_dict, no container): a state's thousands of tensors
# and optimizer indices and names skip the checks _walk makes of a value.
_PLAIN_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter, int, str, bool, float,
                           type(None)})


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list)) or (
        isinstance(value, tuple) and not isinstance(value, torch.Size)
    )


def flatten(state: Any, *, names: bool = False, cache: FlatCache | None = None) -> FlatState:
    """Walk ``state``; every non-container value becomes a leaf under its dotted key.
    ``names`` (a save): each index-keyed optimizer's param groups get its parameters' names
    (param_names.py). ``cache``: the containers' structure from the last flatten (FlatCache)."""
    if not (_is_container(state) or is_stateful(state)):
        raise UnsupportedStateError(
            f"state must be a dict, list, tuple or an object with state_dict(); got "
            f"{type(state).__name__}. Wrap it: ckptio.save({{'value': obj}}, path)"
        )
    flat = FlatState(root=state, want_names=names, cache=cache)
    flat.tree = _walk(state, "", flat)
    return flat


def _join(prefix: str, part: Any) -> str:
    return f"{prefix}.{part}" if prefix else str(part)


def _walk(value: Any, key: str, flat: FlatState, depth: int = 0) -> Json:
    if depth > MAX_TREE_DEPTH:
        raise UnsupportedStateError(_too_deep(flat.root, key))
    depth += 1
    if isinstance(value, torch.Tensor):  # most leaves: skip the container checks
        return _leaf(value, key, flat)
    if is_stateful(value):
        inner = value.state_dict()
        if flat.want_names and isinstance(value, torch.optim.Optimizer):
            if flat.names is None:  # the modules' names, once, where an optimizer needs them
                flat.names = param_names.module_names(flat.root)
            param_names.name_groups(inner, value, flat.names)
        flat.statefuls.append((key, value, inner))
        return {"s": _walk(inner, key, flat, depth)}
    if flat.cache is not None:
        node = _cached(value, key, flat, flat.cache, depth)
        if node is not None:
            return node
    if isinstance(value, dict):
        return _typed(value, key, {"d": _dict_items(value, key, flat, depth)})
    if isinstance(value, list):
        leaves = flat.leaves
        nodes: list[Json] = []
        for i, v in enumerate(value):
            child = f"{key}.{i}" if key else str(i)
            if type(v) in _PLAIN_LEAVES and child not in leaves:  # _leaf, inline
                leaves[child] = v
                nodes.append({"k": child})
            else:
                nodes.append(_walk(v, child, flat, depth))
        return {"l": nodes}
    if _is_container(value):  # tuple, not torch.Size
        return _typed(value, key, {"t": [_walk(v, _join(key, i), flat, depth)
                                         for i, v in enumerate(value)]})
    return _leaf(value, key, flat)


_KEY_TYPES = frozenset({str, int})
_DICTS = frozenset({dict})
_MAX_CACHED = 1 << 16  # containers a FlatCache keeps (beyond, it starts again)


def _cached(value: Any, key: str, flat: FlatState, cache: FlatCache, depth: int) -> Json | None:
    """The node of a dict (or OrderedDict) with str/int keys, or a list, of plain leaves only,
    or a dict of such plain dicts (an optimizer's state), its leaves recorded (FlatCache); None
    for any other value, and where a leaf's key is taken already (``_walk`` then refuses it by
    name)."""
    found = _shape(value, depth)
    if found is None:
        return None
    shape, values = found
    hit = cache.nodes.get(key)
    if hit is None or type(hit[0]) is not type(shape) or hit[0] != shape:
        hit = _structure(shape, key)
        if hit is None:
            return None
        if len(cache.nodes) >= _MAX_CACHED:
            cache.nodes.clear()
        cache.nodes[key] = hit
    children, leaves = hit[1], flat.leaves
    if not leaves.keys().isdisjoint(children):
        return None
    count = len(leaves)
    leaves.update(zip(children, values))
    if len(leaves) != count + len(children):  # fewer values than keys: changed meanwhile
        raise UnsupportedStateError(f"key {key!r}: the state changed while it was saved")
    return hit[2]


def _shape(value: Any, depth: int) -> tuple[Any, Iterable[Any]] | None:
    """(what the node depends on, the leaves in order) of a container ``_cached`` takes: a
    list's length, a dict's keys, or a dict of dicts' keys and each inner dict's keys."""
    kind = type(value)
    if kind is list:
        shape: Any = len(value)
        values: Iterable[Any] = value
    elif kind is dict or kind is OrderedDict:
        shape = tuple(value)
        if not _KEY_TYPES.issuperset(map(type, shape)):
            return None
        values = value.values()
        if shape and depth < MAX_TREE_DEPTH and _DICTS.issuperset(map(type, values)):
            inner = tuple(map(tuple, values))
            if not _KEY_TYPES.issuperset(map(type, chain.from_iterable(inner))):
                return None
            shape, values = (shape, inner), list(chain.from_iterable(map(dict.values, values)))
    else:
        return None
    if not _PLAIN_LEAVES.issuperset(map(type, values)):
        return None
    return shape, values


def _structure(shape: Any, key: str) -> tuple[Any, tuple[str, ...], Json] | None:
    """(shape, the leaves' dotted keys, the node) as ``_walk`` makes them; None where two keys
    join to one dotted key (1 and "1")."""
    if isinstance(shape, int):
        children = _children(key, range(shape))
        node: Json = {"l": [{"k": c} for c in children]}
    elif shape and isinstance(shape[0], tuple):  # a dict of dicts
        parts = [(k, _children(_join(key, k), inner)) for k, inner in zip(*shape)]
        children = tuple(chain.from_iterable(c for _k, c in parts))
        node = {"d": [[k, {"d": [[k2, {"k": c}] for k2, c in zip(inner, cs)]}]
                      for (k, cs), inner in zip(parts, shape[1])]}
    else:
        children = _children(key, shape)
        node = {"d": [[k, {"k": c}] for k, c in zip(shape, children)]}
    if len(set(children)) != len(children):
        return None
    return shape, children, node


def _too_deep(root: Any, key: str) -> str:
    """Why the walk went past MAX_TREE_DEPTH at ``key``: a container that holds itself (found
    by a second walk, on this error's path only), or a state nested too deep."""
    cycle = _cycle(root)
    if cycle is not None:
        return (f"key {cycle!r} holds a container it is in (the state refers to itself): save a "
                "state without the cycle")
    return (f"key {key[:200]!r}{' ...' if len(key) > 200 else ''}: the state nests deeper than "
            f"{MAX_TREE_DEPTH} levels")


def _cycle(root: Any) -> str | None:
    """The first key whose value is a dict, list or tuple it is inside of (by identity); a
    walk with a stack of its own, as the caller is deep in the interpreter's already."""
    stack: list[tuple[Any, str, int]] = [(root, "", 0)]
    path: list[int] = []  # the ids of the containers around the value taken, outermost first
    while stack:
        value, key, depth = stack.pop()
        del path[depth:]
        if id(value) in path:
            return key
        if isinstance(value, (dict, list, tuple)) and depth <= MAX_TREE_DEPTH:
            path.append(id(value))
            parts = list(value.items() if isinstance(value, dict) else enumerate(value))
            stack.extend((v, _join(key, k), depth + 1) for k, v in reversed(parts))
    return None


def _children(key: str, parts: Iterable[Any]) -> tuple[str, ...]:
    return tuple(f"{key}.{k}" if key else str(k) for k in parts)


def _dict_items(value: dict[Any, Any], key: str, flat: FlatState, depth: int) -> list[Json]:
    """A dict's ``[key, node]`` pairs. Per leaf, this is the save's Python: a plain leaf is
    recorded here (``_leaf`` inline) and only other values go through ``_walk``."""
    leaves = flat.leaves
    items: list[Json] = []
    for k, v in value.items():
        kind = type(k)
        if kind is not str and kind is not int and (
                not isinstance(k, (str, int)) or isinstance(k, bool)):
            raise UnsupportedStateError(
                f"key {_join(key, repr(k))}: dict keys must be str or int, got "
                f"{type(k).__name__}; convert the key before saving"
            )
        child = f"{key}.{k}" if key else str(k)
        if type(v) in _PLAIN_LEAVES and child not in leaves:
            leaves[child] = v
            items.append([k, {"k": child}])
        else:  # a container, another leaf, or a key seen already (_leaf refuses it)
            items.append([k, _walk(v, child, flat, depth)])
    return items


def _typed(value: Any, key: str, node: Json) -> Json:
    """``node`` wrapped in the type of a namedtuple or defaultdict ``value`` (containers.py)."""
    info = containers.info_of(value, key)
    return node if info is None else {"c": [info, node]}


def _leaf(value: Any, key: str, flat: FlatState) -> Json:
    if key in flat.leaves:
        raise UnsupportedStateError(
            f"key {key!r} names two different leaves (a dict key containing '.' collides with "
            "a nested key, or an int key with the same str key: 1 and '1'); rename one of them"
        )
    flat.leaves[key] = value
    return {"k": key}


def unflatten(tree: Json, values: dict[str, Any], *, prune: bool = False,
              selected: Callable[[str], bool] | None = None) -> Any:
    """Rebuild the nested state from a manifest tree; keys absent from ``values`` are dropped.
    ``prune`` (a load of some keys): a container left with none of its leaves is dropped too
    (the top stays, empty), unless it was saved empty and ``selected`` accepts its dotted key
    (an empty dict under a key asked for is part of that key's value)."""
    built = _build(tree, values, prune, selected, "")
    if built is _MISSING:  # pruned to nothing: an empty top of the saved kind
        tag = next(iter(tree)) if isinstance(tree, dict) and len(tree) == 1 else "d"
        return [] if tag == "l" else () if tag == "t" else {}
    return built


_MISSING = object()
Selected = Callable[[str], bool] | None


def _build(node: Json, values: dict[str, Any], prune: bool, selected: Selected,
           key: str) -> Any:
    if not isinstance(node, dict) or len(node) != 1:
        raise ManifestError(f"manifest tree node is malformed: {node!r:.120}")
    (tag, body), = node.items()
    if tag == "k":
        return values.get(body, _MISSING)
    if tag == "s":
        return _build(body, values, prune, selected, key)
    if tag == "c":
        inner = _build(body[1], values, prune, selected, key)
        return _MISSING if inner is _MISSING else containers.rebuild(body[0], inner)
    if tag == "d":
        out = {}
        for k, child in body:
            v = _build(child, values, prune, selected, _join(key, k))
            if v is not _MISSING:
                out[k] = v
        return _MISSING if prune and not out and not _kept_empty(node, selected, key) else out
    if tag in ("l", "t"):
        built = [_build(child, values, prune, selected, _join(key, i))
                 for i, child in enumerate(body)]
        kept = [v for v in built if v is not _MISSING]
        if prune and not kept and not _kept_empty(node, selected, key):
            return _MISSING
        return kept if tag == "l" else tuple(kept)
    raise ManifestError(f"manifest tree has an unknown node tag {tag!r}")


def _kept_empty(node: Json, selected: Selected, key: str) -> bool:
    """A pruned load keeps a container saved with no leaf at all when its key is selected."""
    return selected is not None and bool(key) and selected(key) and _hollow(node)


def _hollow(node: Json) -> bool:
    """No leaf anywhere under ``node`` (an empty dict, list or tuple, or ones of those)."""
    (tag, body), = node.items()
    if tag == "k":
        return False
    if tag == "s":
        return _hollow(body)
    if tag == "c":
        return _hollow(body[1])
    children = [child for _k, child in body] if tag == "d" else body
    return all(_hollow(child) for child in children)
