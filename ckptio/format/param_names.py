"""The names of an index-keyed optimizer's parameters, recorded beside its state at save.

``torch.optim.Optimizer.state_dict()`` keys each parameter by its index in the optimizer. On
pipeline stages of equal sizes, another split of the layers gives every rank the same indices
and shapes for other parameters, and a load would hand a stage another stage's moments without
a word. So a save that holds the modules whose parameters an optimizer optimizes records, in each
of its param groups, ``ckptio_param_names`` (a key of ckptio's own: torch's ``param_names``
would be copied into the live optimizer, whose later unnamed ``add_param_group`` torch then
refuses); a load compares them with the names its own state gives and refuses another
assignment, and never hands them to the optimizer nor returns them (loading/param_check.py). An
optimizer keeping torch's own names, or with a parameter no module of the state names, is left
as it is.

Call order: ``flatten(state, names=True)`` (a save) -> ``module_names(state)`` once ->
``name_groups`` for each optimizer's state_dict. Owns: finding the modules and the names. Does
not own: the check (loading/param_check.py), how the values are stored (plan.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: ckptio diff and ls skip the names (is_marker)
    import torch

__all__ = ["KEY", "TORCH_KEY", "is_marker", "module_names", "name_groups", "without_names",
           "wanted_names"]

KEY = "ckptio_param_names"
TORCH_KEY = "param_names"  # torch's named optimizers' own


def is_marker(key: str) -> bool:
    """Whether a flat key is one of the names a save recorded (``...param_groups.G.KEY.I``)."""
    parts = key.split(".")
    return len(parts) >= 4 and parts[-2] == KEY and parts[-4] == "param_groups"


def module_names(state: Any, depth: int = 0) -> dict[int, str]:
    """id(parameter) -> its name in the first module of ``state`` holding it (modules found in
    its dicts, lists and tuples, not inside other objects)."""
    import torch

    out: dict[int, str] = {}
    if isinstance(state, torch.nn.Module):
        for fqn, param in state.named_parameters():
            out.setdefault(id(param), fqn)
        return out
    if depth > 8:
        return out
    children = (state.values() if isinstance(state, dict)
                else state if isinstance(state, (list, tuple)) else ())
    for child in children:
        for key, name in module_names(child, depth + 1).items():
            out.setdefault(key, name)
    return out


def wanted_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]] | None:
    """Each param group's parameter names, or None when the optimizer keeps its own (torch's
    named optimizers) or a parameter has no name in ``names``."""
    if any(TORCH_KEY in group for group in optimizer.param_groups):
        return None
    out = [[names.get(id(p), "") for p in group["params"]] for group in optimizer.param_groups]
    return None if any("" in group for group in out) else out


def name_groups(inner: dict[Any, Any], optimizer: torch.optim.Optimizer,
                names: dict[int, str]) -> None:
    """Add ``param_names`` to each param group of ``inner`` (the optimizer's state_dict: its
    groups are copies) where ``wanted_names`` has them."""
    wanted = wanted_names(optimizer, names)
    groups = inner.get("param_groups")
    if wanted is None or not isinstance(groups, list) or len(groups) != len(wanted):
        return
    for group, got in zip(groups, wanted):
        if isinstance(group, dict):
            group[KEY] = got


def without_names(tree: Any) -> Any:
    """A manifest tree (flatten.py's JSON) without the names a save recorded: what a fresh load
    rebuilds (the optimizer's state_dict as it was)."""
    if not isinstance(tree, dict) or len(tree) != 1:
        return tree
    (tag, body), = tree.items()
    if tag == "d":
        return {"d": [[k, without_names(child)] for k, child in body if k != KEY]}
    if tag in ("l", "t"):
        return {tag: [without_names(child) for child in body]}
    if tag == "s":
        return {"s": without_names(body)}
    if tag == "c":
        return {"c": [body[0], without_names(body[1])]}
    return tree

