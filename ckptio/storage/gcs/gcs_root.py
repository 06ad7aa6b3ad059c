"""A CheckpointManager's steps under a GCS prefix: GcsRoot (the ``gs://`` entry's step root).

Steps are the sub-prefixes ``<root>/step-N/`` of a delimited listing; a step is committed when
``step-N/manifest.json`` exists, incomplete when it holds other objects only. GCS has no
rename, so a retention removes a step in an order that is safe at every point (as s3/root.py does):

1. write the marker ``step-N/.deleting`` (only on a committed step): from then on the prefix is
   left out of every listing, so a kill leaves no half-deleted step listed;
2. delete the manifest: the step is no longer committed, whatever reads it directly;
3. on the manager's removal thread: delete the manifest again (a kill between 1 and 2), every
   object under ``step-N/``; check nothing but the marker is left; delete the marker last.

A marker left by a kill is found by the next scan, its removal finished by the next retention;
a save into step N first finishes a removal pending there. Incomplete steps are never deleted.

Owns: GcsRoot. Does not own: which steps to keep (the manager), one checkpoint's objects and
its commit (gcs_store.py), the client and retries (gcs_client.py).
"""

from __future__ import annotations

import logging

from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.storage.gcs.gcs_store import GcsStore
from ckptio.storage.object_common import MARKER, MARKER_BODY, MarkedSteps
from ckptio.storage.steproot import (
    Listing,
    Nothing,
    Removal,
    nothing_message,
    step_name,
    step_of,
)

__all__ = ["MARKER", "GcsRoot"]

log = logging.getLogger("ckptio")
_NAMES_PROBED = 20  # nothing_here(): prefixes checked for a manifest


class GcsRoot:
    """A prefix of ``step-N/`` prefixes (see the module docstring)."""

    def __init__(self, location: str, settings: GcsSettings) -> None:
        self.store = GcsStore(location, settings)
        self.location = self.store.location
        self.settings = settings
        self._marked = MarkedSteps(  # marked steps seen, not yet handed to a removal
            self.path, self._finish, lambda step: MARKER in self._step(step).sizes([MARKER]),
            lambda: f"the bucket at {self.settings.endpoint()} (storage.objects.delete, "
                    "storage.objects.list)")

    def __repr__(self) -> str:
        return f"GcsRoot({self.location!r})"

    def path(self, step: int) -> str:
        return self.store.child(step_name(step)).location

    def _step(self, step: int) -> GcsStore:
        return self.store.child(step_name(step))

    def _state(self, step: int) -> str:
        """"marked", "committed", "incomplete" or "empty"."""
        names = {k.rsplit("/", 1)[-1] for k in self._step(step).keys()}
        if MARKER in names:
            return "marked"
        if MANIFEST_NAME in names:
            return "committed"
        return "incomplete" if names else "empty"

    def scan(self) -> Listing:
        steps = sorted({s for s in map(step_of, self.store.entries()) if s is not None})
        states = {s: self._state(s) for s in steps}
        self._marked.add(s for s, state in states.items() if state == "marked")
        return {kind: [s for s in steps if states[s] == kind]
                for kind in ("committed", "incomplete")}

    def is_committed(self, step: int) -> bool:
        return MANIFEST_NAME in self._step(step).sizes([MANIFEST_NAME])

    def marked(self) -> list[int]:
        """The steps scan() found marked for removal and not yet handed to a removal."""
        return self._marked.sorted()

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
        """Delete the manifest, then every object under the marked step, then the marker."""
        store = self._step(step)
        problems = store.remove([MANIFEST_NAME])
        if problems:
            return problems
        marker = store.where.child(MARKER).key
        cut = len(store.where.dir_prefix)
        for key in store.keys():
            if key != marker:
                problems += store.delete_key(key, key[cut:])
        if problems:
            return problems
        left = [k for k in store.keys() if k != marker]
        if left:
            return [f"{len(left)} objects appeared under {store.location} while it was removed "
                    f"(another writer there?), e.g. {left[0]}"]
        return store.remove([MARKER])

    # -- what is here instead ---------------------------------------------------------------

    def nothing_here(self) -> str:
        entries = self.store.entries()
        if not entries:
            return Nothing(f"no checkpoint to restore: nothing is stored under {self.location} "
                           f"at {self.settings.endpoint()} (nothing saved there yet)", empty=True)
        names = set(entries)
        objects = set(self.store.objects())
        prefixes = sorted(names - objects)
        probed = prefixes[:_NAMES_PROBED]
        checkpoints = [p for p in probed
                       if MANIFEST_NAME in self.store.child(p).sizes([MANIFEST_NAME])]
        return nothing_message(self.location, sorted(names), itself=MANIFEST_NAME in objects,
                               checkpoints=checkpoints, noun="prefix",
                               move="copy them under step-<N>/")
