"""Refuse an in-place load that would hand an index-keyed optimizer other parameters' state.

A save records each index-keyed optimizer's parameter names in its param groups
(format/param_names.py). Before anything is read, a load compares them, group by group, with
the names its own state gives the optimizer's parameters: any difference (pipeline stages of
equal sizes split another way give the same indices and shapes to other parameters) is a
StateMismatchError naming the optimizer, the group, both lists' first names and the fix
(``ckptio.OptimizerState``). A checkpoint without names (older, or an optimizer whose
parameters no module of the state names) is loaded as before. The names themselves are never
loaded (``is_marker`` keys: left out of every load, in place or fresh).

Call order (fill.fill_in_place): ``check(flat, sources)`` before its reads. Owns: the
comparison and its message. Does not own: recording the names (format/param_names.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ckptio.errors import ManifestError, StateMismatchError
from ckptio.format import param_names, values
from ckptio.format.flatten import FlatState

__all__ = ["check"]


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
