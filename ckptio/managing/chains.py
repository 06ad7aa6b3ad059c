"""Delta chains among a manager's steps: which committed step needs which base (Chains).

A delta step's entries reference a sibling full step, its base (docs/FORMAT.md version 4, the
manifest's ``bases`` field). Chains have depth 1: a base is self-contained. A step's link (its
bases and the bytes its own files hold) is read from its manifest once and kept, the two fields
alone (format.manifest.bases_and_bytes: no entry is validated, as a load does): a committed
manifest never changes (a step saved again is forgotten).
The bases of a step this process saved are told (``made``), so retention reads no manifest.

Retention's rule, for every tier and every root: a base is deleted only with or after its last
delta. ``closure()`` adds to the kept set the bases of every kept step; ``doomed()`` then
defers a dropped base whose delta is dropped in the same pass to the next pass, so the delta's
hiding is durable (the removal fsyncs the directory; an S3 marker is durable on return) before
its base is touched: a kill between the two never leaves a committed delta without its base.
The manager's close() runs that next pass (``deferred``): a closed manager leaves only what it
keeps.

A step whose manifest cannot be read: damaged (ManifestError, CorruptCheckpointError) or gone,
it needs no base (it cannot be loaded); unreadable for another reason (an object store away),
every older committed step is kept this pass (any could be its base), with a warning.

Owns: reading and caching links, the kept closure, the deferral, the words naming a delta's
base. Does not own: which steps the retention rules keep (retention.py), hiding and removing
(storage/steproot.py), deciding the base of a save (delta.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ckptio.errors import (
    CheckpointNotFoundError,
    CkptError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
)
from ckptio.format.manifest import MANIFEST_NAME, bases_and_bytes, bases_of
from ckptio.format.types import Manifest
from ckptio.managing import warn
from ckptio.storage.steproot import step_of
from ckptio.storage.store_contract import Store

__all__ = ["Chains", "Link", "link_of", "read_link"]

_GONE = (ManifestError, CorruptCheckpointError, IncompleteCheckpointError,
         CheckpointNotFoundError)


@dataclass(frozen=True)
class Link:
    """One committed step's place in a chain: the steps its entries reference (() for a full,
    self-contained step) and the bytes its own data and index files hold."""

    bases: tuple[int, ...]
    stored: int

    @property
    def is_delta(self) -> bool:
        return bool(self.bases)


def link_of(manifest: Manifest) -> Link:
    """The Link of a decoded manifest (base names not of the form ``step-N`` are not steps
    of a manager and are left out)."""
    return _link(bases_of(manifest), sum(f.nbytes for f in manifest.files))


def _link(bases: tuple[str, ...], stored: int) -> Link:
    steps = (step_of(name) for name in bases)
    return Link(tuple(sorted({s for s in steps if s is not None})), stored)


def read_link(store: Store) -> Link:
    """The Link of the step in ``store``, from its manifest's bases and files alone."""
    return _link(*bases_and_bytes(store.read_manifest(), store.path_of(MANIFEST_NAME)))


class Chains:
    """The links of one root's committed steps; ``read(step)`` returns the step's Link, read
    from its manifest (``read_link``), or raises a CkptError."""

    def __init__(self, read: Callable[[int], Link], where: str) -> None:
        self._read = read
        self._where = where
        self._known: dict[int, Link | None] = {}  # None: damaged or gone (needs no base)
        self._made: dict[int, tuple[int, ...]] = {}  # the bases of steps this process saved
        self.deferred = False  # the last doomed() kept a base back for one pass

    def link(self, step: int) -> Link | None:
        """``step``'s link; None if it is damaged or gone. Other CkptErrors are raised."""
        if step not in self._known:
            try:
                self._known[step] = self._read(step)
            except _GONE:
                self._known[step] = None
        return self._known[step]

    def forget(self, step: int) -> None:
        """``step`` was saved again (or removed): read its link anew when asked."""
        self._known.pop(step, None)
        self._made.pop(step, None)

    def made(self, step: int, bases: tuple[int, ...]) -> None:
        """This process committed ``step`` against ``bases``: retention needs not read its
        manifest (a delta that turned out to need no base keeps its base one pass longer)."""
        self._made[step] = bases

    def bases(self, step: int) -> tuple[int, ...] | None:
        """``step``'s bases; None if it is damaged or gone (link())."""
        if step in self._made:
            return self._made[step]
        link = self.link(step)
        return None if link is None else link.bases

    def closure(self, committed: list[int], keep: Iterable[int]) -> set[int]:
        """``keep`` plus the bases of every kept step (and, for a kept step whose manifest
        cannot be read now, every older committed step: module docstring)."""
        kept = set(keep)
        for step in sorted(kept):
            try:
                bases = self.bases(step)
            except CkptError as exc:
                warn(f"ckptio: retention of {self._where} keeps every step before {step}: its "
                     f"manifest cannot be read now, so its base is not known "
                     f"({type(exc).__name__}: {exc})", stacklevel=4)
                kept.update(s for s in committed if s < step)
                continue
            if bases is not None:
                kept.update(b for b in bases if b in committed)
        return kept

    def doomed(self, committed: list[int], keep: set[int]) -> list[int]:
        """The committed steps to drop now: those not kept, less a base whose delta is dropped
        in this same pass (dropped at the next pass, once the delta's hiding is durable)."""
        dropped = [s for s in committed if s not in keep]
        needed: set[int] = set()
        for step in dropped:
            try:
                bases = self.bases(step)
            except CkptError:
                needed.update(s for s in committed if s < step)
                continue
            if bases is not None:
                needed.update(bases)
        self.deferred = any(s in needed for s in dropped)
        return [s for s in dropped if s not in needed]

    def describe(self, step: int) -> str:
        """`` (a delta against step B)`` for a delta step whose link is known, else ''."""
        link = self._known.get(step)
        if link is None or not link.is_delta:
            return ""
        return f" (a delta against base step {', '.join(map(str, link.bases))})"
