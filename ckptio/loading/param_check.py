"""Find an index-keyed optimizer whose parameters differ from those its state was saved for.

A save records each index-keyed optimizer's parameter names in its param groups
(format/param_names.py). Before anything is read, a load compares them with the names its own
state gives the optimizer's parameters (only for an optimizer the load's ``keys`` select): a
difference means the model gained, lost or reshaped parameters since the save, or pipeline
stages of equal sizes split another way (the same indices and shapes, other parameters). A
strict load refuses it (``refusal``: the names added, removed and reshaped, and the fixes:
strict=False, keys=, ``ckptio.OptimizerState``); a ``strict=False`` load maps the state by name
(by_name.py). A checkpoint without names (older, or an optimizer whose parameters no module of
the state names) is loaded as before; the names themselves are never loaded (``is_marker``).

``resized_state``: where the names agree, a strict=False load leaves a resized parameter (its
saved shape differs) as it was, and the optimizer state saved for it too (old shapes): an
index-keyed optimizer's found by storage, a name-keyed state dict's (get_optimizer_state_dict)
by the name whose tensors are resized, ``step`` included.

Call order (matching.match, the first rule): ``differing`` before its reads (``refusal`` if strict);
``resized_state`` once the plan knows the resized keys. Owns: the comparison and its messages.
Does not own: recording the names (format/param_names.py), the mapping (by_name.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ckptio.errors import ManifestError
from ckptio.format import param_names, values
from ckptio.format.flatten import FlatState
from ckptio.io.buffers import torch_dtype
from ckptio.loading import state_keys
from ckptio.loading.by_name import Renamed
from ckptio.loading.stored import Sources

__all__ = ["differing", "outside", "refusal", "resized_state"]


def differing(flat: FlatState, sources: Sources, select: Callable[[str], bool],
              cast: bool = False) -> list[Renamed]:
    """The index-keyed optimizers of ``flat`` whose parameters' names differ from those saved
    for this rank, among those with a key ``select`` accepts (a load leaving an optimizer out
    never looks at it)."""
    names: dict[int, str] | None = None
    out: list[Renamed] = []
    for prefix, obj, _inner in flat.statefuls:
        if not isinstance(obj, torch.optim.Optimizer) or not _selected(sources, prefix, select):
            continue
        names = param_names.module_names(flat.root) if names is None else names
        wanted = param_names.wanted_names(obj, names)
        if wanted is None:
            continue
        base = f"{prefix}.param_groups".lstrip(".")
        saved: list[list[str]] = []
        while (got := _saved(sources, f"{base}.{len(saved)}.{param_names.KEY}")) is not None:
            saved.append([str(n) for n in got])
        if saved and saved != wanted:
            out.append(_renamed(flat, sources, prefix, obj, saved, wanted,
                                frozenset(names.values()), cast))
    return out


def outside(select: Callable[[str], bool], renamed: list[Renamed]) -> Callable[[str], bool]:
    """``select`` without the keys of the ``renamed`` optimizers (a strict=False load maps
    them by name instead: by_name.py)."""
    if not renamed:
        return select
    starts = tuple(f"{r.prefix}." for r in renamed if r.prefix)
    if len(starts) < len(renamed):  # the state's root is one of them: every key is its
        return lambda _k: False
    return lambda k: select(k) and not k.startswith(starts)


def _selected(sources: Sources, prefix: str, select: Callable[[str], bool]) -> bool:
    start = f"{prefix}." if prefix else ""
    return any(k.startswith(start) and select(k) and not param_names.is_marker(k)
               for k in sources.keys())


def _renamed(flat: FlatState, sources: Sources, prefix: str, opt: torch.optim.Optimizer,
             saved: list[list[str]], wanted: list[list[str]], in_model: frozenset[str],
             cast: bool) -> Renamed:
    """What changed: each saved name's index, and the parameters whose model tensor (found in
    the state by storage) was saved with another shape (or, without ``cast``, dtype)."""
    index: dict[str, int] = {}
    for g, group in enumerate(saved):
        numbers = _saved(sources, f"{prefix}.param_groups.{g}.params".lstrip("."))
        if numbers is None or len(numbers) != len(group):  # torch numbers them in order
            numbers = list(range(len(index), len(index) + len(group)))
        index.update((name, int(i)) for name, i in zip(group, numbers))
    key_of = {ptr: k for k, value in flat.leaves.items() if (ptr := _storage(value))}
    params = {n: p for g, group in enumerate(opt.param_groups) for n, p in zip(wanted[g], group["params"])}
    reshaped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    retyped: set[str] = set()
    model = None
    for name, param in params.items():
        key = key_of.get(ptr) if (ptr := _storage(param)) is not None else None
        if key is None:
            continue
        model = model or (key[:-len(name)].rstrip(".") if key.endswith(name) else None)
        source = sources.tensors.get(sources.aliases.get(key, key))
        if name in index and source is not None and tuple(source.head.shape) != tuple(param.shape):
            reshaped[name] = (tuple(param.shape), tuple(source.head.shape))
        elif name in index and source is not None and not cast and \
                torch_dtype(source.head.dtype) != param.dtype:
            retyped.add(name)
    beside = tuple(sorted({k.split(".", 1)[0] for k in flat.leaves} - {prefix}))
    return Renamed(prefix, opt, saved, wanted, index, reshaped, model, in_model,
                   frozenset(retyped), beside if prefix and "." not in prefix else ())


def refusal(renamed: Renamed, sources: Sources) -> tuple[str, str]:
    """The strict load's error for ``renamed``: what changed, and the fixes in load's
    arguments."""
    prefix = renamed.prefix
    split = (sources.saved_world > 1 and not renamed.reshaped and renamed.added
             and all(_in_checkpoint(renamed, sources, n) for n in renamed.added))
    # everything but the optimizer (its scheduler, step and RNG too), else the model alone
    leave_out = (f"keys={list(renamed.beside)!r}" if renamed.beside else
                 f"keys=[{renamed.model!r}]" if renamed.model else "keys=...")
    fate = "; ".join(([] if not renamed.added else ["added parameters start with none"])
                     + ([] if not renamed.removed else ["removed ones' state is left out"]))
    fixes = (f"Pass strict=False to load what matches (the model's tensors of unchanged name and "
             "shape, and this optimizer's state mapped by parameter name"
             f"{': ' + fate if fate else ''}), or {leave_out} to leave the optimizer out (with "
             "strict=False as well where the model's own keys changed)")
    if split:
        g = next((g for g, (a, b) in enumerate(zip(renamed.saved, renamed.wanted)) if a != b), 0)
        return (_message(prefix, g, renamed.saved[g], renamed.wanted[g], sources)
                + f"; if the model changed instead ({renamed.changes()})",
                f": {fixes[0].lower()}{fixes[1:]}")
    changes = renamed.changes()
    sizes = [[len(g) for g in groups] for groups in (renamed.saved, renamed.wanted)]
    what = (f"the model's parameters changed since the save ({changes})" if changes else
            "its parameters were reordered since the save (the same parameters and groups, in "
            "another order: modules defined in another order?)" if sizes[0] == sizes[1] else
            "its parameters were regrouped or reordered since the save (the same parameters: "
            f"saved as {len(sizes[0])} param group(s) of {sizes[0]}, now {len(sizes[1])} of "
            f"{sizes[1]})")
    wrapped = state_keys.wrapper_hint(renamed.added, renamed.removed)
    return (f"key {prefix or '(the state)'!r}: {what}, and this optimizer keys its state by "
            "parameter index: loaded by index, parameters would get other parameters' state."
            + wrapped, "" if wrapped else " " + fixes)


def _in_checkpoint(renamed: Renamed, sources: Sources, name: str) -> bool:
    """Whether the checkpoint holds the model tensor of parameter ``name`` (saved by a stage
    that holds it: pipeline stages split another way)."""
    key = f"{renamed.model}.{name}" if renamed.model else name
    return sources.aliases.get(key, key) in sources.tensors or key in sources.unread


def resized_state(flat: FlatState, resized: Iterable[str]) -> Callable[[str], bool]:
    """Whether a key is an index-keyed optimizer's state for one of the ``resized`` leaves
    (a parameter whose saved shape differs from the state's), matched by storage."""
    ptrs = {_storage(flat.leaves[key]) for key in resized if key in flat.leaves} - {None}
    prefixes: list[str] = []
    for prefix, obj, _inner in flat.statefuls:
        if isinstance(obj, torch.optim.Optimizer):
            params = [p for group in obj.param_groups for p in group["params"]]
            prefixes += [f"{prefix}.state.{i}.".lstrip(".") for i, p in enumerate(params)
                         if _storage(p) in ptrs]
    starts = tuple(prefixes + _named_state(flat, resized))
    return lambda key: bool(starts) and key.startswith(starts)


def _named_state(flat: FlatState, resized: Iterable[str]) -> list[str]:
    """The per-parameter prefixes (``optim.state.<name>.``) of a name-keyed optimizer state
    dict (``get_optimizer_state_dict``: ``state`` beside ``param_groups``) one of whose tensors
    is ``resized``: its other entries (``step``) belong to the saved values too."""
    owners = {k.split("param_groups.", 1)[0] for k in flat.leaves if "param_groups." in k}
    found: list[str] = []
    for key in resized:
        param = key.rsplit(".", 1)[0] + "."  # optim.state.<name>.
        if any(param.startswith(f"{owner}state.") and len(param) > len(owner) + len("state.")
               for owner in owners if owner == "" or owner.endswith(".")):
            found.append(param)
    return found


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


def _saved(sources: Sources, base: str) -> list[Any] | None:
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
             sources: Sources) -> str:
    def some(names: list[Any]) -> str:
        return f"{names[:3]}{' ...' if len(names) > 3 else ''} ({len(names)})"
    return (f"key {prefix or '(the state)'!r}: this optimizer keys its state by index, and param "
            f"group {group} was saved (saved rank {sources.source_rank}) for the parameters "
            f"{some(saved)}, while this state's optimizer holds {some(wanted)}: loading by "
            "index would give these parameters other parameters' state (pipeline stages split "
            "another way). Save ckptio.OptimizerState(model, optimizer) in its place (keyed by "
            "parameter name, it loads into any split), or load with the split that saved it")
