"""The type of a saved container beyond dict, list and tuple: namedtuples, defaultdicts and
Counters.

A namedtuple, a defaultdict or a Counter is saved as the tuple or dict it is, wrapped in a tree node
``{"c": [info, node]}`` (docs/FORMAT.md "Tree") whose ``info`` says what it was:

    ["namedtuple", module, qualname, [field, ...]]     node: {"t": [...]}, one child per field
    ["defaultdict", factory]                           node: {"d": [...]}; factory in FACTORIES
    ["Counter"]                                        node: {"d": [...]}

A fresh load rebuilds it without importing or running anything a manifest could choose: the
namedtuple class is looked up (never imported) in the modules already imported, by its
qualified name, without running attribute hooks, and taken only if it is a tuple subclass with
the saved fields; the value is then made by ``tuple.__new__`` (what the class's own ``__new__``
does). When no such class is loaded, a namedtuple class of the same name and fields stands in
(made once per process and type). A defaultdict's factory is one of the builtins of FACTORIES;
a defaultdict with any other factory (a lambda, a class) is refused on save, naming the key.
A Counter (a scheduler's ``MultiStepLR.milestones``) comes back a Counter, not a dict.

Owns: ``info_of`` (save), ``problem`` (the check of a manifest's info, which is hostile) and
``rebuild`` (fresh load). Does not own: the tree walk (flatten.py, keyrules.py). Torch-free.
"""

from __future__ import annotations

import collections
import inspect
import keyword
import sys
from typing import Any

from ckptio.errors import UnsupportedStateError
from ckptio.format.types import Json, show

__all__ = ["FACTORIES", "info_of", "problem", "rebuild"]

# The default factories a defaultdict may have (by name): builtins that take no arguments.
FACTORIES: dict[str, Any] = {
    "None": None, "list": list, "dict": dict, "int": int, "float": float, "complex": complex,
    "str": str, "bytes": bytes, "bool": bool, "tuple": tuple}


def info_of(value: Any, key: str, refuse: bool = True) -> Json | None:
    """The ``info`` of a namedtuple, defaultdict or Counter ``value`` (None for any other
    container: a plain dict, list or tuple, or another subclass, saved as its base type).
    UnsupportedStateError naming ``key`` for a defaultdict whose factory is not in FACTORIES
    (with ``refuse`` False: None, a plain dict)."""
    kind = type(value)
    if kind in (dict, list, tuple):
        return None
    if isinstance(value, tuple):
        fields = inspect.getattr_static(kind, "_fields", None)
        if (isinstance(fields, tuple) and len(fields) == len(value)
                and all(isinstance(f, str) for f in fields)):
            return ["namedtuple", kind.__module__, kind.__qualname__, list(fields)]
        return None
    if kind is collections.Counter:
        return ["Counter"]
    if isinstance(value, collections.defaultdict):
        factory = value.default_factory
        name = next((n for n, f in FACTORIES.items() if f is factory), None)
        if name is None and not refuse:
            return None
        if name is None:
            raise UnsupportedStateError(
                f"key {key or 'the state'!r}: a defaultdict whose default_factory is "
                f"{factory!r}, which a load could not make again without running code the "
                f"checkpoint names; ckptio keeps defaultdicts of {', '.join(FACTORIES)}. Save "
                "dict(d) (and make the defaultdict again after loading), or use one of those")
        return ["defaultdict", name]
    return None


def _field_name(name: Any) -> bool:
    return (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)
            and not name.startswith("_"))


def problem(info: Any, node: Any) -> str | None:
    """What is wrong with a manifest's ``{"c": [info, node]}``, or None (node: the wrapped
    node, whose own shape the tree walk checks)."""
    if not (isinstance(info, list) and info and isinstance(node, dict) and len(node) == 1):
        return f"container info {show(info)} is not [type, ...] wrapping one node"
    (tag, body), = node.items()
    if info[0] == "namedtuple":
        if not (len(info) == 4 and isinstance(info[1], str) and isinstance(info[2], str)
                and isinstance(info[3], list) and all(_field_name(f) for f in info[3])
                and len(set(info[3])) == len(info[3])):
            return (f"namedtuple info {show(info)} is not [\"namedtuple\", module, qualname, "
                    "[distinct field names]]")
        if tag != "t" or not isinstance(body, list) or len(body) != len(info[3]):
            return f"a namedtuple of {len(info[3])} fields does not wrap a tuple of as many"
        return None
    if info[0] == "defaultdict":
        if len(info) != 2 or info[1] not in FACTORIES:
            return f"defaultdict info {show(info)} does not name a factory of {list(FACTORIES)}"
        if tag != "d":
            return "a defaultdict does not wrap a dict"
        return None
    if info[0] == "Counter":
        return None if len(info) == 1 and tag == "d" else (
            f"Counter info {show(info)} is not [\"Counter\"] wrapping a dict")
    return f"container type {show(info[0])} is unknown"


def rebuild(info: Json, value: Any) -> Any:
    """``value`` (the tuple or dict a load built) as the container ``info`` describes; as it
    is when a partial load (``keys=...``) left out some of a namedtuple's fields."""
    if info[0] == "defaultdict":
        return collections.defaultdict(FACTORIES[info[1]], value)
    if info[0] == "Counter":
        return collections.Counter(value)
    fields = tuple(info[3])
    if len(value) != len(fields):
        return value
    cls = _loaded_class(info[1], info[2], fields) or _stand_in(info[1], info[2], fields)
    return tuple.__new__(cls, value)


def _loaded_class(module: str, qualname: str, fields: tuple[str, ...]) -> type | None:
    """The namedtuple class ``module.qualname`` if that module is imported and it is one with
    ``fields``; nothing is imported and no attribute hook runs."""
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        if found is None:
            return None
        found = inspect.getattr_static(found, part, None)
    if (isinstance(found, type) and issubclass(found, tuple)
            and inspect.getattr_static(found, "_fields", None) == fields):
        return found
    return None


_STAND_INS: dict[tuple[str, str, tuple[str, ...]], type] = {}


def _stand_in(module: str, qualname: str, fields: tuple[str, ...]) -> type:
    """A namedtuple class named as the saved one, with its fields (one per process and type,
    so values loaded twice have the same type)."""
    key = (module, qualname, fields)
    if key not in _STAND_INS:
        name = qualname.rsplit(".", 1)[-1]
        _STAND_INS[key] = collections.namedtuple(
            name if name.isidentifier() and not keyword.iskeyword(name) else "SavedTuple",
            fields, module=module)
    return _STAND_INS[key]
