"""A CheckpointManager's steps under a GCS prefix: GcsRoot (the ``gs://`` entry's step root),
storage/tree_root.py's MarkedTreeRoot over a GcsStore (its order of removal, safe at every
point, is described there).

Owns: GcsRoot's settings and what a failed removal asks of the bucket. Does not own: the
listing and removal (tree_root.py), one checkpoint's objects and its commit (gcs_store.py).
"""

from __future__ import annotations

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
