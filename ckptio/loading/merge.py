"""Put a load's values back into the caller's state, the way the state holds them.

After an in-place load has filled the tensors that exist, this walks the state beside the
checkpoint's tree and:
- replaces Python values in their parent containers, rebuilding the tuples and namedtuples
  that hold them (RNG states, ``betas``) and assigning the new tuple into its own parent;
- inserts, inside a Stateful object (anything with state_dict/load_state_dict but a
  ``torch.nn.Module``, whose keys are fixed), the entries its state_dict lacks and the
  checkpoint has (a freshly built optimizer has no per-parameter state until its first step);
- hands every Stateful its complete state through its own ``load_state_dict``, innermost first.

A root that is itself a tuple cannot be replaced: tensors inside it are still filled in place,
and a Python value inside it that differs from the checkpoint raises StateMismatchError.

Owns: the walk, tuple rebuilding, which keys may be created (``creatable``). Does not own:
reading bytes, matching keys or the strict rules (fill.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ckptio.errors import StateMismatchError
from ckptio.format.flatten import FlatState, unflatten
from ckptio.format.types import Json

_ABSENT = object()

__all__ = ["creatable", "equal", "put_back"]


def equal(a: Any, b: Any) -> bool:
    """True when a value needs no replacing: same type and ==."""
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)  # numpy scalars, bytes, unpickled objects
    except (TypeError, ValueError):  # == that is not a plain bool (arrays): treat as different
        return False


def _owners(flat: FlatState) -> list[str]:
    """Key prefixes of the Stateful objects whose entries a load may create."""
    return [prefix for prefix, obj, _inner in flat.statefuls
            if not isinstance(obj, torch.nn.Module)]


def creatable(flat: FlatState) -> Callable[[str], bool]:
    """A test for checkpoint keys absent from the state that a load creates: those inside a
    Stateful object other than a module."""
    prefixes = tuple(p + "." for p in _owners(flat) if p)
    everything = "" in _owners(flat)
    return lambda key: everything or key.startswith(prefixes)


def _unwrap(node: Json) -> Json:
    """A checkpoint node with its Stateful wrappers ("s") removed; None when absent."""
    while isinstance(node, dict) and len(node) == 1 and "s" in node:
        node = node["s"]
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
        return kind._make(items)  # type: ignore[attr-defined, no-any-return]
    try:
        return kind(items)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise StateMismatchError(
            f"{key or 'the state'}: a {kind.__name__} (a tuple subclass) holds values that "
            f"differ from the checkpoint and cannot be rebuilt ({exc}); hold them in a plain "
            "tuple, dict or list") from None


class _Walk:
    def __init__(self, flat: FlatState, replaced: dict[str, Any], created: dict[str, Any]) -> None:
        self.replaced, self.created = replaced, created
        self.statefuls: Iterator[tuple[str, Any, dict[Any, Any]]] = iter(flat.statefuls)
        self.loads: list[tuple[str, Any, dict[Any, Any]]] = []

    def node(self, mine: Json, saved: Json, live: Any, inside: bool) -> Any:
        (tag, body), = mine.items()  # the state's own tree: well formed
        if tag == "k":
            new = self.replaced.get(body, _ABSENT)
            return live if new is _ABSENT or equal(new, live) else new
        if tag == "s":
            prefix, obj, inner = next(self.statefuls)
            self.node(body, _unwrap(saved), inner, not isinstance(obj, torch.nn.Module))
            self.loads.append((prefix, obj, inner))
            return live
        if tag == "d":
            self._dict(body, _children(saved, "d"), live, inside)
            return live
        saved_items = _children(saved, tag)
        saved_items = saved_items if isinstance(saved_items, list) else []
        items = [self.node(child, saved_items[i] if i < len(saved_items) else None, live[i],
                           inside) for i, child in enumerate(body)]
        if tag == "l":
            for i, item in enumerate(items):
                if item is not live[i]:
                    live[i] = item
            if inside:
                live.extend(self._built(c) for c in saved_items[len(items):])
            return live
        if all(a is b for a, b in zip(items, live)):
            return live
        return _rebuilt(live, items, _first_key(mine))

    def _dict(self, body: list[Any], saved: list[Any] | None, live: dict[Any, Any],
              inside: bool) -> None:
        saved_by_key = {pair[0]: pair[1] for pair in saved or ()
                        if isinstance(pair, list) and len(pair) == 2}
        for k, child in body:
            new = self.node(child, saved_by_key.get(k), live[k], inside)
            if new is not live[k]:
                live[k] = new
        if inside:
            held = {k for k, _child in body}
            for k, child in saved_by_key.items():
                if k not in held:
                    live[k] = self._built(child)

    def _built(self, saved: Json) -> Any:
        return unflatten(saved, self.created)


def _first_key(node: Json) -> str:
    """The first leaf key under a node of the state's tree (to name it in errors)."""
    (tag, body), = node.items()
    if tag == "k":
        return str(body)
    children = [c for _k, c in body] if tag == "d" else body if tag in ("l", "t") else [body]
    return _first_key(children[0]).rsplit(".", 1)[0] if children else ""


def put_back(flat: FlatState, saved_tree: Json, replaced: dict[str, Any],
             created: dict[str, Any]) -> None:
    """Assign ``replaced`` (key -> value) into the state, insert ``created`` entries into the
    Statefuls that lack them, then call each Stateful's load_state_dict."""
    walk = _Walk(flat, replaced, created)
    root = walk.node(flat.tree, saved_tree, flat.root, False)
    if root is not flat.root:
        differing = sorted(k for k, v in replaced.items()
                           if k in flat.leaves and not equal(v, flat.leaves[k].value))
        raise StateMismatchError(
            f"the state is a tuple, which cannot be changed in place, and the checkpoint holds "
            f"other values for {differing[:10]}; pass a dict or list as the state (tensors "
            "inside a tuple are filled in place)")
    for prefix, obj, inner in reversed(walk.loads):
        _load_stateful(prefix, obj, inner)


def _load_stateful(prefix: str, obj: Any, inner: dict[Any, Any]) -> None:
    try:
        obj.load_state_dict(inner)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise StateMismatchError(
            f"{prefix or 'the state'}: {type(obj).__name__}.load_state_dict refused the "
            f"checkpoint's values: {exc}. Build the object as it was when saved (same "
            "parameters, same parameter groups), or leave it out with keys=...") from exc
