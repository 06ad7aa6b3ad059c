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

import functools
import logging

from ckptio.errors import CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.storage.gcs.gcs_store import GcsStore
from ckptio.storage.steproot import (
    Listing,
    Nothing,
    Removal,
    nothing_message,
    step_name,
    step_of,
    warn,
)

__all__ = ["MARKER", "GcsRoot"]

log = logging.getLogger("ckptio")
MARKER = ".deleting"
_MARKER_BODY = b"ckptio: this step is being removed by a CheckpointManager retention\n"
_NAMES_PROBED = 20  # nothing_here(): prefixes checked for a manifest


class GcsRoot:
    """A prefix of ``step-N/`` prefixes (see the module docstring)."""

    def __init__(self, location: str, settings: GcsSettings) -> None:
        self.store = GcsStore(location, settings)
        self.location = self.store.location
        self.settings = settings
        self._marked: set[int] = set()  # marked steps seen, not yet handed to a removal

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
        self._marked.update(s for s, state in states.items() if state == "marked")
        return {kind: [s for s in steps if states[s] == kind]
                for kind in ("committed", "incomplete")}

    def is_committed(self, step: int) -> bool:
        return MANIFEST_NAME in self._step(step).sizes([MANIFEST_NAME])

    def marked(self) -> list[int]:
        """The steps scan() found marked for removal and not yet handed to a removal."""
        return sorted(self._marked)

    # -- removal ----------------------------------------------------------------------------

    def hide(self, step: int) -> bool:
        """Mark the step, then delete its manifest; False (and a warning) if it holds no
        committed manifest or the marker could not be written: the step is then kept whole."""
        url, store = self.path(step), self._step(step)
        try:
            if not self.is_committed(step):
                warn(f"ckptio: retention could not remove {url}: it holds no committed "
                     "checkpoint (removed already?)")
                return False
            store.write_file(MARKER, _MARKER_BODY)
        except CkptError as exc:
            warn(f"ckptio: retention could not remove {url} ({exc}); it is kept and tried "
                 "again after the next save")
            return False
        self._marked.add(step)
        problems = store.remove([MANIFEST_NAME])
        if problems:  # hidden all the same: the removal deletes the manifest first
            log.warning("ckptio: could not delete the manifest of %s yet (%s); the step is out "
                        "of the listing and its removal tries again", url, "; ".join(problems))
        return True

    def removal(self, step: int | None = None) -> Removal | None:
        """``step=None``: finishing every marked step the last scan() or hide() saw (failures
        logged). ``step=N``: finishing N's removal if one is pending, raising if it cannot."""
        if step is None:
            todo, self._marked = sorted(self._marked), set()
            return functools.partial(self._finish_quietly, todo) if todo else None
        self._marked.discard(step)
        if not self._step(step).sizes([MARKER]):
            return None
        return functools.partial(self._finish_now, step)

    def _finish_quietly(self, steps: list[int]) -> None:
        for step in steps:
            try:
                problems = self._finish(step)
            except CkptError as exc:
                problems = [str(exc)]
            if problems:
                log.warning("ckptio: could not finish removing %s (an old step, already out of "
                            "the listing): %s; the next retention tries again", self.path(step),
                            "; ".join(problems[:5]))

    def _finish_now(self, step: int) -> None:
        problems = self._finish(step)
        if problems:
            url = self.path(step)
            raise StorageIOError(
                f"cannot save into {url}: the removal of the old step there (marked by "
                f"{url}/{MARKER}, out of the listing) could not be finished: "
                f"{'; '.join(problems[:5])}. Nothing was saved; check the access to the bucket "
                f"at {self.settings.endpoint()} (storage.objects.delete, storage.objects.list) "
                "and save again")

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
