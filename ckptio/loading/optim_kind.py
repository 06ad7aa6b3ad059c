"""Find an optimizer whose checkpoint state another kind of optimizer saved (AdamW's into SGD).

An optimizer's param groups (a ckptio.OptimizerState's: its optimizers') name its
hyperparameters (AdamW's ``betas``, ``eps``; SGD's ``momentum``, ``dampening``). Where the
saved groups hold names this optimizer's groups lack and lack names they hold, the state was
saved by another optimizer: loading it would hand this one the other's learning rate and
weight decay and moments it never reads, silently. A strict load refuses it (``refusal``: the
names each side has alone, and the fixes); a ``strict=False`` load leaves that optimizer as
built and reports it (``left_out``), with its schedulers. A name on one side only (a torch
release adding a hyperparameter) is the load's ordinary key rule.

Call order (matching.match, before the renamed optimizers): ``found`` (``differing``, then
``refusal`` if strict), ``outside`` and ``left_out``. Owns: the comparison and its messages.
Does not own: the key rules (matching.py), an optimizer whose parameters changed
(param_check.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ckptio.errors import StateMismatchError
from ckptio.format.flatten import FlatState
from ckptio.format.param_names import KEY, TORCH_KEY, is_marker

__all__ = ["OtherKind", "differing", "found", "left_out", "outside", "refusal"]

# not the optimizer's own: its parameters, their names, a scheduler's (the first learning rate)
_NOT_HYPER = frozenset(("params", KEY, TORCH_KEY, "initial_lr", ""))


@dataclass(frozen=True)
class OtherKind:
    """The optimizer at ``prefix`` (its class ``name``) and the hyperparameter names only the
    checkpoint's groups hold (``saved_only``) and only its own groups hold (``own_only``); or
    (``of``: that optimizer's prefix) a learning-rate scheduler of such an optimizer, whose
    saved base learning rates are the other optimizer's."""

    prefix: str
    name: str
    saved_only: tuple[str, ...] = ()
    own_only: tuple[str, ...] = ()
    of: str | None = None

    def what(self) -> str:
        """The difference, in words."""
        if self.of is not None:
            return (f"this {self.name} schedules optimizer {self.of or '(the state)'!r}, whose "
                    "saved state another kind of optimizer saved: its saved base learning "
                    "rates are that optimizer's")
        return (f"the checkpoint's param groups hold {list(self.saved_only)}, which this "
                f"{self.name}'s lack, and lack its {list(self.own_only)}: another kind of "
                "optimizer saved them")


def differing(flat: FlatState, keys: list[str], select: Callable[[str], bool]) -> list[OtherKind]:
    """The optimizers of ``flat`` (among those ``select`` accepts) whose saved param groups
    name other hyperparameters than their own, both ways; ``keys``: the checkpoint's."""
    out: list[OtherKind] = []
    optimizers: dict[int, str] = {}
    for prefix, obj, _inner in flat.statefuls:
        held = _held(obj)
        if not held:
            continue
        base = f"{prefix}.param_groups.".lstrip(".")
        saved = {_hyper(k[len(base):]) for k in keys
                 if k.startswith(base) and select(k) and not is_marker(k)}
        own = {str(n) for o in held for group in o.param_groups if isinstance(group, dict)
               for n in group}
        saved_only, own_only = saved - own - _NOT_HYPER, own - saved - _NOT_HYPER
        if saved and saved_only and own_only:
            names = "/".join(type(o).__name__ for o in held)
            out.append(OtherKind(prefix, names, tuple(sorted(saved_only)),
                                 tuple(sorted(own_only))))
            optimizers.update({id(x): prefix for x in (obj, *held)})
    return out + _schedulers(flat, optimizers)


def _held(obj: object) -> list[torch.optim.Optimizer]:
    """The optimizers a stateful is: itself (the one an accelerate wrapper wraps), or those a
    ckptio.OptimizerState keys by name (``optimizers``); none for anything else."""
    if isinstance(obj, torch.optim.Optimizer):
        inner = getattr(obj, "optimizer", obj)
        return [inner if isinstance(inner, torch.optim.Optimizer) else obj]
    found = getattr(obj, "optimizers", None)
    if isinstance(found, list) and found and all(
            isinstance(o, torch.optim.Optimizer) for o in found):
        return found
    return []


def _hyper(rest: str) -> str:
    """The hyperparameter a param-group key names: after the group (an index, or a parameter's
    name in an OptimizerState), before a tuple's item index ("0.betas.1": betas)."""
    parts = rest.split(".")
    while len(parts) > 1 and parts[-1].isdigit():
        parts.pop()
    return parts[-1] if len(parts) > 1 else ""


def _schedulers(flat: FlatState, optimizers: dict[int, str]) -> list[OtherKind]:
    """The schedulers (``.optimizer``: torch's, accelerate's) of the ``optimizers`` (id ->
    prefix), left out with them."""
    out = []
    for prefix, obj, _inner in flat.statefuls:
        if _held(obj):
            continue
        of = id(getattr(obj, "optimizer", getattr(getattr(obj, "scheduler", None), "optimizer",
                                                  None)))
        if of in optimizers:
            out.append(OtherKind(prefix, type(obj).__name__, of=optimizers[of]))
    return out


def found(flat: FlatState, keys: list[str], select: Callable[[str], bool],
          strict: bool) -> list[OtherKind]:
    """``differing``, refused (StateMismatchError: ``refusal``) if ``strict``."""
    kinds = differing(flat, keys, select)
    if kinds and strict:
        raise StateMismatchError(*refusal(kinds, flat))
    return kinds


def refusal(kinds: list[OtherKind], flat: FlatState) -> tuple[str, str]:
    """The strict load's error for the first of ``kinds`` (an optimizer): what differs, and
    the fixes in load's arguments (the keys to load leave out its schedulers too)."""
    kind, out = kinds[0], tuple(f"{k.prefix}." for k in kinds)
    rest = sorted({k.split(".", 1)[0] for k in flat.leaves if kind.prefix
                   and not k.startswith(out)})
    leave_out = f"keys={rest!r}" if rest else "keys=..."
    return (f"key {kind.prefix or '(the state)'!r}: {kind.what()}. Its state cannot be loaded "
            "into this optimizer (it would take the other's learning rate, weight decay and "
            "state): build the optimizer the saved run used.", " Otherwise pass strict=False ("
            f"this optimizer is left as built, and a warning says so), or {leave_out} to leave "
            "it out")


def outside(select: Callable[[str], bool], kinds: list[OtherKind]) -> Callable[[str], bool]:
    """``select`` without the keys of the ``kinds`` optimizers (left as built)."""
    if not kinds:
        return select
    starts = tuple(f"{k.prefix}." for k in kinds if k.prefix)
    if len(starts) < len(kinds):  # the state's root is the optimizer: nothing else to load
        return lambda _k: False
    return lambda k: select(k) and not k.startswith(starts)


def left_out(kind: OtherKind) -> str:
    """The strict=False report line of ``kind``'s optimizer, left as built."""
    return (f"{kind.prefix or '(the state)'}: {kind.what()}; left as built (as the new run "
            "made it)")
