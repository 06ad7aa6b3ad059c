"""An index-keyed optimizer's saved state, loaded into a changed model by parameter name.

A save records the names of an index-keyed optimizer's parameters (format/param_names.py). When
the model gained, lost or reshaped parameters since, the indices shift: the checkpoint's index
``i`` is another parameter now. A strict load refuses, naming the changed parameters
(loading/param_check.py); a ``strict=False`` load maps the saved state onto the optimizer by
name: a parameter saved under its name with its shape gets its saved state, a new one keeps
what it has (nothing, in a freshly built optimizer: its first step creates it), a removed or
reshaped one's saved state is left out, and each param group takes the hyperparameters of the
saved group that held its parameters.

Call order (fill.fill_in_place): param_check.differing and ``Renamed.reads`` (which saved keys
the load reads) in matching.py -> the reads (fill_plan.py) -> merge.put_back -> ``load_into``
(the optimizer's own load_state_dict) -> ``Renamed.summary`` for the warning. Owns: the
mapping. Does not own: detecting the change or its refusal (param_check.py), reading bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptio.errors import ManifestError
from ckptio.format.flatten import unflatten
from ckptio.format.param_names import KEY, TORCH_KEY, without_names
from ckptio.format.types import Json
from ckptio.loading import merge

__all__ = ["Renamed", "load_into"]

_NOT_HYPER = ("params", KEY, TORCH_KEY)
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Renamed:
    """An index-keyed optimizer (at ``prefix`` in the state) whose parameters' names differ
    from those its state was saved for. ``saved``/``wanted``: each param group's names, saved
    and now; ``saved_index``: name -> its index in the saved state; ``reshaped``: name ->
    (shape now, shape saved) of a parameter whose model tensor changed shape; ``model``: the
    key prefix of the model holding its parameters, if found; ``in_model``: the names of the
    state's modules' parameters (a removed name among them left the optimizer only)."""

    prefix: str
    optimizer: torch.optim.Optimizer
    saved: list[list[str]]
    wanted: list[list[str]]
    saved_index: dict[str, int]
    reshaped: dict[str, tuple[Shape, Shape]] = field(default_factory=dict)
    model: str | None = None
    in_model: frozenset[str] = frozenset()  # the names of the state's modules' parameters
    retyped: frozenset[str] = frozenset()  # model tensor saved at another dtype, left (no cast)
    beside: tuple[str, ...] = ()  # the state's other top-level keys (scheduler, step, RNG...)

    @property
    def added(self) -> list[str]:
        """Parameters of the optimizer now that it was not saved for."""
        before = {n for group in self.saved for n in group}
        return [n for group in self.wanted for n in group if n not in before]

    @property
    def removed(self) -> list[str]:
        """Parameters the optimizer was saved for that it does not hold now."""
        now = {n for group in self.wanted for n in group}
        return [n for group in self.saved for n in group if n not in now]

    def kept(self) -> dict[str, int]:
        """Name -> saved index of the parameters whose saved state loads (same name and shape)."""
        now = {n for group in self.wanted for n in group}
        left = {*self.reshaped, *self.retyped}
        return {n: i for n, i in self.saved_index.items() if n in now and n not in left}

    def changes(self) -> str:
        """"added [...]; removed [...]; reshaped [...]" (the non-empty ones)."""
        out = [n for n in self.removed if n in self.in_model]  # frozen, or left out of it
        parts = [f"{what} {_some(names)}" for what, names in (
            ("added", self.added), ("removed", [n for n in self.removed if n not in out]),
            ("in the model but no longer optimized (frozen?)", out)) if names]
        if self.reshaped:
            parts.append("reshaped " + ", ".join(f"{n} {now}, saved {was}"
                                                  for n, (now, was) in self.reshaped.items()))
        return "; ".join(parts)

    def reads(self, key: str) -> bool:
        """Whether a load reads the saved ``key`` (a key under ``prefix``): the state of a kept
        parameter, or a param group's hyperparameter."""
        rest = key[len(self.prefix) + 1:] if self.prefix else key
        section, _, tail = rest.partition(".")
        first = tail.split(".", 1)[0]
        if section == "param_groups":
            return tail.count(".") >= 1 and tail.split(".")[1] not in _NOT_HYPER
        kept = {str(i) for i in self.kept().values()}
        return section == "state" and first in kept

    def summary(self, loaded: int) -> str:
        """What a strict=False load did with this optimizer, for its warning."""
        parts = [f"optimizer {self.prefix or '(the state)'!r} was loaded by parameter name "
                 f"({loaded} parameter(s)' state)"]
        if self.added:
            parts.append(f"the new parameters {_some(self.added)} start with no optimizer "
                         "state (their first step creates it)")
        if self.removed:
            parts.append(f"the saved state of the removed parameters {_some(self.removed)} "
                         "was not loaded")
        if self.reshaped:
            parts.append(f"that of the reshaped parameters {_some(list(self.reshaped))} was "
                         "left out")
        if self.retyped:
            parts.append(f"that of the parameters left at another dtype {_some(sorted(self.retyped))}"
                         " was left out (cast=True loads both)")
        return "; ".join(parts)


