"""A CheckpointManager's steps under an az:// prefix: AzureRoot (the ``az://`` entry's root),
storage/tree_root.py's MarkedTreeRoot over an AzureStore (its order of removal, safe at every
point, is described there).

Owns: AzureRoot's settings, what a failed removal asks of the container, when the run's
lease is taken. Does not own: the listing and removal (tree_root.py), one checkpoint's blobs
and its commit (az_store.py), the lease blob (az_lock.py).
"""

from __future__ import annotations

from ckptio.storage.azure import az_lock
from ckptio.storage.azure.az_client import AzPath
from ckptio.storage.azure.az_settings import AzureSettings
from ckptio.storage.azure.az_store import AzureStore
from ckptio.storage.object_common import MARKER
from ckptio.storage.tree_root import MarkedTreeRoot

__all__ = ["MARKER", "AzureRoot"]


class AzureRoot(MarkedTreeRoot):
    """A container prefix of ``step-N/`` prefixes."""

    def __init__(self, location: str, settings: AzureSettings) -> None:
        super().__init__(AzureStore(location, settings), settings.endpoint(),
                         f"the container at {settings.endpoint()} (Delete Blob, List Blobs)")
        self.settings = settings

    def lease(self, take_over: bool, *, create: bool) -> az_lock.AzureLock | None:
        """LeasedRoot: the run's lease (az_lock.take_run), taken at the manager's first save
        (``create``; a reader of a live run writes nothing there)."""
        if not create:
            return None
        return az_lock.take_run(AzPath.parse(self.location), self.settings, take_over)
