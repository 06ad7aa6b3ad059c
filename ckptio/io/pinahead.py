"""Pinning a load's first staging buffers ahead, on a thread of its own, while the load plans.

A load's backend pins the pool part by part, each buffer at its first read (resources.py); in
the thread that submits the reads that put a buffer's fault-in and pinning between one read and
the next, so a rank's first ``io_depth`` reads left one by one (docs/BENCH_RESTART.md).
``PinAhead`` pins the first buffers a load will take (the pool hands out the free buffer of
lowest index first) before its reads: the read step waits for the first ``io_depth`` of them
(those it needs), most of which are pinned by then, and its first reads go out back to back.

Owns: the thread and the order of the pins. Does not own: which buffers or how many
(resources.py, loading/load_session.py), what pinning is (the backend's ``pin_part``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["PinAhead"]


class PinAhead:
    """Calls ``pin(i)`` for i in 0..count-1 on its own thread, in order. ``pin`` reports a
    refusal by its result, never raises one (that buffer is then read unpinned, as before)."""

    def __init__(self, pin: Callable[[int], bool], count: int) -> None:
        self.count = count
        self._pin = pin
        self._cond = threading.Condition()
        self._done = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ckptio-pin-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for index in range(self.count):
                with self._cond:
                    if self._stopped:
                        return
                self._pin(index)
                with self._cond:
                    self._done = index + 1
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._stopped = True  # an early end never leaves a reader waiting
                self._cond.notify_all()

    @property
    def done(self) -> int:
        """The buffers pinned (or refused) so far."""
        return self._done

    def wait_for(self, nbuffers: int) -> None:
        """Return once the first ``nbuffers`` buffers (of ``count``) are pinned, or the thread
        ended."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopped or self._done >= min(nbuffers, self.count))

    def join(self) -> None:
        """Stop after the pin under way and wait for the thread (before the backend stops)."""
        with self._cond:
            self._stopped = True
        self._thread.join()
