"""One tier's background thread, one at a time: TierThread.

A tier runs its slow work behind the training: the retention's removal of the steps it hid,
and a memory tier's slots made ahead of the saves. Call order: TierSteps (managing/level.py)
starts each through run(), which first joins the one before; a retention pass, a save's
finish_removal and the manager's close() join() it. The training thread (prepare_slots) and
the drain's thread (the retention of a slower tier) both start them: a thread is published
started, under a lock, so that a join from the other thread never meets a thread not started
yet (a RuntimeError that once failed the drain's copy).

Owns: that one-at-a-time order and its lock. Does not own: what the threads do or when they
are started (managing/level.py), the removal itself (storage/steproot.py).
"""

from __future__ import annotations

import threading

__all__ = ["TierThread"]


class TierThread:
    """The background thread of one tier (module docstring)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the training and drain threads both use it

    def join(self) -> None:
        """Until the thread started last has ended (at once when there is none)."""
        with self._lock:
            if self._thread is not None:
                self._thread.join()
                self._thread = None

    def run(self, thread: threading.Thread) -> None:
        """Start ``thread`` as the tier's background thread, once the one before it ended."""
        with self._lock:
            if self._thread is not None:
                self._thread.join()
            self._thread = thread
            thread.start()
