"""Put a load's values back into the caller's state, the way the state holds them.

After an in-place load has filled the tensors that exist, this walks the state beside the
checkpoint's tree: Python values replaced in their parent containers (tuples rebuilt), entries a
Stateful lacks inserted, lists of another length replaced whole, and every Stateful handed its
complete state (the rules: on ``put_back``).

Call order (fill.py): the match stage (matching.py; which lists are replaced whole and which
absent keys may be created: state_keys.py) -> the reads -> ``put_back``.

Owns: the walk, tuple rebuilding, calling each Stateful's load_state_dict. Does not own:
reading bytes, matching keys or any key rule (matching.py, state_keys.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ckptio.errors import StateMismatchError
from ckptio.format.flatten import FlatState, unflatten
from ckptio.format.types import Json
from ckptio.loading.tree_nodes import children, join, leaf_keys, unwrap

_ABSENT = object()

__all__ = ["equal", "load_stateful", "put_back"]


def equal(a: Any, b: Any) -> bool:
    """True when a value needs no replacing: same type and ==."""
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)  # numpy scalars, bytes, unpickled objects
    except (TypeError, ValueError):  # == that is not a plain bool (arrays): treat as different
        return False


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
            self.node(body, unwrap(saved), inner, not isinstance(obj, torch.nn.Module), key)
            self.loads.append((prefix, obj, inner))
            return live
        if tag == "d":
            self._dict(body, children(saved, "d"), live, inside, key)
            return live
        if tag == "l" and key in self.lists:  # another length: the saved list, in this list
            live[:] = self._built(self.lists[key])
            return live
        saved_items = children(saved, tag)
        saved_items = saved_items if isinstance(saved_items, list) else []
        items = [self.node(child, saved_items[i] if i < len(saved_items) else None, live[i],
                           inside, join(key, i)) for i, child in enumerate(body)]
        if tag == "l":
            for i, item in enumerate(items):
                if item is not live[i]:
                    live[i] = item
            if inside:  # the saved items beyond, up to the first the load left out
                for i, c in enumerate(saved_items[len(items):], len(items)):
                    if join(key, i) not in self.holding and next(leaf_keys(c), None):
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
            new = self.node(child, saved_by_key.get(k), live[k], inside, join(key, k))
            if new is not live[k]:
                live[k] = new
        if inside:
            held = {k for k, _child in body}
            for k, child in saved_by_key.items():
                if k not in held and (join(key, k) in self.holding
                                      or next(leaf_keys(child), None) is None):
                    live[k] = self._built(child)

    def _built(self, saved: Json) -> Any:
        return unflatten(saved, self.created)


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
    Statefuls that lack them, fill each list of ``lists`` (state_keys.whole_lists) with the
    saved one's values (from ``created``), then call each Stateful's load_state_dict.

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
      replaced by the saved list (state_keys.whole_lists: as DCP, which stores such a list as
      one value; the list object stays the caller's). A list holding tensors is filled element by
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
