"""The one restore loop of a CheckpointManager, whatever its tiers: newest step first, fastest
tier first, falling back on damage, with one warning naming every copy passed over.

Call order: the manager lists its tiers (rank 0, agreed by every rank: a list of listings,
fastest tier first), then calls ``restore_first``. With redundancy, managing/agreed.py agrees on
a step across ranks first and calls ``restore_first`` for that one step.

- Candidates: every step committed in some tier, newest first; each tried in the tiers holding
  it, fastest first. A step held only incomplete (an interrupted save or copy, or one running)
  and newer than the one restored is named in the warning, with what its save lock says of
  that save (running, ended, or on another host) where its store can tell (the newest
  LOCKS_ASKED such steps: a lock look-up each); one holding a torch_checkpointing
  checkpoint is named as that, with its load or convert.
- A load that finds damage (agreement.DAMAGE, on any rank) marks that copy damaged and passes on;
  so does a storage error where a slower tier holds the same step (that copy is unreadable, the
  other is at hand); any other error is raised at once (a StateMismatchError is the caller's
  bug; a storage error on the last copy of a step: not damage, so no older step is tried).
- Nothing committed anywhere: None when every tier was listed and holds nothing else (a warning
  names incomplete steps); CheckpointNotFoundError saying what a location holds otherwise (a
  torch_checkpointing checkpoint in a step's directory among them: its load or convert named).
- Every copy damaged: CorruptCheckpointError naming each and why.

Owns: that order and its messages. Does not own: listing (storage/steproot.py), loading (level.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CheckpointNotFoundError, CkptError, CorruptCheckpointError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.managing import warn
from ckptio.managing.level import TierSteps
from ckptio.storage import missing_manifest
from ckptio.storage.select import root_for
from ckptio.storage.steproot import is_empty
from ckptio.storage.store_contract import TellsInFlight

LOCKS_ASKED = 4  # the newest incomplete steps whose save lock a restore's warning reads

__all__ = ["Restored", "candidates", "emptiness", "first_only", "fresh_start_refused_by",
           "incomplete", "neighbours", "nothing_to_restore", "restore_first", "started_fresh",
           "where"]

Listing = dict[str, list[Any]]
log = logging.getLogger("ckptio")


@dataclass(frozen=True)
class Restored:
    """Where a restore loaded from: the step, the tier's index and location, the seconds."""

    step: int
    tier: int
    location: str
    seconds: float

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "tier": self.tier, "location": self.location,
                "seconds": self.seconds}


def candidates(listings: Sequence[Listing], step: int | None) -> list[tuple[int, list[int]]]:
    """(step, the tiers holding it committed, fastest first), newest step first; only ``step``
    when given."""
    committed = sorted({s for x in listings for s in x["committed"]}, reverse=True)
    if step is not None:
        committed = [s for s in committed if s == step]
    return [(s, [k for k, x in enumerate(listings) if s in x["committed"]]) for s in committed]


def incomplete(listings: Sequence[Listing]) -> list[int]:
    """Steps some tier holds incomplete and no tier holds committed, ascending."""
    committed = {s for x in listings for s in x["committed"]}
    return sorted({s for x in listings for s in x["incomplete"]} - committed)


def where(levels: Sequence[TierSteps]) -> str:
    """The manager's location for messages: its directory (a memory tier's as declared,
    shm://NAME), or its tiers as declared."""
    if len(levels) == 1:
        given = levels[0].location
        return given if "://" in given else levels[0].directory
    return "the tiers " + ", ".join(level.location for level in levels)


def restore_first(levels: Sequence[TierSteps], listings: Sequence[Listing], state: Any,
                  step: int | None, load_kwargs: dict[str, Any], stacklevel: int = 3) -> Restored:
    """Collective: load the newest loadable copy (of ``step`` only, when given) into
    ``state`` (module docstring). Raises CheckpointNotFoundError when no tier holds a
    committed candidate, CorruptCheckpointError when every one is damaged."""
    found = candidates(listings, step)
    if not found:
        raise CheckpointNotFoundError(_nothing(levels, listings, step))
    newer = incomplete(listings)
    foreign = _foreign_paths(levels, listings) if newer else {}
    passed: list[str] = []
    asked = set(sorted(newer)[-LOCKS_ASKED:])  # a run of many left over: a look-up each, not all
    for candidate, holders in found:
        passed += [_passed_over(s, foreign.get(s),
                                _lock_says(levels, listings, s) if s in asked else "")
                   for s in reversed(newer) if s > candidate]
        newer = [s for s in newer if s < candidate]
        for k in holders:
            level, started = levels[k], time.perf_counter()
            kwargs = first_only(load_kwargs, (candidate, k) == (found[0][0], 0))
            # a copy that cannot be read (a storage error): the same step from the next tier
            why = level.try_load(candidate, state, kwargs, unreadable=k != holders[-1])
            if why is None:
                level.succeeded(candidate)
                if passed:
                    warn(f"ckptio: restored step {candidate} from {_name(levels, k)}, not a newer "
                         f"one: {'; '.join(passed)}. Those copies are left in place; a later "
                         "save of the same step replaces one", stacklevel=stacklevel)
                return Restored(candidate, k, level.location, time.perf_counter() - started)
            tier = "" if len(levels) == 1 else f" in {level.location}"
            passed.append(f"step {candidate}{level.describe(candidate)}{tier}: {why}")
            level.mark_damaged(candidate)
    what = "step" if step is None else f"copy of step {step}"
    raise CorruptCheckpointError(
        f"no {what} in {where(levels)} could be restored: {'; '.join(passed)}. The copies are "
        "left as they are; restore(state, step=N) loads one step. The state filled in place "
        "may hold tensors of a copy read before its damage was found: build it afresh before "
        "training from it (starting fresh included)")


