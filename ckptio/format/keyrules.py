"""The key rules of a manifest: keys unique across tensors, objects and aliases; a key's
entries either global or each rank's own, no chunk stored twice; aliases pointing at tensors;
the tree naming exactly the entries' keys, each node well formed and nested no deeper than the
format allows.

Call order: validate.from_body runs check_entries on a manifest being read; a save runs
check_keys on a Manifest about to be written (a save must not commit what its own reader would
refuse), or KeysPassed.check, which skips a layout its owner saw pass last. Pure: no file
access, no module-level state (the memory is the KeysPassed its owner holds).

Owns: these rules and the tree's walk. Does not own: every other field's check (validate.py),
the byte framing (manifest.py).
"""

from __future__ import annotations

import marshal
import operator
from collections import Counter
from typing import Any

from ckptio.format import containers
from ckptio.format.check import Check
from ckptio.format.types import MAX_TREE_DEPTH, Chunk, Manifest, ObjectEntry, TensorEntry, show

__all__ = ["KeysPassed", "check_entries", "check_keys", "tree_keys"]


def check_keys(manifest: Manifest, where: str) -> None:
    """The key rules a reader enforces (keys unique across tensors, objects and aliases; global
    or per-rank entries, no chunk twice; aliases to tensors; tree = keys), on a Manifest about
    to be written: a save must not commit what its own reader would refuse."""
    check_entries(Check(where), manifest.tensors, manifest.objects, manifest.aliases, manifest.tree,
                tuple(r.key for r in manifest.regular))


_KEY_FIELDS = operator.attrgetter("key", "rank", "chunk", "kind", "dtype", "shape")
_OBJECT_KEY_FIELDS = operator.attrgetter("key", "rank")


class KeysPassed:
    """check_keys with a memory of one: the key inputs of the last manifest that passed, owned
    by whoever saves a run of manifests (a save group's plan memory, collective.Memory). Keys
    laid out as in that one (a save whose plan was reused) are not walked again."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[Any, ...] | None = None  # _key_inputs of the last manifest passed

    def check(self, manifest: Manifest, where: str) -> None:
        """check_keys(manifest, where), unless its key inputs equal the last ones passed."""
        inputs = _key_inputs(manifest)
        if inputs is not None and inputs == self._last:
            return
        check_keys(manifest, where)
        self._last = inputs


def _key_inputs(m: Manifest) -> tuple[Any, ...] | None:
    """All that check_entries reads of ``m``, the tree as marshal's bytes (a copy no caller can
    change later; format 0 shares no objects, so equal trees give equal bytes whatever their
    reference counts); None for a tree marshal refuses (then it is checked every time)."""
    try:
        tree = marshal.dumps(m.tree, 0)
    except ValueError:
        return None
    return (tuple(map(_KEY_FIELDS, m.tensors)), tuple(map(_OBJECT_KEY_FIELDS, m.objects)),
            m.aliases, tree, tuple(r.key for r in m.regular))


def check_entries(c: Check, tensors: tuple[TensorEntry, ...], objects: tuple[ObjectEntry, ...],
                  aliases: tuple[tuple[str, str], ...], tree: Any,
                  regular_keys: tuple[str, ...] = ()) -> None:
    """The key rules on a manifest's parts (check_keys' doc); ManifestError through ``c``."""
    tensor_keys = [*_check_groups(c, tensors, "tensor"), *regular_keys]
    object_keys = _check_groups(c, objects, "object")
    alias_keys = [a for a, _ in aliases]
    all_keys = [*tensor_keys, *object_keys, *alias_keys]
    if len(set(all_keys)) != len(all_keys):
        raise c.fail("a key appears twice (as a tensor, object or alias)")
    if not {target for _, target in aliases} <= set(tensor_keys):
        raise c.fail("an alias points at a key that holds no tensor")
    if Counter(tree_keys(tree, c)) != Counter(all_keys):
        raise c.fail("the tree and the entries name different keys")


def _check_groups(c: Check, entries: tuple[Any, ...], what: str) -> dict[str, Any]:
    """A key's entries are either global (rank None: one object, or chunks of one tensor with
    one kind, dtype and shape) or each rank's own (at most one per rank). -> key: first entry."""
    first: dict[str, Any] = {}
    ranks: set[tuple[str, int]] = set()
    chunks: set[tuple[str, Chunk]] = set()
    for e in entries:
        head = first.setdefault(e.key, e)
        if what == "tensor" and e.rank is None:
            if (e.key, e.chunk) in chunks:
                raise c.fail(f"tensor {show(e.key)} stores the same chunk twice")
            chunks.add((e.key, e.chunk))
        if (head.rank is None) != (e.rank is None):
            raise c.fail(f"{what} {show(e.key)} has both global and per-rank entries")
        if e.rank is not None:
            if (e.key, e.rank) in ranks:
                raise c.fail(f"{what} {show(e.key)} has two entries of rank {e.rank}")
            ranks.add((e.key, e.rank))
        elif e is not head and (what == "object" or (e.kind, e.dtype, e.shape) !=
                                (head.kind, head.dtype, head.shape)):
            raise c.fail(f"{what} {show(e.key)} has global entries that disagree (a global object "
                         "is stored once; a tensor's chunks share kind, dtype and shape)")
    return first


def tree_keys(tree: Any, c: Check) -> list[str]:
    """Every leaf key of a tree, checking each node's shape and that no dict node holds a key
    twice (iteratively: hostile depth is an error, not a RecursionError)."""
    out: list[str] = []
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise c.fail(f"the tree nests deeper than {MAX_TREE_DEPTH} levels")
        if not isinstance(node, dict) or len(node) != 1:
            raise c.fail(f"tree node {show(node)} is not a one-field object")
        (tag, body), = node.items()
        if tag == "k" and isinstance(body, str):
            out.append(body)
        elif tag == "s":
            stack.append((body, depth + 1))
        elif tag == "c" and isinstance(body, list) and len(body) == 2:
            why = containers.problem(body[0], body[1])
            if why is not None:
                raise c.fail(f"tree node {show(node)}: {why}")
            stack.append((body[1], depth))  # a container's type: not a level of nesting
        elif tag in ("l", "t") and isinstance(body, list):
            stack.extend((child, depth + 1) for child in reversed(body))
        elif tag == "d" and isinstance(body, list):
            stack.extend((child, depth + 1) for child in reversed(_dict_children(c, body)))
        else:
            raise c.fail(f"tree node with tag {show(tag)} and body {show(body)} has an unknown "
                         "tag or a malformed body")
    return out


def _dict_children(c: Check, items: list[Any]) -> list[Any]:
    seen: set[str | int] = set()
    for pair in items:
        if not (isinstance(pair, list) and len(pair) == 2 and _dict_key(pair[0])):
            raise c.fail(f"tree dict item {show(pair)} is not [str or int key, node]")
        if pair[0] in seen:
            raise c.fail(f"a dict of the tree holds key {show(pair[0])} twice")
        seen.add(pair[0])
    return [pair[1] for pair in items]


def _dict_key(key: Any) -> bool:
    return isinstance(key, str) or (type(key) is int)
