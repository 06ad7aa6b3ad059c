"""Stage one of an in-place load: the state's keys matched with the checkpoint's, one record out.

Every key rule of an in-place load is applied here, one function each. ``match``, in this order:
another kind of optimizer's state (optim_kind.py: refused if strict, else left out), renamed
optimizers (param_check.py: refused if strict, else mapped by name), lists replaced whole
(state_keys.py), dense tensors only, which keys both hold, which the state ties (tied_keys.py),
which are missing, created inside a Stateful (state_keys.py) or unexpected on this rank, each
leaf's destination with its type, shape, meta and dtype rules (``_leaf``: no inference or
expanded tensor is written), keys the state ties that the checkpoint holds apart (tied_keys.py),
the optimizer state of a parameter left as it was (resized, or another dtype). ``check_agreed``,
once the unexpected keys are agreed (with peers: those no rank asks for, inside the read step,
before any read): the strict key rule, the per-rank rules and the strict mismatch rule. The
outcome is a ``Match``, which fill_plan.py turns into reads.

Owns: the rules, their errors and their warnings (kept in the record: the caller emits them,
so they point at the user's line). Does not own: the stored side (stored.py), reads
(fill_plan.py, read.py), putting values back (merge.py, by_name.py), which keys are one tensor
(tied_keys.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ckptio.errors import CAST_HINT, StateMismatchError
from ckptio.format.flatten import FlatState
from ckptio.format.param_names import is_marker
from ckptio.format.types import Json, Manifest, ObjectEntry
from ckptio.io.buffers import torch_dtype
from ckptio.loading import optim_kind, param_check, state_keys, tied_keys
from ckptio.loading.by_name import Renamed
from ckptio.loading.resolve_regular import held_leaf
from ckptio.loading.stored import (KeyFilter, RankPolicy, Sources, TensorSource,
                                   named_nothing, selector, typo_refusal)
from ckptio.loading.tree_nodes import empty_nodes
from ckptio.planning.sharding import Held, check_dense, held

__all__ = ["AgreeFn", "Leaf", "Match", "Rules", "check_agreed", "match"]

# many ranks' key step: this rank's unexpected keys, and what to do with those no rank asks
# for once known (at once, or where the read step agrees them: distributed/loadsteps.py)
AgreeFn = Callable[[tuple[str, ...], Callable[[tuple[str, ...]], None]], None]


@dataclass(frozen=True)
class Rules:
    """A load's key rules (Checkpointer.load's arguments). ``agree_unexpected`` (many ranks)
    hands check_agreed's caller the keys, of this rank's unexpected ones, no rank asks for."""

    keys: KeyFilter = None
    strict: bool = True
    cast: bool = False
    rank: int = 0
    world_size: int = 1
    per_rank_from: RankPolicy = None
    agree_unexpected: AgreeFn | None = None


@dataclass(frozen=True)
class Leaf:
    """A key the load reads: ``region`` of the state's tensor filled in place from ``source``
    (``cast``: read in the stored dtype, then converted), or (``region`` None) the stored
    value read whole and put into the state's container."""

    key: str
    source: TensorSource | ObjectEntry
    region: Held | None = None
    cast: bool = False


@dataclass(frozen=True)
class _Mismatch:
    why: str
    resized: bool = False  # the saved shape or dtype differs: its optimizer state is stale


@dataclass
class Match:
    """The outcome of every key rule. ``leaves``: keys both hold; ``created``: keys a Stateful
    lacks, created in it; ``by_name``: a renamed optimizer's keys (by_name.py); ``lists``:
    the lists replaced whole (state_keys.py); ``problems``: key -> why it is left as it was;
    ``unexpected``: this rank's, then (check_agreed) those no rank asks for; ``warnings``:
    the messages fill_in_place warns of; ``checked``: check_agreed ran."""

    sources: Sources
    renamed: list[Renamed]
    lists: state_keys.Lists = field(default_factory=state_keys.Lists)
    common: list[str] = field(default_factory=list)
    leaves: list[Leaf] = field(default_factory=list)
    created: list[Leaf] = field(default_factory=list)
    by_name: list[Leaf] = field(default_factory=list)
    tied: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    problems: dict[str, str] = field(default_factory=dict)
    resized: list[str] = field(default_factory=list)  # keys whose saved shape or dtype differs
    warnings: list[str] = field(default_factory=list)
    checked: bool = False

    def loaded(self) -> tuple[str, ...]:
        """The keys the load fills, in the order the report lists them."""
        return (*(leaf.key for leaf in (*self.leaves, *self.created)), *self.tied,
                *(leaf.key for leaf in self.by_name))