def first_only(load_kwargs: dict[str, Any], first: bool) -> dict[str, Any]:
    """``load_kwargs`` for one copy: a ``record`` (the manifest of the first tier's copy of the
    step tried first, read by the caller just before) only for that copy, which is then not
    read again; any other copy, a fallback, reads its own."""
    if first or "record" not in load_kwargs:
        return load_kwargs
    return {key: value for key, value in load_kwargs.items() if key != "record"}


def emptiness(levels: Sequence[TierSteps], listings: Sequence[Listing]) -> str | None:
    """Rank 0, nothing committed in any tier: None when every tier holds nothing else (only
    incomplete steps, or nothing), else what a location holds instead (nothing_to_restore)."""
    whys = []
    for level, listing in zip(levels, listings):
        if listing.get("unreachable"):
            whys.append(f"{level.location} cannot be listed: {listing['unreachable'][0]}")
            continue
        why = _foreign(level, listing, alone=len(levels) == 1) or level.nothing_here()
        if not is_empty(why):
            whys.append(str(why))
    if not whys:
        return None
    return whys[0] if len(levels) == 1 else f"{_nothing(levels, listings, None)}: {'; '.join(whys)}"


def _foreign_paths(levels: Sequence[TierSteps], listings: Sequence[Listing]) -> dict[int, str]:
    """The incomplete steps holding a torch_checkpointing checkpoint -> its path (the fastest
    tier's)."""
    found: dict[int, str] = {}
    for level, listing in reversed(list(zip(levels, listings))):
        for step in level.foreign(listing.get("incomplete", []), listed=True):
            found[step] = level.path(step)
    return found


def _lock_says(levels: Sequence[TierSteps], listings: Sequence[Listing], step: int) -> str:
    """What the save lock of the incomplete ``step`` says of its save, in the fastest tier
    holding it incomplete, where its store can tell (store_contract.TellsInFlight); "" else."""
    for level, listing in zip(levels, listings):
        if step not in listing.get("incomplete", []):
            continue
        store = level.store(step)
        try:
            saving, ended, elsewhere = (store.in_flight() if isinstance(store, TellsInFlight)
                                        else (None, None, None))
        except CkptError:
            return ""
        if saving is not None:
            return f"a save into it ({saving}) is still running"
        if ended is not None:
            return f"a save interrupted before its commit ({ended})"
        if elsewhere is not None:
            return (f"files of {elsewhere}; whether that save still runs cannot be told from "
                    "this host")
        return ""
    return ""


def _passed_over(step: int, tc_path: str | None, lock: str = "") -> str:
    """Why the newer incomplete ``step`` was not restored (``tc_path``: where it holds a
    torch_checkpointing checkpoint; ``lock``: what its save lock says, _lock_says)."""
    if tc_path is None:
        return (f"step {step}: incomplete: no committed {MANIFEST_NAME}: {lock}" if lock else
                f"step {step}: incomplete: no committed {MANIFEST_NAME} (an interrupted save or "
                "copy, or one running)")
    return (f"step {step}: {tc_path} holds a torch_checkpointing checkpoint, not a ckptio save "
            f"(no {MANIFEST_NAME}), which a manager does not restore; to resume from it, load "
            f"it with ckptio.load({tc_path!r}, state), or convert it once (python -m ckptio "
            f"convert {tc_path} NEWRUN/{os.path.basename(tc_path)}) and restore from there")


def _foreign(level: TierSteps, listing: Listing, *, alone: bool) -> str | None:
    """The newest incomplete step of ``level`` holding a torch_checkpointing checkpoint (its
    ``<item>_<rank>.pt`` files, no ckptio manifest), said as why there is nothing to restore:
    a run moving to ckptio points its manager at that run's directory, where starting fresh
    would silently drop the steps it trained. ``alone``: the manager's only tier, where
    restore(state, step=N) loads it in place."""
    newest = level.foreign(listing.get("incomplete", []), listed=True)[-1:]
    if not newest:
        return None
    step, path = newest[0], level.path(newest[0])
    return (f"{path} holds a torch_checkpointing checkpoint, not a ckptio save (no "
            f"{MANIFEST_NAME}), so this manager counts step {step} as an incomplete save and "
            f"has no step to restore; load it with ckptio.load({path!r}, state), or convert it "
            f"once into a new run directory (python -m ckptio convert {path} "
            f"NEWRUN/{os.path.basename(path)}) and restore from there"
            + (f"; or resume from it here with restore(state, step={step}) (the saves after it "
               "go to new steps beside it)" if alone else ""))


