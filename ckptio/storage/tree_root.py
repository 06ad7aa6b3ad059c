"""A CheckpointManager's steps under an object-store prefix reached through its TreeStore:
MarkedTreeRoot, the step root of gs:// and az:// (storage/gcs/gcs_root.py, azure/az_root.py).

Steps are the sub-prefixes ``<root>/step-N/``; a step is committed when ``step-N/manifest.json``
exists, incomplete when it holds other objects only. Object stores have no rename, so a
retention removes a step in an order that is safe at every point (as s3/root.py does):

1. write the marker ``step-N/.deleting`` (only on a committed step): from then on the prefix is
   left out of every listing, so a kill leaves no half-deleted step listed;
2. delete the manifest: the step is no longer committed, whatever reads it directly;
3. on the manager's removal thread: delete the manifest again (a kill between 1 and 2), every
   object under ``step-N/``; check nothing but the marker is left; delete the marker last.

A marker left by a kill is found by the next scan, its removal finished by the next retention;
a save into step N first finishes a removal pending there (object_common.MarkedSteps).
Incomplete steps are never deleted.

Owns: the listing, the hide and the removal through an ObjectTreeStore (object_tree.py). Does
not own: the store's requests (its scheme's folder), which steps to keep (the manager).
"""

from __future__ import annotations

from ckptio.errors import CkptError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.object_common import (FOREIGN, MARKER, MARKER_BODY, MarkedSteps, held_state,
                                          kept_name)
from ckptio.storage.steproot import (
    Listing,
    Nothing,
    Removal,
    Usage,
    nothing_message,
    step_name,
    step_of,
)
from ckptio.storage.object_tree import ObjectTreeStore

__all__ = ["MarkedTreeRoot"]

_NAMES_PROBED = 20  # nothing_here(): prefixes checked for a manifest
_MANY_STEPS = 16  # scan(): more steps than this are told apart by one listing of the root
_KINDS = {"committed": ("committed",), "incomplete": ("incomplete", FOREIGN)}


