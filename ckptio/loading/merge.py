"""Put a load's values back into the caller's state, the way the state holds them.

After an in-place load has filled the tensors that exist, this walks the state beside the
checkpoint's tree: Python values replaced in their parent containers (tuples rebuilt), entries a
Stateful lacks inserted, lists of another length replaced whole, and every Stateful handed its
complete state (the rules: on ``put_back``).

Call order (matching.py, then fill.py): ``whole_lists`` (which lists are replaced whole) and ``creatable`` (which
absent keys may be created) before the reads -> the reads -> ``put_back``.

Owns: the walk, tuple rebuilding, which keys may be created (``creatable``). Does not own:
reading bytes, matching keys or the strict rules (matching.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.errors import StateMismatchError
from ckptio.format.flatten import FlatState, unflatten
from ckptio.format.types import Json
from ckptio.planning.sharding import FlatShard, TensorShard

_ABSENT = object()

__all__ = ["Lists", "creatable", "equal", "load_stateful", "put_back", "under", "whole_lists"]


def equal(a: Any, b: Any) -> bool:
    """True when a value needs no replacing: same type and ==."""
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)  # numpy scalars, bytes, unpickled objects
    except (TypeError, ValueError):  # == that is not a plain bool (arrays): treat as different
        return False


def creatable(flat: FlatState) -> Callable[[str], bool]:
    """A test for checkpoint keys absent from the state that a load creates: those inside a
    Stateful object other than a module, as far as its ``ckptio_creates`` (if any) accepts."""
    plain: list[str] = []
    narrowed: list[tuple[str, Callable[[str], bool]]] = []
    for prefix, obj, _inner in flat.statefuls:
        if isinstance(obj, torch.nn.Module):
            continue
        creates = getattr(obj, "ckptio_creates", None)
        if callable(creates):
            narrowed.append((prefix, creates))
        else:
            plain.append(prefix)
    narrowed.sort(key=lambda pair: -len(pair[0]))  # the innermost Stateful decides
    prefixes = tuple(p + "." for p in plain if p)
    everything = "" in plain

    def test(key: str) -> bool:
        for prefix, creates in narrowed:
            if not prefix:
                return bool(creates(key))
            if key.startswith(prefix + "."):
                return bool(creates(key[len(prefix) + 1:]))
        return everything or key.startswith(prefixes)

    return test


def _leaf_keys(node: Json) -> Iterator[str]:
    (tag, body), = node.items()  # the state's own tree: well formed
    if tag == "k":
        yield body
    elif tag == "c":
        yield from _leaf_keys(body[1])
    else:
        for child in ([c for _k, c in body] if tag == "d" else body if tag in ("l", "t")
                      else [body]):
            yield from _leaf_keys(child)


@dataclass
class Lists:
    """The state's lists whose saved list has another length: ``whole`` (key prefix -> the
    saved list's node) hold only Python values (or nothing) and are replaced whole; ``fixed``
    (key prefix -> (length in the state, saved length)) hold tensors or arrays, which a load
    fills in place: their keys must match."""

    whole: dict[str, Json] = field(default_factory=dict)
    fixed: dict[str, tuple[int, int]] = field(default_factory=dict)

    def keep_selected(self, select: Callable[[str], bool], keys: Iterable[str]) -> None:
        """Keep in ``whole`` only the lists a load selects: the list's own key, or one of
        ``keys`` (the saved and the state's) under it (a list the load leaves out stays as
        it is)."""
        self.whole = {k: v for k, v in self.whole.items()
                      if select(k) or any(under({k: v})(key) and select(key) for key in keys)}

    def hint(self) -> str:
        """A sentence for a key mismatch that these lists explain ("" if none)."""
        if not self.fixed:
            return ""
        shown = ", ".join(f"{k or 'the state'!r} has {a} items, the checkpoint {b}"
                          for k, (a, b) in list(self.fixed.items())[:5])
        return (f" A list holding tensors is loaded element by element, so its length must "
                f"match ({shown}): build it with the saved length.")


def whole_lists(flat: FlatState, saved_tree: Json) -> Lists:
    """The state's lists whose saved list has another length (Lists): those holding only
    Python values (no tensor or array, which a load fills in place; an empty list too) are
    replaced whole."""
    found = Lists()
    _walk_lists(flat, found, flat.tree, saved_tree, "")
    return found


def _walk_lists(flat: FlatState, found: Lists, mine: Json, saved: Json, key: str) -> None:
    """whole_lists' walk: module level, so no closure cycle keeps the state (and its process
    groups) alive past the load until a garbage collection."""
    (tag, body), = mine.items()
    saved = _unwrap(saved)
    if tag in ("s", "c"):
        _walk_lists(flat, found, body if tag == "s" else body[1], saved, key)
    elif tag == "d":
        theirs = {p[0]: p[1] for p in _children(saved, "d") or ()
                  if isinstance(p, list) and len(p) == 2}
        for k, child in body:
            if k in theirs:
                _walk_lists(flat, found, child, theirs[k], _join(key, k))
    elif tag in ("l", "t"):
        theirs = _children(saved, tag)
        if not isinstance(theirs, list):
            return
        if tag == "l" and len(theirs) != len(body):
            if any(_in_place(flat.leaves[k]) for k in _leaf_keys(mine)):
                found.fixed[key] = (len(body), len(theirs))
            else:
                found.whole[key] = {"l": theirs}
                return
        for i, (child, their) in enumerate(zip(body, theirs)):
            _walk_lists(flat, found, child, their, _join(key, i))


def _in_place(value: Any) -> bool:
    """Whether a load fills ``value`` in place (a tensor, a shard wrapper, an array)."""
    return (isinstance(value, (torch.Tensor, TensorShard, FlatShard))
            or type(value).__name__ == "ndarray")


def under(prefixes: Mapping[str, Json]) -> Callable[[str], bool]:
    """A test for keys inside one of ``prefixes`` (the root "" holds every key)."""
    if "" in prefixes:
        return lambda _key: True
    dotted = tuple(p + "." for p in prefixes)
    return lambda key: key in prefixes or key.startswith(dotted)


def _unwrap(node: Json) -> Json:
    """A checkpoint node without its Stateful ("s") and container type ("c") wrappers; None
    when absent."""
    while isinstance(node, dict) and len(node) == 1 and ("s" in node or "c" in node):
        node = node["s"] if "s" in node else node["c"][1]
    return node


def _children(node: Json, tag: str) -> Any:
    node = _unwrap(node)
    if isinstance(node, dict) and len(node) == 1 and tag in node:
        return node[tag]
    return None


def _rebuilt(live: tuple[Any, ...], items: list[Any], key: str) -> tuple[Any, ...]:
    kind = type(live)
    if kind is tuple:
        return tuple(items)
    if hasattr(kind, "_make"):  # a namedtuple
        return kind._make(items)
    try:
        return kind(items)
    except TypeError as exc:
        raise StateMismatchError(
            f"{key or 'the state'}: a {kind.__name__} (a tuple subclass) holds values that "
            f"differ from the checkpoint and cannot be rebuilt ({exc}); hold them in a plain "
            "tuple, dict or list") from None


class _Walk:
    def __init__(self, flat: FlatState, replaced: dict[str, Any], created: dict[str, Any],
                 lists: Mapping[str, Json]) -> None:
        self.replaced, self.created, self.lists = replaced, created, lists
        # every key that holds a created leaf (the leaf's own key and its dotted prefixes)
        self.holding = {k.rsplit(".", n)[0] for k in created for n in range(k.count(".") + 1)}
        self.statefuls: Iterator[tuple[str, Any, dict[Any, Any]]] = iter(flat.statefuls)
        self.loads: list[tuple[str, Any, dict[Any, Any]]] = []

    def node(self, mine: Json, saved: Json, live: Any, inside: bool, key: str = "") -> Any:
        (tag, body), = mine.items()  # the state's own tree: well formed
        if tag == "k":
            new = self.replaced.get(body, _ABSENT)
            return live if new is _ABSENT or equal(new, live) else new
        if tag == "c":  # a namedtuple or defaultdict: the live one keeps its type
            return self.node(body[1], saved, live, inside, key)
        if tag == "s":
            prefix, obj, inner = next(self.statefuls)
            self.node(body, _unwrap(saved), inner, not isinstance(obj, torch.nn.Module), key)
            self.loads.append((prefix, obj, inner))
            return live
        if tag == "d":
            self._dict(body, _children(saved, "d"), live, inside, key)
            return live
        if tag == "l" and key in self.lists:  # another length: the saved list, in this list
            live[:] = self._built(self.lists[key])
            return live
        saved_items = _children(saved, tag)
        saved_items = saved_items if isinstance(saved_items, list) else []
        items = [self.node(child, saved_items[i] if i < len(saved_items) else None, live[i],
                           inside, _join(key, i)) for i, child in enumerate(body)]
        if tag == "l":
            for i, item in enumerate(items):
                if item is not live[i]:
                    live[i] = item
            if inside:  # the saved items beyond, up to the first the load left out
                for i, c in enumerate(saved_items[len(items):], len(items)):
                    if _join(key, i) not in self.holding and next(_leaf_keys(c), None):
                        break
                    live.append(self._built(c))
            return live
        if all(a is b for a, b in zip(items, live)):
            return live
        return _rebuilt(live, items, _first_key(mine))

    def _dict(self, body: list[Any], saved: list[Any] | None, live: dict[Any, Any],
              inside: bool, key: str) -> None:
        saved_by_key = {pair[0]: pair[1] for pair in saved or ()
                        if isinstance(pair, list) and len(pair) == 2}
        for k, child in body:
            new = self.node(child, saved_by_key.get(k), live[k], inside, _join(key, k))
            if new is not live[k]:
                live[k] = new
        if inside:
            held = {k for k, _child in body}
            for k, child in saved_by_key.items():
                if k not in held and (_join(key, k) in self.holding
                                      or next(_leaf_keys(child), None) is None):
                    live[k] = self._built(child)

    def _built(self, saved: Json) -> Any:
        return unflatten(saved, self.created)


def _join(key: str, part: Any) -> str:
    return f"{key}.{part}" if key else str(part)


def _first_key(node: Json) -> str:
    """The first leaf key under a node of the state's tree (to name it in errors)."""
    (tag, body), = node.items()
    if tag == "k":
        return str(body)
    if tag == "c":
        return _first_key(body[1])
    children = [c for _k, c in body] if tag == "d" else body if tag in ("l", "t") else [body]
    return _first_key(children[0]).rsplit(".", 1)[0] if children else ""