def nothing_to_restore(levels: Sequence[TierSteps], listings: Sequence[Listing],
                       why: str | None, stacklevel: int = 3) -> None:
    """Nothing committed in any tier (``why``: emptiness()): CheckpointNotFoundError saying
    what a location holds, or None with a warning naming the incomplete steps."""
    if why is not None:
        raise CheckpointNotFoundError(why)
    left = incomplete(listings)
    if left:
        warn(f"ckptio: nothing to restore in {where(levels)}: no step was ever committed "
             f"there; incomplete steps {left} (interrupted saves) are left as they are, a save "
             "of the same step replaces one", stacklevel=stacklevel)


# what a fresh start's log line and warning name as the call that refuses it instead (None:
# nothing, for an integration whose user makes no restore() call: fresh_start_refused_by)
_REFUSED_BY: ContextVar[str | None] = ContextVar("ckptio_fresh_start_refused_by",
                                                 default="restore(state, required=True)")


@contextlib.contextmanager
def fresh_start_refused_by(call: str | None) -> Iterator[None]:
    """Inside, a fresh start's log line and warning name ``call`` (or nothing) as the way to
    refuse it, not ``restore(state, required=True)``, which the integration's user cannot pass."""
    token = _REFUSED_BY.set(call)
    try:
        yield
    finally:
        _REFUSED_BY.reset(token)


def started_fresh(levels: Sequence[TierSteps], required: bool, coordinator: bool,
                  stacklevel: int = 3) -> None:
    """restore() found no step anywhere: CheckpointNotFoundError when ``required``, else one
    log line on rank 0 saying so (a mistyped directory then shows at once, not as a run that
    silently began again at step 0); and where a directory spelled alike holds committed steps
    (``neighbours``), a warning on rank 0 naming it and its newest step (a first run stays a
    warning: the quick start restores into a new directory)."""
    what = (f"nothing to restore in {where(levels)}: no step was ever committed there")
    found = neighbours(levels) if required or coordinator else []
    near = "; ".join(f"did you mean {path}? It holds committed steps (the newest: step {newest})"
                     for path, newest in found)
    if required:
        raise CheckpointNotFoundError(
            f"restore(state, required=True): {what}{'; ' + near if near else ''}. Check the "
            "directory (a typo names a new, empty one); leave required out for a first run")
    call = _REFUSED_BY.get()
    if coordinator:
        log.warning("ckptio: %s; starting fresh%s", what,
                    f" ({call} raises instead)" if call else "")
    if near:
        warn(f"ckptio: {what}, so this run starts fresh; {near}."
             + (f" {call} raises instead of starting fresh" if call else ""),
             stacklevel=stacklevel)


def neighbours(levels: Sequence[TierSteps]) -> list[tuple[str, int]]:
    """For each local tier, the directories beside it spelled alike (missing_manifest's "did
    you mean") that hold committed steps, with the newest. A name that differs only in its
    digits (run2 beside run1) is another run of a series, not a typo; object stores are not
    listed."""
    found = []
    for level in levels:
        if "://" in level.directory:
            continue
        parent, name = os.path.split(os.path.normpath(level.directory))
        try:
            siblings = [n for n in os.listdir(parent or ".") if n != name
                        and os.path.isdir(os.path.join(parent, n))
                        and _digitless(n) != _digitless(name)]
        except OSError:
            continue
        for sibling in missing_manifest.spelled_alike(name, siblings):
            path = os.path.join(parent, sibling)
            try:
                committed = root_for(path, level.options).scan()["committed"]
            except CkptError:
                continue
            if committed:
                found.append((_as_given(level, name, sibling, path), max(committed)))
    return found


def _as_given(level: TierSteps, name: str, sibling: str, path: str) -> str:
    """``sibling`` of tier ``level`` (named ``name``) as the user would write it: a memory
    tier's as ``shm://<sibling>``, not the directory it is kept in."""
    given = level.location
    if given != level.directory and "://" in given and given.endswith(name):
        return given[: len(given) - len(name)] + sibling
    return path


def _digitless(name: str) -> str:
    return re.sub(r"\d+", "#", name)


def _name(levels: Sequence[TierSteps], k: int) -> str:
    return where(levels) if len(levels) == 1 else levels[k].location


def _nothing(levels: Sequence[TierSteps], listings: Sequence[Listing], step: int | None) -> str:
    held = "; ".join(f"{_name(levels, k)}: committed {x['committed'] or 'none'}, incomplete "
                     f"{x['incomplete'] or 'none'}" for k, x in enumerate(listings))
    what = "no committed step" if step is None else f"step {step} is committed nowhere"
    return f"{what} in {where(levels)} to restore ({held})"