def match(record: Manifest, flat: FlatState, rules: Rules) -> Match:
    """Apply the key rules of loading ``record`` into ``flat`` that need no other rank (the
    order: module docstring); raises StateMismatchError where a rule refuses. The rest:
    check_agreed."""
    chosen = selector(rules.keys)
    sources = Sources(record, rules.rank, rules.world_size, rules.per_rank_from)
    unknown = named_nothing(rules.keys, sources.keys(), flat.leaves, empty_nodes(record.tree))
    kinds = optim_kind.found(flat, sources.keys(), chosen, rules.strict)
    chosen = optim_kind.outside(chosen, kinds)  # another optimizer's state: left as built
    m = Match(sources, _renamed(flat, sources, chosen, rules))
    m.problems.update((k.prefix, optim_kind.left_out(k)) for k in kinds)
    if unknown:
        _named_nothing(m, unknown, rules.strict)
    select = param_check.outside(chosen, m.renamed)  # those are loaded by name (by_name.py)
    created = _match_keys(m, flat, record.tree, select)
    _leaves(m, flat, rules.cast)
    _created(m, created)
    if m.resized and not rules.strict:
        _drop_resized(m, flat, created)
    _by_name(m, chosen)
    return m


def check_agreed(m: Match, flat: FlatState, strict: bool, agreed: tuple[str, ...]) -> None:
    """The rules that wait for the unexpected keys ``agreed`` (with peers: those no rank asks
    for; alone: this rank's), run before any read: the strict key rule, the per-rank rules,
    the strict mismatch rule; raises StateMismatchError where one refuses."""
    m.unexpected = agreed
    _check_keys(m, flat, strict)
    m.sources.check_refused()
    _absent(m, strict)
    _mismatched(m, strict)
    m.checked = True


def _named_nothing(m: Match, unknown: list[str], strict: bool) -> None:
    """``keys=`` names that select no key of the checkpoint or the state: refused if strict
    (a typo would load nothing and say nothing), else a warning."""
    message = typo_refusal(unknown, m.sources, "the checkpoint or the state")
    if strict:
        raise StateMismatchError(message)
    m.warnings.append(f"strict=False: {message}")


def _renamed(flat: FlatState, sources: Sources, chosen: Callable[[str], bool],
             rules: Rules) -> list[Renamed]:
    """The optimizers whose parameters changed since the save: refused if strict (first)."""
    renamed = param_check.differing(flat, sources, chosen, rules.cast)
    if renamed and rules.strict:
        raise StateMismatchError(*param_check.refusal(renamed[0], sources))
    return renamed


def _match_keys(m: Match, flat: FlatState, tree: Json,
                select: Callable[[str], bool]) -> list[str]:
    """Which keys both hold, are tied, missing or unexpected (on this rank); -> the keys to
    create."""
    saved = [k for k in m.sources.keys() if select(k) and not is_marker(k)]
    lists = state_keys.whole_lists(flat, tree)  # replaced whole: their keys are not matched
    lists.keep_selected(select, (*saved, *flat.leaves))
    m.lists = lists
    in_lists = state_keys.under(lists.whole)
    present = [k for k in flat.leaves if select(k) and not in_lists(k)]
    for key in present:  # before any tensor's storage is asked for (a sparse one has none)
        if isinstance(flat.leaves[key], torch.Tensor):
            check_dense(flat.leaves[key], key)
    saved_set = set(saved)
    m.common = [k for k in present if k in saved_set]
    absent = [k for k in present if k not in saved_set]
    m.tied = tied_keys.tied(flat, absent, m.common)
    m.missing = tuple(k for k in absent if k not in m.tied)
    extra = [k for k in saved if k not in flat.leaves or in_lists(k)]
    may_create = state_keys.creatable(flat)
    created = [k for k in extra if may_create(k) or in_lists(k)]
    m.unexpected = tuple(k for k in extra if not (may_create(k) or in_lists(k)))
    return created


