"""Removing the files a new commit superseded, in the background, one removal at a time.

Deleting a multi-GB file takes ext4 a while (docs/PROBES.md, "Figures moved out of the code"),
which need not block the caller. A removal
lists the directory first; the next save into any directory waits only for that listing (its
new files must not be listed as superseded), never for the deleting.

Owns: the removal in progress (run on the owner's ``ckptio-cleanup`` thread, workers.py) and its
"listed" event. Does not own: which files are superseded or how they are removed
(storage/steps.py), the thread.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from ckptio.saving.workers import SaveWorkers
from ckptio.storage import steps
from ckptio.storage.store_contract import Store

__all__ = ["Cleanup"]

log = logging.getLogger("ckptio")


class Cleanup:
    def __init__(self, workers: SaveWorkers) -> None:
        self._workers = workers
        self._removal: Future[list[str]] | None = None
        self._listed = threading.Event()  # the running removal has chosen what it removes
        self._listed.set()

    def start(self, store: Store, keep: list[str]) -> None:
        """Remove the files in ``store`` that neither ``keep`` nor the committed manifest names;
        returns once they are listed (before other ranks hear of the commit)."""
        self.finish()  # normally long finished: a save takes longer than a deletion
        listed = threading.Event()
        try:
            removal = self._workers.calls("ckptio-cleanup").submit(
                steps.remove_unreferenced, store, set(keep), listed)
        except BaseException:
            listed.set()  # nothing will list: later saves must not wait for it
            raise
        self._removal, self._listed = removal, listed
        listed.wait()

    def wait_listed(self) -> None:
        self._listed.wait()

    def finish(self) -> None:
        """Wait for the removal in progress, if any (its failures are logged, never raised:
        the checkpoint is committed whole; the next save removes what is left)."""
        removal, self._removal = self._removal, None
        if removal is not None and (error := removal.exception()) is not None:
            log.warning("ckptio: removing superseded files failed: %s: %s",
                        type(error).__name__, error)
