"""An optimizer's state keyed by parameter name, so pipeline stages save it without collisions.

    state = {"model": stage, "optim": ckptio.OptimizerState(stage, opt), "sched": sched}
    ckptio.save(state, path)    # every rank; each stage's parameters under their own names
    ckptio.load(path, state)    # any number of stages, any split of the layers, one process

``torch.optim.Optimizer.state_dict()`` keys each parameter's state by its index in the
optimizer: on pipeline stages, stage 0's parameter 0 and stage 1's parameter 0 are different
parameters under one key. ``OptimizerState`` presents the same state keyed by each parameter's
fully qualified name (FQN) in the model, the keys of DCP's flattened optimizer state dict (the
keys, the tree, how stages merge and which loads are refused: docs/FORMAT.md, "Optimizers keyed
by parameter name"). Build stages as torchtitan does (layers not in the stage deleted from a
``ModuleDict`` keyed by layer index), so every stage's keys are FQNs of the whole model.

Call order: ``OptimizerState(model, optimizer)`` in the saved state -> a save calls
``state_dict()`` (the live state, by FQN) -> a load calls ``ckptio_creates`` (which absent keys
it may create) and ``load_state_dict()`` (back to indices, as the optimizer was built).

Owns: the FQN <-> index mapping and the per-parameter hyperparameters, both ways. Does not own:
how the values are stored or read (the save and load paths), nor which absent keys a load may
create inside a Stateful (loading/merge.py asks ``ckptio_creates``, defined here).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ckptio.errors import StateMismatchError, UnsupportedStateError

__all__ = ["OptimizerState"]

_MEMBERS = ("params", "param_names")  # what a group holds besides its hyperparameters
_SECTIONS = ("state", "param_groups")


def _as_list(value: Any, kind: type) -> list[Any]:
    items = [value] if isinstance(value, kind) else list(value)
    if not items or not all(isinstance(v, kind) for v in items):
        raise UnsupportedStateError(
            f"OptimizerState expects a {kind.__name__} or a sequence of them; got "
            f"{type(value).__name__}")
    return items


def _names(models: Iterable[torch.nn.Module]) -> dict[int, str]:
    """id(parameter) -> its FQN (the first, for a parameter shared under two names)."""
    out: dict[int, str] = {}
    seen: set[str] = set()
    for model in models:
        for fqn, param in model.named_parameters():
            if id(param) in out:
                continue  # shared by two model parts: its first name
            if fqn in seen:
                raise UnsupportedStateError(
                    f"OptimizerState: two model parts both name a parameter {fqn!r}; every "
                    "stage's parameters need the whole model's names (keep the layer index in "
                    "the name, e.g. a ModuleDict keyed by it)")
            out[id(param)] = fqn
            seen.add(fqn)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b)))
    return type(a) is type(b) and bool(a == b)


class OptimizerState:
    """A Stateful view of ``optimizer`` (or several) keyed by the FQNs of ``model`` (a module,
    or the model parts of this rank's stages). Put it in the saved state in place of the
    optimizer; ``state_dict()`` reads the optimizer's live state (no copies but tensor-valued
    hyperparameters), ``load_state_dict()`` hands it to ``optimizer.load_state_dict`` keyed by
    index, as that optimizer was built.

    A load gives each rank the entries of the parameters it holds, whatever split saved them;
    a parameter group takes the hyperparameters saved for its parameters, and a group whose
    parameters were saved with different values of a hyperparameter is refused (CkptError
    naming the group, the parameters and the values; leave the hyperparameters out with
    ``keys=lambda k: ".param_groups." not in k`` to keep the live ones)."""

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module],
                 optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]) -> None:
        self.models = _as_list(model, torch.nn.Module)
        self.optimizers = _as_list(optimizer, torch.optim.Optimizer)
        self._fqn_of = _names(self.models)
        self._owned = set(self._fqn_of.values())
        for opt in self.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    if id(param) not in self._fqn_of:
                        raise UnsupportedStateError(
                            f"OptimizerState: {type(opt).__name__} holds a parameter of shape "
                            f"{tuple(param.shape)} that no module given has; pass the model "
                            "(or every model part) whose parameters it optimizes")

    def _fqns(self, group: dict[str, Any]) -> list[str]:
        return [self._fqn_of[id(p)] for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        groups: dict[str, Any] = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                hyper = {k: v for k, v in group.items() if k not in _MEMBERS}
                for param, fqn in zip(group["params"], self._fqns(group)):
                    if opt.state.get(param):
                        state[fqn] = dict(opt.state[param])
                    # a tensor hyperparameter is copied per parameter: one tensor under many
                    # keys would be a tie that other stages do not have
                    groups[fqn] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                   for k, v in hyper.items()}
        return {"state": state, "param_groups": groups}

    def _split(self, rest: str) -> tuple[str, str] | None:
        """``<fqn>.<name>`` -> (fqn, name), for a parameter of this rank's; None otherwise."""
        parts = rest.split(".")
        for i in range(len(parts) - 1, 0, -1):
            fqn = ".".join(parts[:i])
            if fqn in self._owned:
                return fqn, ".".join(parts[i:])
        return None

    def ckptio_creates(self, key: str) -> bool:
        """Whether a load may create ``key`` (relative to this object) when the live state
        lacks it: only the entries of this rank's own parameters (a fresh optimizer has no
        per-parameter state until its first step), never another stage's."""
        section, _, rest = key.partition(".")
        return section in _SECTIONS and self._split(rest) is not None

    def _nested(self, state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """``state`` as {section: {fqn: {name: value}}}: a load creates the entries of a
        checkpoint whose tree is flat (DCP's flattened optimizer state dict: one dict keyed
        ``state.<fqn>.<name>``) under their dotted keys."""
        out: dict[str, dict[str, Any]] = {s: dict(state.get(s) or {}) for s in _SECTIONS}
        for key, value in state.items():
            if key in _SECTIONS:
                continue
            section, _, rest = str(key).partition(".")
            found = self._split(rest) if section in _SECTIONS else None
            if found is None:
                raise StateMismatchError(
                    f"OptimizerState: the checkpoint's key {key!r} is not state.<name>.<slot> "
                    "or param_groups.<name>.<hyperparameter> of a parameter of the model given")
            fqn, name = found
            out[section][fqn] = {**out[section].get(fqn, {}), name: value}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        nested = self._nested(state)
        saved_state, saved_groups = nested["state"], nested["param_groups"]
        for opt in self.optimizers:
            groups: list[dict[str, Any]] = []
            per_param: dict[int, Any] = {}
            for index, group in enumerate(opt.state_dict()["param_groups"]):
                live = opt.param_groups[index]
                fqns = self._fqns(live)
                groups.append(self._group(group, fqns, saved_groups, index, opt))
                for number, fqn in zip(group["params"], fqns):
                    if fqn in saved_state:
                        per_param[number] = saved_state[fqn]
            opt.load_state_dict({"state": per_param, "param_groups": groups})

    def _group(self, group: dict[str, Any], fqns: list[str], saved: dict[str, Any],
               index: int, opt: torch.optim.Optimizer) -> dict[str, Any]:
        """The live group (index-keyed, as ``opt.state_dict()`` gives it) with the
        hyperparameters saved for its parameters; refused where those disagree."""
        out = dict(group)
        names = dict.fromkeys(k for k in group if k not in _MEMBERS)
        names.update(dict.fromkeys(k for fqn in fqns for k in saved.get(fqn, {})
                                   if k not in _MEMBERS))
        for name in names:
            found = [(fqn, saved[fqn][name]) for fqn in fqns
                     if fqn in saved and name in saved[fqn]]
            if not found:
                continue
            first_fqn, first = found[0]
            for fqn, value in found[1:]:
                if not _same(value, first):
                    raise StateMismatchError(
                        f"OptimizerState: group {index} of {type(opt).__name__} holds "
                        f"{first_fqn!r} and {fqn!r}, saved with {name}={first!r} and "
                        f"{name}={value!r} (saved in different groups: on different pipeline "
                        "stages, say); build the optimizer with a group per saved value, or "
                        "load with keys=lambda k: '.param_groups.' not in k to keep the live "
                        "hyperparameters")
            out[name] = first
        return out