def _leaves(m: Match, flat: FlatState, cast: bool) -> None:
    """Each key both hold: where its value goes, or why it cannot."""
    for key in m.common:
        source = m.sources.get(key)
        if source is None:
            continue  # a per-rank key this rank cannot take: reported by check_refused
        got = _leaf(key, flat, source, cast)
        if isinstance(got, Leaf):
            m.leaves.append(got)
        else:
            m.problems[key] = got.why
            if got.resized:
                m.resized.append(key)
    _tied_apart(m, flat)


def _tied_apart(m: Match, flat: FlatState) -> None:
    """Keys the state ties that the checkpoint holds apart (saved untied): neither is loaded
    (tied_keys.held_apart; strict: refused)."""
    apart, why = tied_keys.held_apart(flat, [(leaf.key, leaf.source) for leaf in m.leaves])
    m.problems.update(why)
    m.leaves = [leaf for leaf in m.leaves if leaf.key not in apart]


def _leaf(key: str, flat: FlatState, source: TensorSource | ObjectEntry,
          cast: bool) -> Leaf | _Mismatch:
    kind = source.head.kind if isinstance(source, TensorSource) else None
    value = flat.leaves[key]
    if kind == "tensor":  # the leaf's region: known once per load (resolve_regular.held_leaf)
        return _into(key, value, held_leaf(flat, key), source, cast)  # type: ignore[arg-type]
    dest = _numpy_dest(value) if kind == "numpy" else None
    if dest is not None:
        return _into(key, dest, held(dest, key), source, cast=False)  # type: ignore[arg-type]
    return Leaf(key, source)  # replaced in its container (tuples rebuilt): merge.put_back


def _into(key: str, value: object, region: Held | None, source: TensorSource,
          cast: bool) -> Leaf | _Mismatch:
    """A state leaf (tensor, DTensor, TensorShard, FlatShard, numpy array) filled with
    ``region``, the region of the saved tensor it holds; the type, shape, meta and dtype
    rules."""
    if region is None:
        if isinstance(value, torch.Tensor):
            return _Mismatch(f"{key}: the checkpoint holds a tensor, the state a "
                             f"{type(value).__name__}")
        return Leaf(key, source)  # a Python value (None, a number): replaced
    entry = source.head
    if region.shape != entry.shape:
        return _Mismatch(f"{key}: shape {region.shape} in the state, {entry.shape} in the "
                         "checkpoint", resized=True)
    dest, dtype = region.local, torch_dtype(entry.dtype)
    if dest.is_meta:
        return _Mismatch(f"{key}: the state's tensor is on the meta device, with no storage to "
                         "load into; materialise the model first (model.to_empty(device=...)) "
                         "or build it on a real device")
    if dest.is_inference():
        return _Mismatch(f"{key}: the state's tensor was made under torch.inference_mode() and "
                         "cannot be written by a load; build it outside inference_mode (or put "
                         "a clone made outside it in the state)")
    if dest.numel() > 1 and any(stride == 0 and size > 1
                                for stride, size in zip(dest.stride(), dest.shape)):
        return _Mismatch(f"{key}: the state's tensor is expanded (stride 0: several elements "
                         "share one memory location), so it cannot hold the saved values; put "
                         "t.clone() in the state instead")
    if dest.dtype == dtype or cast:
        return Leaf(key, source, region, cast=dest.dtype != dtype)
    return _Mismatch(f"{key}: dtype {dest.dtype} in the state, {dtype} in the checkpoint"
                     f"{CAST_HINT}", resized=True)


def _numpy_dest(value: object) -> torch.Tensor | None:
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray" and \
            value.flags.writeable:  # type: ignore[attr-defined]
        try:
            return torch.from_numpy(value)
        except TypeError:
            return None
    return None


def _created(m: Match, created: list[str]) -> None:
    """The keys a Stateful lacks (a fresh optimizer's state): read whole, inserted."""
    for key in created:
        source = m.sources.get(key)
        if source is not None:
            m.created.append(Leaf(key, source))


def _drop_resized(m: Match, flat: FlatState, created: list[str]) -> None:
    """strict=False: the optimizer state of a parameter left as it was (its saved shape or dtype
    differs) belongs to the saved values: left out too."""
    stale = param_check.resized_state(flat, m.resized)
    dropped = [k for k in (*m.common, *created) if stale(k)]
    for key in dropped:
        m.problems[key] = f"{key}: optimizer state of a parameter left as it was (left out)"
    m.leaves = [leaf for leaf in m.leaves if leaf.key not in dropped]
    m.created = [leaf for leaf in m.created if leaf.key not in dropped]


