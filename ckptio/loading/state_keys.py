"""Key rules on the state's shape: its lists of another length, and the keys it may create.

A list whose saved list has another length: holding only Python values, it is replaced whole
(its keys are not matched); holding tensors or arrays, which a load fills in place, its keys
must match (``Lists.hint`` explains the mismatch). A checkpoint key the state lacks is created
where it falls inside a Stateful other than a module (``creatable``: a fresh optimizer's
per-parameter state), as far as the Stateful's ``ckptio_creates`` accepts.

``wrapper_hint``: keys that differ only by a wrapper's name (torch.compile's ``_orig_mod``,
DDP's ``module``), for the messages of the strict key rule and param_check.refusal;
``prefix_hint``: keys that differ by one top-level name (a Hugging Face export or a model's own
state_dict file loaded into ``{"model": model}``, or the reverse), for the strict key rule.

Call order: matching.py (the match stage) and resolve_regular.py (which chunks to read) ask
these before any read; merge.put_back fills the lists and inserts the created keys after.
Owns: these two rules and those hints. Does not own: the other key rules (matching.py), putting back (merge.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.format.flatten import FlatState
from ckptio.format.types import Json
from ckptio.loading.tree_nodes import children, join, leaf_keys, unwrap
from ckptio.planning.sharding import FlatShard, TensorShard

__all__ = ["Lists", "creatable", "prefix_hint", "under", "whole_lists", "wrapper_hint"]

_WRAPPERS = ("_orig_mod", "module")  # torch.compile's OptimizedModule, DDP / DataParallel


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
    saved = unwrap(saved)
    if tag in ("s", "c"):
        _walk_lists(flat, found, body if tag == "s" else body[1], saved, key)
    elif tag == "d":
        theirs = {p[0]: p[1] for p in children(saved, "d") or ()
                  if isinstance(p, list) and len(p) == 2}
        for k, child in body:
            if k in theirs:
                _walk_lists(flat, found, child, theirs[k], join(key, k))
    elif tag in ("l", "t"):
        theirs = children(saved, tag)
        if not isinstance(theirs, list):
            return
        if tag == "l" and len(theirs) != len(body):
            if any(_in_place(flat.leaves[k]) for k in leaf_keys(mine)):
                found.fixed[key] = (len(body), len(theirs))
            else:
                found.whole[key] = {"l": theirs}
                return
        for i, (child, their) in enumerate(zip(body, theirs)):
            _walk_lists(flat, found, child, their, join(key, i))


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


def wrapper_hint(ours: Iterable[str], theirs: Iterable[str]) -> str:
    """A sentence for keys ``ours`` (the state's) and ``theirs`` (the checkpoint's) that are
    the same once a wrapper's part (``_orig_mod``, ``module``) is left out; else ''."""
    def bare(keys: Iterable[str]) -> set[str]:
        return {".".join(p for p in k.split(".") if p not in _WRAPPERS) for k in keys}

    ours, theirs = list(ours), list(theirs)
    if not ours or not theirs or bare(ours) != bare(theirs):
        return ""
    saved = {p for k in theirs for p in k.split(".")} & set(_WRAPPERS)
    now = {p for k in ours for p in k.split(".")} & set(_WRAPPERS)
    return (f" The keys differ only by a wrapper (saved with {sorted(saved) or 'none'}, the "
            f"state has {sorted(now) or 'none'}: torch.compile adds '_orig_mod', DDP "
            "'module'): load into the model wrapped as it was when saved (or unwrap it on both "
            "sides: model._orig_mod, model.module); strict=False would load none of them.")


def prefix_hint(ours: Iterable[str], theirs: Iterable[str]) -> str:
    """A sentence for keys ``ours`` (the state's, missing from the checkpoint) and ``theirs``
    (the checkpoint's, not in the state) that are one another under one top-level name;
    else ''."""
    ours, theirs = list(ours), list(theirs)
    if not ours or not theirs:
        return ""
    top = ours[0].split(".", 1)[0] + "."
    if all(k.startswith(top) for k in ours) and {top + k for k in theirs} <= set(ours):
        return (f" The state holds the checkpoint's keys under {top[:-1]!r} (a Hugging Face "
                f"export or a model's own state_dict file holds them without it): load into "
                f"that entry itself, e.g. ckptio.load(path, model) for {{{top[:-1]!r}: model}}.")
    top = theirs[0].split(".", 1)[0] + "."
    if {top + k for k in ours} <= {k for k in theirs if k.startswith(top)}:
        return (f" The checkpoint holds the state's keys under {top[:-1]!r}: load them into "
                f"the state under that name, e.g. ckptio.load(path, {{{top[:-1]!r}: model}}, "
                f"keys=[{top[:-1]!r}]).")
    return ""
