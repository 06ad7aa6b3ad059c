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
``name_groups`` for each optimizer's state_dict. ``recorded`` reads them back from a manifest's
values and ``rekey`` / ``by_name`` key a loaded state's optimizer state_dicts by them (DCP's
``get_state_dict`` form, for ``convert --to dcp``). Owns: finding the modules and the names. Does not own: the
check (loading/param_check.py), how the values are stored (plan.py).
"""

from __future__ import annotations

from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import: ckptio diff and ls skip the names (is_marker)
    import torch

__all__ = ["KEY", "TORCH_KEY", "by_name", "is_marker", "module_names", "name_groups", "recorded",
           "rekey", "without_names", "wanted_names"]

KEY = "ckptio_param_names"
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
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
    if isinstance(state, torch.nn.Module):  # (named_parameters gives each parameter once)
        pairs = list(state.named_parameters())
        return dict(zip(map(id, map(_SECOND, pairs)), map(_FIRST, pairs)))
    if depth > 8:
        return out
    children = (state.values() if isinstance(state, dict)
                else state if isinstance(state, (list, tuple)) else ())
    for child in children:
        found = module_names(child, depth + 1)  # a fresh dict: the names found first win
        found.update(out)
        out = found
    return out


def wanted_names(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]] | None:
    """Each param group's parameter names, or None when the optimizer keeps its own (torch's
    named optimizers) or a parameter has no name in ``names``."""
    if any(TORCH_KEY in group for group in optimizer.param_groups):
        return None
    out = [list(map(names.get, map(id, group["params"]), repeat("")))
           for group in optimizer.param_groups]
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



def recorded(values: dict[str, Any]) -> dict[str, list[list[str]]]:
    """The names a save recorded, from a checkpoint's flat values (key -> decoded value): the
    optimizer's key (``optim``) -> each param group's names, in ``params`` order."""
    found: dict[str, dict[int, dict[int, str]]] = {}
    for key, name in values.items():
        if not is_marker(key) or not isinstance(name, str):
            continue
        parts = key.split(".")
        if parts[-3].isdigit() and parts[-1].isdigit():
            groups = found.setdefault(".".join(parts[:-4]), {})
            groups.setdefault(int(parts[-3]), {})[int(parts[-1])] = name
    return {prefix: [[names[i] for i in sorted(names)] for _g, names in sorted(groups.items())]
            for prefix, groups in found.items()}


def by_name(inner: dict[Any, Any], names: list[list[str]]) -> dict[Any, Any] | None:
    """An optimizer's state_dict keyed by parameter name, as DCP's ``get_state_dict`` gives it
    (``state`` by name, each group's ``params`` the names), or None when ``names`` do not fit
    its groups (another optimizer, or one already keyed by name)."""
    groups, state = inner.get("param_groups"), inner.get("state")
    if (not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(names)
            or not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                       and len(g["params"]) == len(n) for g, n in zip(groups, names))):
        return None
    rename = {index: name for group, got in zip(groups, names)
              for index, name in zip(group["params"], got)}
    if set(state) - set(rename):
        return None
    return {**inner, "state": {rename[k]: v for k, v in state.items()},
            "param_groups": [{**g, "params": list(n)} for g, n in zip(groups, names)]}


def rekey(state: Any, names: dict[str, list[list[str]]], key: str = "", depth: int = 0) -> list[str]:
    """Key each optimizer state_dict in ``state`` (a loaded state: dicts and lists) by the names
    ``recorded`` found for its key, in place (``by_name``). -> the keys of the optimizer
    state_dicts left keyed by index (no names recorded for them, or names that do not fit)."""
    left: list[str] = []
    items = (state.items() if isinstance(state, dict)
             else enumerate(state) if isinstance(state, list) and depth <= 8 else ())
    for part, child in list(items):
        here = f"{key}.{part}" if key else str(part)
        if _index_keyed(child):
            named = by_name(child, names[here]) if here in names else None
            if named is None:
                left.append(here)
            else:
                state[part] = named
        elif depth < 8:
            left += rekey(child, names, here, depth + 1)
    return left


def _index_keyed(value: Any) -> bool:
    """An optimizer state_dict keyed by parameter index (torch.optim's own form)."""
    return (isinstance(value, dict) and isinstance(value.get("param_groups"), list)
            and isinstance(value.get("state"), dict)
            and all(type(k) is int for k in value["state"])
            and all(isinstance(g, dict) and all(type(i) is int for i in g.get("params", ()))
                    for g in value["param_groups"]))
