"""One background thread that runs an owner's jobs one at a time: what the drain
(managing/drain.py), the protection (redundancy/protect.py), the saves' stall watch
(io/stall.py) and a Checkpointer's save threads (``Calls``, saving/workers.py) are built on.

Call order: the owner makes ``Worker(name, jobs)``; ``wake()`` after it queued work (under
``lock`` or not), which starts the thread on first use; the thread asks ``jobs.take()`` (under
``lock``) for the next job, runs ``jobs.run(job)`` without the lock, then ``jobs.finish(job,
error)`` under ``lock``; ``wait(timeout)`` until ``jobs.pending()`` is False; ``close()`` last.

Owns: the thread (started lazily, named, a daemon), its lowered CPU priority (``nice``; the
threads it starts inherit it on Linux) and, when niced, the lowest best-effort I/O priority;
the condition the owner guards its queue with and the thread sleeps on, the first error a job
raised (kept, reported by ``status()``, raised once by ``wait()`` or ``close()``), the refusal
of work after ``close()``, and its stop at interpreter exit: the job running then finishes,
queued ones do not start, and the thread is joined before the interpreter finalizes (a daemon
thread still inside a torch call, a gloo collective of the protection, then aborted the
process); a forked child's exit stops only the workers the child made. Does not own: what is
queued, which job runs next or what a job does (``Jobs``).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

from ckptio.errors import CkptError

__all__ = ["NICE", "Calls", "Jobs", "Worker"]

log = logging.getLogger("ckptio")
NICE = 10  # the background threads' CPU priority: they take what training leaves
IOPRIO_BE_LOWEST = (2 << 13) | 7  # ioprio_set(2): class best-effort (2), its lowest level (7)
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}  # (ioprio_set, ioprio_get)
J = TypeVar("J")
R = TypeVar("R")


class Jobs(Protocol[J]):
    """What a Worker asks its owner. ``take``, ``pending`` and ``finish`` run under the
    worker's ``lock``; ``run`` runs on the worker's thread without it."""

    def take(self) -> J | None:
        """The next job to run (marked busy in the owner's state), or None when none is due."""
        ...

    def pending(self) -> bool:
        """Whether a job is due or running (wait() returns once this is False)."""
        ...

    def run(self, job: J) -> None:
        """Do ``job``; an exception it raises is kept by the worker (the first one) and given
        to finish()."""
        ...

    def finish(self, job: J, error: Exception | None) -> None:
        """Record ``job``'s outcome in the owner's state (``error``: what run raised)."""
        ...


class Worker(Generic[J]):
    """The background thread of one owner (module docstring).

    Args:
        name: the thread's name (``ckptio-drain``, ``ckptio-protect``), in logs and debuggers.
        jobs: the owner's queue (Jobs).
        nice: the thread's CPU priority (Linux: per thread; refused: normal priority).
        lock: the owner's condition, shared by its workers (default: one of this worker's).

    Example::

        worker = Worker("ckptio-drain", lanes)
        with worker.lock:
            lanes.queue(step)
        worker.wake()
        worker.wait()   # raises the first job error, once
        worker.close()
    """

    def __init__(self, name: str, jobs: Jobs[J], *, nice: int = NICE,
                 lock: threading.Condition | None = None) -> None:
        self.name = name
        # guards the owner's queue and the fields below; an owner with several workers (the
        # drain: one per slower tier) gives them its one condition
        self.lock = threading.Condition() if lock is None else lock
        self._jobs = jobs
        self._nice = nice
        self._thread: threading.Thread | None = None
        self._closed = False
        self._exiting = False  # the interpreter exits: no job starts any more
        self._ended = False  # the thread has returned
        self._error: Exception | None = None  # the first one wait() has not raised yet
        _workers.add(self)

    def wake(self) -> None:
        """The owner queued work: start the thread if not yet, wake it. CkptError after
        close() (nothing runs any more)."""
        with self.lock:
            if self._closed:
                raise CkptError(f"{self.name}: work was queued after close(); it will not run. "
                                "Queue work only while the manager is open")
            if self._thread is None and not self._exiting:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self.lock.notify_all()

    @property
    def exiting(self) -> bool:
        """Whether the interpreter exits (``stop_for_exit``): a running job that would go on
        by itself ends now (read under ``lock``)."""
        return self._exiting

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is pending (-> True) or ``timeout`` seconds passed, or the interpreter
        exits and no job runs any more (-> False); the first job error not raised yet is raised
        here, once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while self._jobs.pending():
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or self._stopped():
                    return False
                self.lock.wait(left)
            error, self._error = self._error, None
        if error is not None:
            raise error
        return True

    def close(self, *, wait: bool = True) -> None:
        """wait(), then stop and join the thread; later wake() is refused. The error wait()
        raises is raised after the thread is joined. ``wait=False`` (an owner collected
        without closing it): refuse later work, let the thread end once the queued jobs ran,
        join nothing."""
        if not wait:
            with self.lock:
                self._closed = True
                self.lock.notify_all()
            return
        try:
            self.wait()
        finally:
            with self.lock:
                self._closed = True
                self.lock.notify_all()
            if self._thread is not None:
                self._thread.join()
            with self.lock:  # the owner holds this worker: no cycle left to the collector
                self._jobs = _ENDED

    def status(self) -> dict[str, Any]:
        """The thread's name, whether it runs, and the kept error not raised yet (its text)."""
        with self.lock:
            error = self._error
            return {"thread": self.name,
                    "alive": self._thread is not None and self._thread.is_alive(),
                    "error": None if error is None else f"{type(error).__name__}: {error}"}

    # ---------------------------------------------------------------- the thread

    def _loop(self) -> None:
        self._lower_priority()
        while True:
            with self.lock:
                job = self._next()
                while job is None and not (self._closed or self._exiting):
                    self.lock.wait()
                    job = self._next()
                if job is None:
                    self._ended = True
                    if self._closed:
                        self._jobs = _ENDED  # no cycle with the owner left to the collector
                    self.lock.notify_all()  # a wait() at exit: nothing runs any more
                    return
            error: Exception | None = None
            try:
                self._jobs.run(job)
            except Exception as exc:  # noqa: BLE001 - kept, raised once by wait()/close()
                error = exc
            with self.lock:
                if error is not None and self._error is None:
                    self._error = error
                self._jobs.finish(job, error)
                self.lock.notify_all()

    def _stopped(self) -> bool:
        """Whether no job will run any more: the interpreter exits and the thread ended."""
        return self._exiting and (self._thread is None or self._ended)

    def _next(self) -> J | None:
        """The next job to run (under ``lock``); none once the interpreter exits."""
        return None if self._exiting else self._jobs.take()

    def stop_for_exit(self) -> None:
        """At interpreter exit: let the running job finish, start no other, join the thread."""
        with self.lock:
            self._exiting = True
            self.lock.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _lower_priority(self) -> None:
        try:  # Linux: per thread; the threads this one starts inherit it
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
        except (OSError, AttributeError):
            log.debug("ckptio: %s runs at normal priority (setpriority refused)", self.name)
        if self._nice > 0 and not set_io_priority(threading.get_native_id(), IOPRIO_BE_LOWEST):
            log.debug("ckptio: %s runs at normal I/O priority (ioprio_set refused)", self.name)


def set_io_priority(tid: int, value: int) -> bool:
    """ioprio_set(2) of thread ``tid`` (Linux; inherited by the threads it starts): a thread
    that yields the CPU yields the disk too, where the I/O scheduler weighs priorities (BFQ;
    mq-deadline by class). -> False where refused or not Linux on x86-64 or arm64."""
    numbers = _IOPRIO_SYSCALLS.get(os.uname().machine) if sys.platform == "linux" else None
    if numbers is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.syscall(ctypes.c_long(numbers[0]), ctypes.c_long(1), ctypes.c_long(tid),
                            ctypes.c_long(value))) == 0  # 1: IOPRIO_WHO_PROCESS (a thread id)


