"""A CheckpointManager's steps under a GCS prefix: GcsRoot (the ``gs://`` entry's step root),
storage/tree_root.py's MarkedTreeRoot over a GcsStore (its order of removal, safe at every
point, is described there).

Owns: GcsRoot's settings, what a failed removal asks of the bucket, when the run's lease is
taken. Does not own: the listing and removal (tree_root.py), one checkpoint's objects and its
commit (gcs_store.py), the lease object (gcs_lock.py).
"""

from __future__ import annotations

from ckptio.storage.gcs import gcs_lock
from ckptio.storage.gcs.gcs_client import GcsPath
from ckptio.storage.gcs.gcs_settings import GcsSettings
from ckptio.storage.gcs.gcs_store import GcsStore
from ckptio.storage.object_common import MARKER
from ckptio.storage.tree_root import MarkedTreeRoot

__all__ = ["MARKER", "GcsRoot"]


class GcsRoot(MarkedTreeRoot):
    """A bucket prefix of ``step-N/`` prefixes."""

    def __init__(self, location: str, settings: GcsSettings) -> None:
        super().__init__(GcsStore(location, settings), settings.endpoint(),
                         f"the bucket at {settings.endpoint()} (storage.objects.delete, "
                         "storage.objects.list)")
        self.settings = settings

    def lease(self, take_over: bool, *, create: bool) -> gcs_lock.GcsLock | None:
        """LeasedRoot: the run's lease (gcs_lock.take_run), taken at the manager's first save
        (``create``; a reader of a live run writes nothing there)."""
        if not create:
            return None
        return gcs_lock.take_run(GcsPath.parse(self.location), self.settings, take_over)
