"""Refuse an in-place load that would hand an index-keyed optimizer other parameters' state.

A save records each index-keyed optimizer's parameter names in its param groups
(format/param_names.py). Before anything is read, a load compares them, group by group, with
the names its own state gives the optimizer's parameters: any difference (pipeline stages of
equal sizes split another way give the same indices and shapes to other parameters) is a
StateMismatchError naming the optimizer, the group, both lists' first names and the fix
(``ckptio.OptimizerState``). A checkpoint without names (older, or an optimizer whose
parameters no module of the state names) is loaded as before. The names themselves are never
loaded (``is_marker`` keys: left out of every load, in place or fresh).

A ``strict=False`` load leaves a resized parameter (its saved shape differs) as it was;
``resized_state`` names the optimizer state saved for it, which is left out too: its moments
have the old shape, and the optimizer's next step would fail on them.

Call order (fill.fill_in_place): ``check(flat, sources)`` before its reads; ``resized_state``
once the plan knows the resized keys. Owns: the comparison and its message. Does not own:
recording the names (format/param_names.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ckptio.errors import ManifestError, StateMismatchError
from ckptio.format import param_names, values
from ckptio.format.flatten import FlatState

__all__ = ["check", "resized_state"]


def check(flat: FlatState, sources: Any) -> None:
    """Raise StateMismatchError where the names saved for this rank differ from those this
    state's optimizers hold. ``sources``: fill.Sources."""
    names: dict[int, str] | None = None
    for prefix, obj, _inner in flat.statefuls:
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        names = param_names.module_names(flat.root) if names is None else names
        wanted = param_names.wanted_names(obj, names)
        if wanted is None:
            continue
        for g, want in enumerate(wanted):
            saved = _saved(sources, f"{prefix}.param_groups.{g}.{param_names.KEY}".lstrip("."))
            if saved is not None and saved != want:
                raise StateMismatchError(_message(prefix, g, saved, want, sources))


def resized_state(flat: FlatState, resized: Iterable[str]) -> Callable[[str], bool]:
    """Whether a key is an index-keyed optimizer's state for one of the ``resized`` leaves
    (a parameter whose saved shape differs from the state's), matched by storage."""
    leaves = (flat.leaves.get(key) for key in resized)
    ptrs = {_storage(leaf.value) for leaf in leaves if leaf is not None} - {None}
    prefixes: list[str] = []
    for prefix, obj, _inner in flat.statefuls:
        if isinstance(obj, torch.optim.Optimizer):
            params = [p for group in obj.param_groups for p in group["params"]]
            prefixes += [f"{prefix}.state.{i}.".lstrip(".") for i, p in enumerate(params)
                         if _storage(p) in ptrs]
    starts = tuple(prefixes)
    return lambda key: bool(starts) and key.startswith(starts)


def _storage(value: Any) -> int | None:
    """Where a tensor's (a DTensor's local) elements start, or None (empty, no storage)."""
    if not isinstance(value, torch.Tensor):
        return None
    local = value.to_local() if hasattr(value, "to_local") else value
    if local.numel() == 0 or local.is_meta:
        return None
    try:
        return int(local.data_ptr())
    except RuntimeError:  # a wrapper subclass without storage of its own
        return None


def _saved(sources: Any, base: str) -> list[Any] | None:
    """The list saved under ``base`` for this rank, or None."""
    got: list[Any] = []
    while (entry := sources.peek(f"{base}.{len(got)}")) is not None:
        try:
            got.append(values.decode(entry.value))
        except ValueError as exc:
            raise ManifestError(f"key {base}.{len(got)}: stored value is malformed: {exc}") \
                from None
    return got or None


def _message(prefix: str, group: int, saved: list[Any], wanted: list[str],
             sources: Any) -> str:
    def some(names: list[Any]) -> str:
        return f"{names[:3]}{' ...' if len(names) > 3 else ''} ({len(names)})"
    return (f"key {prefix or '(the state)'!r}: this optimizer keys its state by index, and param "
            f"group {group} was saved (saved rank {sources.source_rank}) for the parameters "
            f"{some(saved)}, while this state's optimizer holds {some(wanted)}: loading by "
            "index would give these parameters other parameters' state (pipeline stages split "
            "another way). Save ckptio.OptimizerState(model, optimizer) in its place (keyed by "
            "parameter name, it loads into any split), or load with the split that saved it")