class _Ended:
    """The jobs of a closed worker whose thread ended: none. It replaces the owner's queue, so
    that the owner (which holds the worker) and the worker are freed without the collector."""

    def take(self) -> None:
        return None

    def pending(self) -> bool:
        return False

    def run(self, job: Any) -> None:  # pragma: no cover - take() gives no job
        return None

    def finish(self, job: Any, error: Exception | None) -> None:  # pragma: no cover
        return None


_ENDED: Any = _Ended()

_Call = list[Any]  # [its Future, the function, its arguments], emptied as it runs


class Calls:
    """Calls run in order on one Worker's thread, each with a Future for its outcome: what a
    one-thread executor gives, on a thread kept from call to call. A call's exception goes to
    its Future and is raised by whoever waits for it (the Worker keeps none). At interpreter
    exit a call not started yet never runs: an owner waits for what it needs before then."""

    def __init__(self, name: str, *, nice: int = 0) -> None:
        self._queue: collections.deque[_Call] = collections.deque()
        self._busy = False
        self.worker: Worker[_Call] = Worker(name, self, nice=nice)

    def submit(self, fn: Callable[..., R], /, *args: Any) -> Future[R]:
        """Queue ``fn(*args)``; its Future. CkptError after close()."""
        future: Future[R] = Future()
        with self.worker.lock:
            self.worker.wake()
            self._queue.append([future, fn, args])
        return future

    def close(self, *, wait: bool = True) -> None:
        """The queued calls run, then the thread ends (joined unless ``wait=False``)."""
        self.worker.close(wait=wait)

    # ---------------------------------------------------------------- Jobs, for the Worker

    def take(self) -> _Call | None:
        if not self._queue:
            return None
        self._busy = True
        return self._queue.popleft()

    def pending(self) -> bool:
        return bool(self._queue) or self._busy

    def run(self, job: _Call) -> None:
        future, fn, args = job
        job.clear()
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - kept in its Future, raised by its waiter
            del fn, args
            future.set_exception(exc)
        else:
            del fn, args  # a waiter woken by the Future finds the call's arguments let go
            future.set_result(result)

    def finish(self, job: _Call, error: Exception | None) -> None:
        self._busy = False


_workers: weakref.WeakSet[Worker[Any]] = weakref.WeakSet()


def _stop_at_exit() -> None:
    """threading's exit hook, before the interpreter finalizes: every worker's running job
    finishes, none starts (work queued by a save finishing at exit included)."""
    for worker in list(_workers):
        worker.stop_for_exit()


def _forget_in_child() -> None:
    """After a fork, in the child: the parent's workers' threads are not there (a lock one of
    them held may never be let go), so the child's exit stops only the workers it makes."""
    _workers.clear()


os.register_at_fork(after_in_child=_forget_in_child)
threading._register_atexit(_stop_at_exit)  # type: ignore[attr-defined]