def _some(names: list[str]) -> str:
    return f"{names[:8]}{f' and {len(names) - 8} more' if len(names) > 8 else ''}"


def _subtree(node: Json, prefix: str, key: str = "") -> Json:
    """The saved tree's node for the Stateful at ``prefix`` (the body of its "s" node)."""
    if not isinstance(node, dict) or len(node) != 1:
        return None
    (tag, body), = node.items()
    if tag == "s":
        return body if key == prefix else _subtree(body, prefix, key)
    if tag == "c":
        return _subtree(body[1], prefix, key)
    for part, child in _children(tag, body):
        inner = f"{key}.{part}" if key else str(part)
        if inner == prefix or prefix.startswith(inner + "."):
            found = _subtree(child, prefix, inner)
            if found is not None:
                return found
    return None


def _children(tag: str, body: Any) -> Iterator[tuple[Any, Json]]:
    if tag == "d":
        yield from ((pair[0], pair[1]) for pair in body)
    elif tag in ("l", "t"):
        yield from enumerate(body)


def load_into(renamed: Renamed, tree: Json, values: dict[str, Any]) -> int:
    """Hand ``renamed.optimizer`` its saved state mapped by name (``values``: the saved keys
    ``reads`` accepted, read; ``tree``: the checkpoint's tree) -> how many parameters got
    saved state."""
    node = _subtree(tree, renamed.prefix)
    if node is None:
        raise ManifestError(f"key {renamed.prefix!r}: the checkpoint's tree holds no optimizer "
                            "there, though its keys name one; the manifest is damaged")
    saved = unflatten(without_names(node), values)
    saved_state = saved.get("state") or {} if isinstance(saved, dict) else {}
    saved_groups = saved.get("param_groups") or [] if isinstance(saved, dict) else []
    live = renamed.optimizer.state_dict()
    state = dict(live["state"])
    loaded = 0
    kept = renamed.kept()
    for g, names in enumerate(renamed.wanted):
        for name, index in zip(names, live["param_groups"][g]["params"]):
            got = saved_state.get(kept[name]) if name in kept else None
            if got:
                state[index] = {**state.get(index, {}), **got}
                loaded += 1
    groups = [_group(renamed, g, group, saved_groups) for g, group in enumerate(live["param_groups"])]
    merge.load_stateful(renamed.prefix, renamed.optimizer, {"state": state, "param_groups": groups})
    return loaded


def _group(renamed: Renamed, g: int, group: dict[str, Any], saved_groups: list[Any]
           ) -> dict[str, Any]:
    """Live group ``g`` with the hyperparameters of the saved group that held one of its
    parameters (none: the live ones)."""
    mine = set(renamed.wanted[g])
    for s, names in enumerate(renamed.saved):
        if mine & set(names) and s < len(saved_groups) and isinstance(saved_groups[s], dict):
            hyper = {k: v for k, v in saved_groups[s].items() if k not in _NOT_HYPER}
            return {**group, **hyper}
    return group
