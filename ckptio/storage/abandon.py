"""Whether the save this thread claims a location for was abandoned by its caller (Ctrl-C).

A store's exclusive() may wait for another save's lock (``if_locked="wait"``): a local
directory's flock (storage/local/dirlock.py), an object store's lock object
(object_common.LockWait). An exit waits for the saves in flight, so a save whose caller was
interrupted must stop waiting, or the process cannot exit while the other save holds the lock.

Call order: the save session enters ``abandoned_when(control.abandoned)`` around its claim
(saving/save_session.py); a lock's wait asks ``abandoned()`` between its tries. Owns: the
thread-local predicate. Does not own: the waits themselves or what a caller's interrupt does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["abandoned", "abandoned_when"]

_waits = threading.local()  # .abandoned: this thread's save's predicate (or None)


@contextlib.contextmanager
def abandoned_when(predicate: Callable[[], bool]) -> Iterator[None]:
    """Inside, ``abandoned()`` on this thread answers ``predicate()``."""
    outer = getattr(_waits, "abandoned", None)
    _waits.abandoned = predicate
    try:
        yield
    finally:
        _waits.abandoned = outer


def abandoned() -> bool:
    """Whether the caller of the save this thread claims for has abandoned it (False outside
    a save's claim)."""
    predicate = getattr(_waits, "abandoned", None)
    return predicate is not None and predicate()
