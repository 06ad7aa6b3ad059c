"""The deadline of a save's or a load's I/O: a write, fsync, commit, open or read that does not
return is said, not waited on in silence (a hung NFS or Lustre server, a FUSE file system that
stopped answering, a dying disk).

Each save and each load has an Activity: its I/O calls in flight on this rank (what, which
file, since when; saving/persist.py and save_session.py open and close a save's, a load's
reads go through a watched StoreFiles, storage/files.py) and the last time one returned. One
process-wide watch (a Worker, io/worker.py) looks at every Activity a few times per
``Options.io_stall_warn_s``: one with calls in flight none of which has returned for that
long gets a warning on the ``ckptio`` logger naming the rank, the oldest call's file and the
seconds waited, repeated every ``io_stall_warn_s`` while it lasts, and one line when it goes on.
``describe()`` is what a save's ``wait(timeout=...)`` that expires says (handle.py, api.py).

Owns: the calls in flight, the watch and its warnings. Does not own: the calls themselves
(persist.py, the Store's commit, the StoreFiles' reads) or the timeouts of wait() and close()
(handle.py, api.py).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator

from ckptio.io.worker import Worker

__all__ = ["Activity", "watched"]

log = logging.getLogger("ckptio")
_SAVE_WAITS = "wait(timeout=...) and close(timeout=...) stop waiting"
_LOAD_WAITS = ("A load waits for its reads: the call is in the kernel and cannot be cancelled "
               "(the state is filled once it returns)")
TICKS_PER_PERIOD = 4  # the watch looks this often per io_stall_warn_s (a warning is that late)
MAX_TICK_S = 5.0


class Activity:
    """One save's or load's I/O calls in flight on one rank (module docstring). Thread-safe.
    ``warn_s``: Options.io_stall_warn_s (0: never warned); ``load``: a load's reads (its
    warnings say "the load from" and that a load waits for them), else a save's."""

    def __init__(self, location: str, rank: int, warn_s: float, *, load: bool = False) -> None:
        self.location, self.rank, self.warn_s, self.load = location, rank, warn_s, load
        self._lock = threading.Lock()
        self._calls: dict[int, tuple[str, str, float]] = {}  # token -> (what, file, began)
        self._tokens = itertools.count()
        self._returned = time.monotonic()  # when a call last returned (or the save or load began)
        self._warned_s = 0.0  # the stall's length at the last warning (0: none said)
        self.over = False

    def begin(self, what: str, file: str) -> int:
        """A call on ``file`` (``what``: "write", "fsync", "commit", "open", "read") starts
        -> its token."""
        token = next(self._tokens)
        with self._lock:
            self._calls[token] = (what, file, time.monotonic())
        return token

    def end(self, token: int) -> None:
        """The call of ``token`` returned (or failed): it made progress."""
        with self._lock:
            self._calls.pop(token, None)
            self._returned = time.monotonic()

    @contextlib.contextmanager
    def call(self, what: str, file: str) -> Iterator[None]:
        token = self.begin(what, file)
        try:
            yield
        finally:
            self.end(token)

    def stalled(self) -> tuple[str, str, float] | None:
        """(what, file, seconds) of the oldest call in flight and how long no call has
        returned; None with no call in flight."""
        now = time.monotonic()
        with self._lock:
            if not self._calls:
                return None
            what, file, began = min(self._calls.values(), key=lambda c: c[2])
            return what, file, now - max(began, self._returned)

    def describe(self) -> str:
        """What this rank is waiting on, for a timeout's message."""
        stalled = self.stalled()
        if stalled is None:
            return (f"rank {self.rank} has no write, fsync or commit in flight (it copies the "
                    "state, or waits for the lock or for the other ranks)")
        what, file, seconds = stalled
        return f"rank {self.rank} has waited {_seconds(seconds)} s for the {what} of {file}"

    def check(self) -> None:
        """The watch's look: warn once per ``warn_s`` of a stall, and once when it ends."""
        stalled = self.stalled()
        seconds = 0.0 if stalled is None else stalled[2]
        doing = "load from" if self.load else "save to"
        if self._warned_s and seconds < self._warned_s:
            log.warning("ckptio: rank %d: the %s %s goes on (its I/O had made no progress "
                        "for %s s)", self.rank, doing, self.location, _seconds(self._warned_s))
            self._warned_s = 0.0
        if stalled is None or not self.warn_s or seconds - self._warned_s < self.warn_s:
            return
        what, file, _ = stalled
        log.warning("ckptio: rank %d: the %s %s has made no progress for %s s: the %s of "
                    "%s has not returned (a hung disk or network filesystem?); still waiting. "
                    "%s (Options.io_stall_warn_s=%g)", self.rank, doing, self.location,
                    _seconds(seconds), what, file, _LOAD_WAITS if self.load else _SAVE_WAITS,
                    self.warn_s)
        self._warned_s = seconds

    def finish(self) -> None:
        """The save or load is over: the watch looks once more (the end of a stall said), then
        drops it."""
        self.over = True
        _WATCH.wake()


def _seconds(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"


class _Watch:
    """The watch's Jobs (io/worker.py): one job that looks at every Activity until none is left."""

    def __init__(self) -> None:
        self.worker: Worker[int] = Worker("ckptio-stall-watch", self)
        self.saves: list[Activity] = []
        self.running = False

    def watch(self, activity: Activity) -> None:
        with self.worker.lock:
            self.saves.append(activity)
        self.worker.wake()

    def wake(self) -> None:
        with self.worker.lock:
            self.worker.lock.notify_all()

    def take(self) -> int | None:
        if self.running or not self.saves:
            return None
        self.running = True
        return 1

    def pending(self) -> bool:
        return self.running or bool(self.saves)

    def run(self, job: int) -> None:
        while True:
            with self.worker.lock:
                saves = list(self.saves)
                exiting = self.worker.exiting  # a load is not waited for at exit (a save is)
                self.saves = [a for a in saves if not a.over and not (exiting and a.load)]
                if not saves:
                    return
                periods = [a.warn_s for a in self.saves if a.warn_s] or [MAX_TICK_S]
            for activity in saves:
                activity.check()
            with self.worker.lock:
                if self.saves:
                    self.worker.lock.wait(min(MAX_TICK_S, min(periods) / TICKS_PER_PERIOD))

    def finish(self, job: int, error: Exception | None) -> None:
        self.running = False
        if error is not None:  # a bug of the watch: said, they go on unwatched
            log.warning("ckptio: the watch of saves' and loads' I/O stopped: %s", error)


_WATCH = _Watch()


def _new_watch_in_child() -> None:
    """A forked child has none of the parent's threads (and maybe a lock a parent's thread
    held): its saves and loads get a watch of their own."""
    global _WATCH
    _WATCH = _Watch()


os.register_at_fork(after_in_child=_new_watch_in_child)


def watched(location: str, rank: int, warn_s: float, *, load: bool = False) -> Activity:
    """A new save's (``load``: load's) Activity, watched from now until its finish()."""
    activity = Activity(location, rank, warn_s, load=load)
    _WATCH.watch(activity)
    return activity