def _by_name(m: Match, chosen: Callable[[str], bool]) -> None:
    """A renamed optimizer's saved keys the mapping reads (by_name.Renamed.reads)."""
    for key in m.sources.keys():
        if chosen(key) and not is_marker(key) and any(r.reads(key) for r in m.renamed):
            source = m.sources.get(key)  # None: per-rank (check_refused says)
            if source is not None:
                m.by_name.append(Leaf(key, source))


def _absent(m: Match, strict: bool) -> None:
    """Per-rank keys the chosen saved rank did not save: refused if strict, else missing."""
    absent = m.sources.absent
    if absent and strict:
        raise StateMismatchError(
            f"keys {sorted(absent)[:10]} hold each saved rank's own value, and saved rank "
            f"{m.sources.source_rank} did not save them", fix="; choose another rank with "
            "per_rank_from=..., or pass strict=False (or keys=...) to leave them out")
    m.missing = (*m.missing, *absent)


def _mismatched(m: Match, strict: bool) -> None:
    """Keys in both that cannot load: refused if strict, else a warning."""
    if m.problems and strict:
        raise StateMismatchError(
            f"{len(m.problems)} key(s) do not match the checkpoint: "
            + "; ".join(list(m.problems.values())[:10]),
            fix=". Fix the state, or pass strict=False to load the rest and skip these")
    if m.problems:
        m.warnings.append(
            f"strict=False: {len(m.problems)} key(s) left as they were, their dtype or shape "
            "differs (or they hold a resized parameter's optimizer state, or another kind of "
            "optimizer's): "
            f"{'; '.join(list(m.problems.values())[:3])} (LoadReport.mismatched lists them all)")


def _check_keys(m: Match, flat: FlatState, strict: bool) -> None:
    """The strict key rule: missing or unexpected keys refused; else warned about where the
    cause is likely a mistake (a fresh optimizer's state, an empty container)."""
    missing, unexpected = m.missing, m.unexpected
    hint = _optimizer_hint(flat, unexpected)
    wrapped = "" if hint else (state_keys.wrapper_hint(missing, unexpected)  # no fix by
               or state_keys.prefix_hint(missing, unexpected))  # strict=False
    lists_hint = m.lists.hint()
    if strict and (missing or unexpected):
        differ = "; ".join(f"{what} {_some_keys(keys)}" for what, keys in (
            ("missing from the checkpoint", missing), ("not in the state", unexpected)) if keys)
        rest = "" if wrapped else (" Otherwise pass" if hint or lists_hint else " Pass") + (
            " strict=False to load the keys both have, or keys=... to choose which to load")
        raise StateMismatchError(f"state and checkpoint keys differ: {differ}.{hint}{wrapped}"
                                 f"{lists_hint}", fix=rest)
    if hint or wrapped:
        m.warnings.append(f"strict=False: {len(unexpected)} checkpoint keys not loaded."
                          f"{hint}{wrapped}")
    elif unexpected and not set(flat.leaves) - set(missing):
        fix = (f"the state's keys (e.g. {_some_keys(missing[:3])}) were renamed since the save?"
               if missing else "an empty container (a {} or defaultdict) is not filled in place:"
               " for new values load with no state (ckptio.load(path)) or build the state first")
        m.warnings.append(
            f"strict=False: the state holds none of the checkpoint's {len(unexpected)} keys "
            f"(e.g. {_some_keys(unexpected[:3])}), so nothing was loaded; {fix}")


def _optimizer_hint(flat: FlatState, unexpected: tuple[str, ...]) -> str:
    """A fix for the commonest cause of unexpected keys: a freshly built optimizer's empty
    per-parameter state, passed as opt.state_dict()."""
    for key in unexpected:
        prefix, _, rest = key.partition(".state.")
        if rest and f"{prefix}.param_groups.0.lr" in flat.leaves:
            return (f" Keys such as {key!r} are an optimizer's per-parameter state, which a "
                    "freshly built optimizer does not have until its first step: put the "
                    f"optimizer object itself in the state (e.g. {{{prefix.rsplit('.', 1)[-1]!r}: "
                    "opt}), and ckptio loads it through opt.load_state_dict, creating that "
                    "state.")
    return ""


def _some_keys(keys: tuple[str, ...]) -> str:
    """The first ten keys as a list, and how many more there are."""
    return f"{list(keys[:10])}{f' and {len(keys) - 10} more' if len(keys) > 10 else ''}"
