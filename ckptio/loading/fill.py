"""A load's stages after the manifest is open: fresh objects, or the caller's own state.

    match     the state's keys with the checkpoint's, every key rule (matching.py) -> a Match
    plan      which stored bytes go into which destination (fill_plan.py) -> Reads
    check     the rules that wait for the agreed unexpected keys (matching.check_agreed) and
              the pickle opt-in: at once, or (many ranks) inside the read step, before any read
    read      the caller's ``read`` (read.py: coalesced, checksummed), then dtype conversions;
              then the rules' warnings, naming the caller's line
    put back  values into their containers, Statefuls' load_state_dict (merge.py), a renamed
              optimizer's state by name (by_name.py) -> the LoadReport

Owns: the order of the stages, the pickle opt-in before the reads, the LoadReport. Does not
own: any rule (matching.py), the stored side (stored.py), reading bytes.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.errors import CkptError, StateMismatchError
from ckptio.format.flatten import FlatState, unflatten
from ckptio.format.param_names import is_marker, without_names
from ckptio.format.types import Chunk, Manifest, ObjectEntry
from ckptio.loading import by_name, merge
from ckptio.loading.fill_plan import Plan, ReadFn, Reads, plan, whole
from ckptio.loading.matching import Match, Rules, check_agreed, match
from ckptio.loading.stored import (KeyFilter, RankPolicy, Sources, TensorSource, decode_object,
                                   named_nothing, refuse_pickles, selector, stored_value,
                                   typo_refusal)
from ckptio.loading.tree_nodes import empty_nodes

__all__ = ["LoadReport", "fill_fresh", "fill_in_place"]


@dataclass(frozen=True)
class LoadReport:
    """What an in-place load did. ``missing``: in the state, not in the checkpoint;
    ``unexpected``: in the checkpoint, not in the state; ``mismatched``: in both but not
    loadable (dtype, shape, type), one "key: why" line each. All three stay empty under
    strict=True, which raises instead."""

    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    nbytes_read: int
    mismatched: tuple[str, ...] = ()
    seconds: float = 0.0


def fill_fresh(record: Manifest, read: ReadFn, *, keys: KeyFilter, allow_pickle: bool,
               strict: bool = True, rank: int = 0, world_size: int = 1,
               per_rank_from: RankPolicy = None) -> Any:
    """Build the saved state as new CPU tensors and Python values (chunks saved by many ranks
    are assembled into whole tensors). A ``keys=`` name that selects no key is refused if
    ``strict`` (a typo would load nothing and say nothing), else warned of."""
    select = selector(keys)
    sources = Sources(record, rank, world_size, per_rank_from)
    unknown = named_nothing(keys, (k for k in sources.keys() if not is_marker(k)),
                            empty_nodes(record.tree))
    if unknown and strict:
        raise StateMismatchError(typo_refusal(unknown, sources, "the checkpoint"))
    if unknown:
        warnings.warn(f"ckptio: strict=False: {typo_refusal(unknown, sources, 'the checkpoint')}",
                      stacklevel=4)
    found = {k: sources.get(k) for k in sources.keys() if select(k) and not is_marker(k)}
    sources.check_refused()
    reads = Reads()
    made: dict[int, torch.Tensor] = {}  # by id of the stored entry
    for source in found.values():
        if isinstance(source, TensorSource) and id(source.head) not in made:
            made[id(source.head)] = tensor = whole(source)
            reads.add(source, Chunk.whole(source.head.shape), tensor)
    refuse_pickles(reads.entries(), allow_pickle)
    reads.run(read)
    out: dict[str, Any] = {}
    for key, source in found.items():
        if isinstance(source, ObjectEntry):
            out[key] = decode_object(source)
        elif source is not None:
            out[key] = stored_value(source.head, made[id(source.head)])
    named = any(is_marker(k) for k in sources.keys())
    return unflatten(without_names(record.tree) if named else record.tree, out,
                     prune=keys is not None, selected=select)


def fill_in_place(record: Manifest, flat: FlatState, read: ReadFn, rules: Rules, *,
                  allow_pickle: bool) -> LoadReport:
    """Copy the checkpoint into the tensors of ``flat`` (each leaf gets the region of the saved
    tensor it holds, whatever layout saved it); put other values into their containers,
    rebuilding tuples; create the entries a Stateful lacks; call each Stateful's
    load_state_dict (the stages: module docstring). Every check that refuses the load runs
    before anything is read (with peers: inside the read step, once the keys are agreed)."""
    m = match(record, flat, rules)
    reads = plan(m)

    def check(agreed: tuple[str, ...]) -> None:
        check_agreed(m, flat, rules.strict, agreed)
        refuse_pickles(reads.entries(), allow_pickle)

    if rules.agree_unexpected is None:
        check(m.unexpected)
    else:  # at once, or (many ranks) in the read step, before its reads
        rules.agree_unexpected(m.unexpected, check)
    nbytes = reads.run(read)
    if not m.checked:
        raise CkptError("internal: a load read before its keys were checked")
    for message in m.warnings:  # from here, naming the first line outside ckptio
        warnings.warn(message, stacklevel=_callers_level())
    _put_back(m, reads, record, flat)
    return LoadReport(m.loaded(), m.missing, m.unexpected, nbytes, tuple(m.problems.values()))


def _put_back(m: Match, reads: Plan, record: Manifest, flat: FlatState) -> None:
    """The values read into the state's containers and Statefuls; a renamed optimizer's state
    by name, with its warning."""
    replaced = reads.values(m.leaves)
    made = reads.values(m.created)
    saved_by_name = reads.values(m.by_name)
    merge.put_back(flat, record.tree, replaced, made, m.lists.whole)
    for r in m.renamed:
        warnings.warn("strict=False: the model's parameters changed since the save: "
                      + r.summary(by_name.load_into(r, record.tree, saved_by_name)),
                      stacklevel=_callers_level())


def _callers_level() -> int:
    """The ``stacklevel`` that makes a warning raised by the function calling this name the
    first line outside ckptio: the user's, whether it called ckptio.load or a manager's
    restore (fixed levels named a ckptio module on the longer paths)."""
    here = inspect.currentframe()
    frame, level = (None if here is None else here.f_back), 1
    while frame is not None and frame.f_back is not None \
            and frame.f_globals.get("__name__", "").split(".")[0] == "ckptio":
        frame, level = frame.f_back, level + 1
    return level
