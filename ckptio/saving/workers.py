"""The long-lived threads one Checkpointer's saves run on, so that a save starts none.

``calls(name)`` is the Calls (io/worker.py: a queue on the one background-thread class,
Worker) of that name, made on first use: ``ckptio-save`` runs each save's steps after its
call (save_session._run), ``ckptio-hash`` its checksums and the writes they hand to the
backend (persist.SaveJob), ``ckptio-cleanup`` the removal of superseded files (cleanup.py).
Saves run one at a time per Checkpointer (its resources' lock), so one thread of each kind
serves them in order.

Owns: making them on first use, making them again in a forked child (a fork copies no
thread), closing them (``close()`` joins them; a later save makes them again) and ending
them once the owner is collected without close(). Does not own: what runs on them, or the
outcome of a call (its Future, read by whoever waits for it).
"""

from __future__ import annotations

import os
import threading
import weakref

from ckptio.io.worker import Calls

__all__ = ["SaveWorkers"]


class SaveWorkers:
    """One Checkpointer's save threads, by name (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, Calls] = {}
        self._pid = os.getpid()
        weakref.finalize(self, _end, self._calls)  # collected without close(): threads end

    def calls(self, name: str) -> Calls:
        """The Calls named ``name`` (its thread starts with its first call)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's threads are not here
                self._calls.clear()
                self._pid = os.getpid()
            found = self._calls.get(name)
            if found is None:
                found = self._calls[name] = Calls(name)
            return found

    def close(self) -> None:
        """Every queued call runs, then the threads are joined; a later calls() makes anew."""
        with self._lock:
            calls = list(self._calls.values())
            self._calls.clear()
        for each in calls:
            each.close()


def _end(calls: dict[str, Calls]) -> None:
    """The finalizer of a SaveWorkers collected without close(): its threads end once their
    queued calls ran (none joined: this may run on any thread, theirs included)."""
    for each in list(calls.values()):
        each.close(wait=False)