class MarkedTreeRoot:
    """A prefix of ``step-N/`` prefixes under ``store`` (see the module docstring); ``endpoint``
    and ``access`` (what a failed removal asks the user to check) name the service. Not
    thread-safe, except that the removal it hands out may run on another thread."""

    def __init__(self, store: ObjectTreeStore, endpoint: str, access: str) -> None:
        self.store = store
        self.location = store.location
        self.endpoint = endpoint
        self._marked = MarkedSteps(  # marked steps seen, not yet handed to a removal
            self.path, self._finish, lambda step: MARKER in self._step(step).sizes([MARKER]),
            lambda: access)
        self._foreign: set[int] = set()  # the last scan's steps holding torch_checkpointing's

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    def path(self, step: int) -> str:
        return self._step(step).location

    def _step(self, step: int) -> ObjectTreeStore:
        return self.store.child(step_name(step))

    # -- listing ----------------------------------------------------------------------------

    def scan(self) -> Listing:
        """The step prefixes, committed and incomplete, ascending; marked ones left out (and
        remembered for the next removal()). Many steps are told apart by one listing of every
        object under the root (_listed_states), a few each by its own listing (_state)."""
        steps = sorted({s for s in map(step_of, self.store.entries()) if s is not None})
        if len(steps) > _MANY_STEPS:
            states = self._listed_states(steps)
        else:
            states = {step: self._state(step) for step in steps}
        self._marked.add(s for s, state in states.items() if state == "marked")
        self._foreign = {s for s, state in states.items() if state == FOREIGN}
        return {kind: [s for s in steps if states[s] in _KINDS[kind]]
                for kind in ("committed", "incomplete")}

    def foreign(self, incomplete: list[int]) -> list[int]:
        """ForeignRoot: those of ``incomplete`` the last scan() found holding a
        torch_checkpointing checkpoint, from the names it listed (no request here)."""
        return sorted(self._foreign.intersection(incomplete))

    def _state(self, step: int) -> str:
        """object_common.held_state of the step's names (an object named step-N: "empty")."""
        return held_state(map(kept_name, self._step(step).entries()))

    def _listed_states(self, steps: list[int]) -> dict[int, str]:
        """_state() of every one of ``steps`` from one listing of every object under the root
        (the service pages it: a page holds the objects of many steps)."""
        seen: dict[int, set[str]] = {step: set() for step in steps}
        for name in self.store.names_below():
            first, inside, rest = name.partition("/")
            step = step_of(first)
            if inside and step in seen:
                seen[step].add(kept_name(rest))
        return {step: held_state(names) for step, names in seen.items()}

    def is_committed(self, step: int) -> bool:
        return MANIFEST_NAME in self._step(step).sizes([MANIFEST_NAME])

    def marked(self) -> list[int]:
        """The steps scan() found marked for removal, not yet handed to a removal."""
        return self._marked.sorted()

    def being_deleted(self) -> list[tuple[int, str]]:
        """ListedRoot: the marked steps, each at its own prefix."""
        return [(step, self.path(step)) for step in self.marked()]

    def usage(self, where: str) -> Usage:
        """Bytes and objects under the step prefix ``where`` (``path(step)``); the TreeStore
        lists no modification times (None)."""
        name = where[len(self.location):].strip("/")
        if not where.startswith(self.location) or step_of(name) is None:
            raise CkptError(f"{where} is not a step of {self.location}")
        nbytes, files = _usage(self.store.child(name))
        return nbytes, files, None

    # -- removal ----------------------------------------------------------------------------

    def hide(self, step: int) -> bool:
        """object_common.MarkedSteps.hide: the marker written through the step's store."""
        held = self._step(step)
        return self._marked.hide(step, lambda: self.is_committed(step),
                                 lambda: held.write_file(MARKER, MARKER_BODY),
                                 lambda: held.remove([MANIFEST_NAME]))

    def removal(self, step: int | None = None) -> Removal | None:
        """object_common.MarkedSteps.removal: every marked step in the background, or step N's
        before a save into it."""
        return self._marked.removal(step)

    def _finish(self, step: int) -> list[str]:
        """Delete the manifest, everything else under the marked ``step``, then the marker
        -> the problems (the marker is kept if there are any)."""
        held = self._step(step)
        problems = held.remove([MANIFEST_NAME])
        if problems:
            return problems
        for name in held.entries():
            if name != MARKER:
                problems += held.child(name).remove_tree() + held.remove([name])
        if problems:
            return problems
        left = [n for n in held.entries() if n != MARKER]
        if left:
            return [f"{len(left)} objects appeared under {self.path(step)} while it was removed "
                    f"(another writer there?), e.g. {left[0]}"]
        return held.remove([MARKER])

    # -- what is here instead ---------------------------------------------------------------

    def nothing_here(self) -> str:
        """Why there is no step to restore, and what the prefix holds instead."""
        names = self.store.entries()
        if not names:
            return Nothing(f"no checkpoint to restore: nothing is stored under {self.location} "
                           f"at {self.endpoint} (nothing saved there yet)", empty=True)
        probed = names[:_NAMES_PROBED]
        checkpoints = [n for n in probed if n != MANIFEST_NAME and MANIFEST_NAME in
                       self.store.child(n).sizes([MANIFEST_NAME])]
        return nothing_message(self.location, names, itself=MANIFEST_NAME in names,
                               checkpoints=checkpoints, noun="prefix",
                               move="copy them under step-<N>/")


def _usage(store: ObjectTreeStore) -> tuple[int, int]:
    """Bytes and objects under ``store``: its files, then each sub-prefix's."""
    names = store.entries()
    sizes = store.sizes(names)
    nbytes, files = sum(sizes.values()), len(sizes)
    for name in names:
        if name not in sizes:
            below = _usage(store.child(name))
            nbytes, files = nbytes + below[0], files + below[1]
    return nbytes, files