def put_back(flat: FlatState, saved_tree: Json, replaced: dict[str, Any],
             created: dict[str, Any], lists: Mapping[str, Json] | None = None) -> None:
    """Assign ``replaced`` (key -> value) into the state, insert ``created`` entries into the
    Statefuls that lack them, fill each list of ``lists`` (whole_lists) with the saved one's
    values (from ``created``), then call each Stateful's load_state_dict.

    - Python values are replaced in their parent containers, rebuilding the tuples and
      namedtuples that hold them (RNG states, ``betas``) and assigning the new tuple into its
      own parent;
    - inside a Stateful object (anything with state_dict/load_state_dict but a
      ``torch.nn.Module``, whose keys are fixed), the entries its state_dict lacks and the
      checkpoint has are inserted (a freshly built optimizer has no per-parameter state until
      its first step); a Stateful with a ``ckptio_creates(key) -> bool`` method (key relative
      to it) narrows these to the keys it accepts (``ckptio.OptimizerState``: its own
      parameters', not other pipeline stages'), and a saved dict entry none of whose leaves
      was created is not inserted;
    - the contents of a list of Python values whose length differs from the saved one are
      replaced by the saved list (``whole_lists``: as DCP, which stores such a list as one
      value; the list object stays the caller's). A list holding tensors is filled element by
      element: its length must match (matching.py's strict rules);
    - every Stateful gets its complete state through its own ``load_state_dict``, innermost
      first.

    A root that is itself a tuple cannot be replaced: tensors inside it are still filled in
    place, and a Python value inside it that differs from the checkpoint raises
    StateMismatchError."""
    walk = _Walk(flat, replaced, created, lists or {})
    root = walk.node(flat.tree, saved_tree, flat.root, False)
    if root is not flat.root:
        differing = sorted(k for k, v in replaced.items()
                           if k in flat.leaves and not equal(v, flat.leaves[k]))
        raise StateMismatchError(
            f"the state is a tuple, which cannot be changed in place, and the checkpoint holds "
            f"other values for {differing[:10]}; pass a dict or list as the state (tensors "
            "inside a tuple are filled in place)")
    for prefix, obj, inner in reversed(walk.loads):
        load_stateful(prefix, obj, inner)


def load_stateful(prefix: str, obj: Any, inner: dict[Any, Any]) -> None:
    """``obj.load_state_dict(inner)``; its refusal a StateMismatchError naming ``prefix``."""
    try:
        obj.load_state_dict(inner)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise StateMismatchError(
            f"{prefix or 'the state'}: {type(obj).__name__}.load_state_dict refused the "
            f"checkpoint's values: {exc}. Build the object as it was when saved (same "
            "parameters, same parameter groups), or leave it out with keys=...") from exc
