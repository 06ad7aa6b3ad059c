"""The manifests this process committed last: what a drain copying one of them skips decoding.

    commits.listen()                                  # the manager, once it has a drain
    commits.remember(store.location, data, record)   # a save's commit, on the coordinator
    record = commits.known(store.location, data)     # the drain: None unless these very bytes
    commits.forget(store.location)                    # the drain: no copy of it is due any more

A save commits a Manifest it built and checked; the drain (managing/copy.py) reads the committed
bytes back moments later to copy the step to a slower tier. ``known`` gives the record only for
the exact bytes this process committed at that location (the save id is in them): a step
another process or job wrote, a restart, or a location committed over since is decoded in full.
A kept record is a few objects per leaf that would outlive the save into the collector's oldest
generation: nothing is kept until a drain listens, and the drain forgets a step once no copy of
it is due or running (tests/test_drain_decodes.py); one asked for later is decoded again.

Owns: the last few (location, bytes, record). Does not own: the commit (distributed/collective.py),
the copy's checks of the bytes (managing/copy.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ckptio.format.types import Manifest

__all__ = ["COMMITS_KEPT", "Commits"]

COMMITS_KEPT = 4  # locations remembered: the steps committed but not drained yet


class Commits:
    """The last ``COMMITS_KEPT`` manifests committed through one Checkpointer, by location."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the save thread remembers, the drain's asks
        self._kept: OrderedDict[str, tuple[bytes, Manifest]] = OrderedDict()
        self._listening = False

    def listen(self) -> None:
        """A drain will ask: remember the commits from now on."""
        self._listening = True

    def remember(self, location: str, data: bytes, record: Manifest) -> None:
        """``record`` was committed at ``location`` as ``data`` (kept once a drain listens)."""
        if not self._listening:
            return
        with self._lock:
            self._kept.pop(location, None)
            self._kept[location] = (data, record)
            while len(self._kept) > COMMITS_KEPT:
                self._kept.popitem(last=False)

    def known(self, location: str, data: bytes) -> Manifest | None:
        """The record committed here at ``location`` if its bytes were ``data``, else None."""
        with self._lock:
            kept = self._kept.get(location)
        return kept[1] if kept is not None and kept[0] == data else None

    def forget(self, location: str) -> None:
        """Nothing will ask for ``location``'s record any more: let it go."""
        with self._lock:
            self._kept.pop(location, None)
