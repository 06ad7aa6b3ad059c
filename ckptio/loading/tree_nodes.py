"""Reading the nodes of a saved tree (format/flatten.py's JSON form) beside the state's own.

Owns: unwrapping a node's Stateful ("s") and container type ("c") wrappers, a node's children,
its leaf keys and joining dotted keys. Used by the key rules on the state's lists
(state_keys.py) and by putting values back (merge.py). Does not own: the tree's format
(format/flatten.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckptio.format.types import Json

__all__ = ["children", "empty_nodes", "join", "leaf_keys", "unwrap"]


def leaf_keys(node: Json) -> Iterator[str]:
    """The leaf keys under a node of the state's own tree (well formed)."""
    (tag, body), = node.items()
    if tag == "k":
        yield body
    elif tag == "c":
        yield from leaf_keys(body[1])
    else:
        for child in ([c for _k, c in body] if tag == "d" else body if tag in ("l", "t")
                      else [body]):
            yield from leaf_keys(child)


def empty_nodes(node: Json, key: str = "") -> Iterator[str]:
    """The keys of the containers under a node of a saved tree that hold no leaf (an empty
    dict, list or tuple: saved and loaded as one, so a ``keys=`` name may select it)."""
    (tag, body), = node.items()
    if tag in ("c", "s"):
        yield from empty_nodes(body[1] if tag == "c" else body, key)
    elif tag in ("d", "l", "t"):
        kids = [(k, c) for k, c in body] if tag == "d" else list(enumerate(body))
        if not kids and key:
            yield key
        for part, child in kids:
            yield from empty_nodes(child, join(key, part))


def unwrap(node: Json) -> Json:
    """A checkpoint node without its Stateful ("s") and container type ("c") wrappers; None
    when absent."""
    while isinstance(node, dict) and len(node) == 1 and ("s" in node or "c" in node):
        node = node["s"] if "s" in node else node["c"][1]
    return node


def children(node: Json, tag: str) -> Any:
    """The body of a (saved) node of kind ``tag`` ("d", "l", "t"), or None when it is not one."""
    node = unwrap(node)
    if isinstance(node, dict) and len(node) == 1 and tag in node:
        return node[tag]
    return None


def join(key: str, part: Any) -> str:
    """``key.part`` (``part`` alone under the root)."""
    return f"{key}.{part}" if key else str(part)
