"""Removing the files a new commit superseded, in the background, one removal at a time.

Deleting a multi-GB file takes ext4 a while (docs/PROBES.md, "Figures moved out of the code"),
which need not block the caller. A removal
lists the directory first; the next save into any directory waits only for that listing (its
new files must not be listed as superseded), never for the deleting.

Owns: the removal thread and its "listed" event. Does not own: which files are superseded or
how they are removed (storage/steps.py).
"""

from __future__ import annotations

import threading

from ckptio.storage import steps
from ckptio.storage.store_contract import Store

__all__ = ["Cleanup"]


class Cleanup:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._listed = threading.Event()  # the running removal has chosen what it removes
        self._listed.set()

    def start(self, store: Store, keep: list[str]) -> None:
        """Remove the files in ``store`` that neither ``keep`` nor the committed manifest names;
        returns once they are listed (before other ranks hear of the commit)."""
        self.finish()  # normally long finished: a save takes longer than a deletion
        listed = threading.Event()
        thread = threading.Thread(target=steps.remove_unreferenced,
                                  args=(store, set(keep), listed), name="ckptio-cleanup",
                                  daemon=True)
        try:
            thread.start()
        except BaseException:
            listed.set()  # nothing will list: later saves must not wait for it
            raise
        self._thread, self._listed = thread, listed
        listed.wait()

    def wait_listed(self) -> None:
        self._listed.wait()

    def finish(self) -> None:
        """Wait for the removal in progress, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
