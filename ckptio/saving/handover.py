"""The eager capture, handed from the save's thread to the caller's.

An eager ``async_save`` returns once the state is copied into the staging pool. The copy must
start only after the save's thread holds the directory and has opened its files, yet it runs
on the caller's thread: torch's intra-op threads belong to that thread, and the same copy made
from another thread ran at less than half the speed here. So:

    save's thread:   handover.give(capture)   # waits until the caller has run it; re-raises
    caller's thread: handover.take()          # inside async_save: runs what it is given

Either side can end it early: ``close()`` (the save's thread failed before any capture: the
caller returns) and an interrupt of the caller (Ctrl-C while waiting or copying: the save's
thread gets a CkptError and cleans up; the interrupt goes on up the caller's stack).

Owns: the two futures and those rules. Does not own: the capture itself (persist.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from ckptio.errors import CkptError

__all__ = ["Handover"]

Capture = Callable[[], None]
_NOTHING: Future[Capture | None] = Future()  # a settled hand-over: nothing more to run
_NOTHING.set_result(None)


class Handover:
    def __init__(self, path: str) -> None:
        self.path = path
        self._given: Future[Capture | None] = Future()  # what the caller is to run (None: nothing)
        self._ran: Future[None] = Future()  # the caller ran it (or why not)
        self.abandoned = False  # an interrupt of the caller ended it: the caller has that error

    # ---------------------------------------------------------------- the save's thread

    def give(self, capture: Capture) -> None:
        """Have the caller run ``capture``; returns when it has, raises what it raised."""
        self._settle(self._given, capture)
        self._ran.result()

    def close(self) -> None:
        """Nothing will be given (the save failed or finished first): release the caller."""
        self._settle(self._given, None)

    # ---------------------------------------------------------------- the caller's thread

    def take(self) -> bool:
        """Run what the save's thread gives, once; -> whether a capture ran and succeeded. An
        interrupt abandons the save (the save's thread raises CkptError) and is re-raised."""
        try:
            capture = self._given.result()
            self._given = _NOTHING  # the capture (the save's whole job) is not kept past its run
            if capture is None:
                return False
            capture()
        except Exception as exc:  # noqa: BLE001 - the capture failed: the save's thread raises it
            self._fail(exc)
            return False
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: belong to the caller too
            self.abandoned = True
            self._fail(CkptError(f"save to {self.path} abandoned: the calling thread was "
                                 f"interrupted ({type(exc).__name__})"))
            raise
        self._settle(self._ran, None)
        return True

    def _fail(self, error: BaseException) -> None:
        self._settle(self._given, None)  # an interrupt before anything was given
        with contextlib.suppress(InvalidStateError):
            self._ran.set_exception(error)

    @staticmethod
    def _settle(future: Future[Capture | None] | Future[None], value: Capture | None) -> None:
        with contextlib.suppress(InvalidStateError):  # the other side settled it first
            future.set_result(value)  # type: ignore[arg-type]
