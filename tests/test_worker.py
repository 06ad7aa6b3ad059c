"""The one background-worker class (ckptio/io/worker.py) the drain, the protection and (through
Calls) a Checkpointer's save threads run on:
its thread starts on first use under its name at a lowered CPU priority, a job's first error is
kept (shown by status()) and raised once by wait() or close(), close() joins the thread, and work
queued after close() is refused; the drain keeps those rules on it."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import pytest

from ckptio.errors import CkptError
from ckptio.options import MiB, Options
from ckptio.managing.drain import Drain
from ckptio.io.worker import IOPRIO_BE_LOWEST, NICE, Calls, Worker


class _Fifo:
    """Jobs: callables run in order; each run records the thread's native id."""

    def __init__(self) -> None:
        self.queue: list[object] = []
        self.busy = False
        self.done: list[object] = []
        self.errors: list[Exception | None] = []
        self.tids: list[int] = []

    def take(self) -> object | None:
        if not self.queue:
            return None
        self.busy = True
        return self.queue.pop(0)

    def pending(self) -> bool:
        return bool(self.queue) or self.busy

    def run(self, job: object) -> None:
        self.tids.append(threading.get_native_id())
        if isinstance(job, Exception):
            raise job

    def finish(self, job: object, error: Exception | None) -> None:
        self.busy = False
        self.done.append(job)
        self.errors.append(error)


def _queue(worker: Worker[object], jobs: _Fifo, *items: object) -> None:
    with worker.lock:
        worker.wake()
        jobs.queue.extend(items)


def _nice_of(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[16])  # field 19 of proc(5), counted from the state (field 3)


def test_first_error_is_raised_once_by_wait_then_not_by_close() -> None:
    jobs = _Fifo()
    worker: Worker[object] = Worker("ckptio-test", jobs)
    first, second = ValueError("first"), RuntimeError("second")
    _queue(worker, jobs, 1, first, 2, second, 3)
    with pytest.raises(ValueError, match="first"):
        worker.wait()
    assert jobs.done == [1, first, 2, second, 3], "a failed job does not stop the next ones"
    assert jobs.errors == [None, first, None, second, None], "finish() sees each job's error"
    assert worker.status()["error"] is None, "raised once: nothing kept after"
    assert worker.wait() is True
    worker.close()  # raises nothing: the error was raised already
    assert worker.status()["alive"] is False


def test_status_shows_the_kept_error_and_close_raises_it_after_joining() -> None:
    jobs = _Fifo()
    worker: Worker[object] = Worker("ckptio-test", jobs)
    _queue(worker, jobs, KeyError("lost"))
    while worker.status()["error"] is None:
        threading.Event().wait(0.01)
    assert worker.status()["error"] == "KeyError: 'lost'"
    with pytest.raises(KeyError):
        worker.close()
    assert worker.status() == {"thread": "ckptio-test", "alive": False, "error": None}


def test_close_joins_and_work_after_close_is_refused() -> None:
    jobs = _Fifo()
    worker: Worker[object] = Worker("ckptio-test", jobs)
    assert worker.close() is None, "closing a worker that never ran is fine"
    with pytest.raises(CkptError, match="after close"):
        _queue(worker, jobs, 1)
    assert jobs.queue == [] and jobs.done == [], "nothing was queued or run"
    started = _Fifo()
    running: Worker[object] = Worker("ckptio-test-2", started)
    _queue(running, started, 1, 2)
    assert "ckptio-test-2" in {t.name for t in threading.enumerate()}, "started, named"
    running.close()
    assert started.done == [1, 2], "close() waits for the queued jobs"
    assert "ckptio-test-2" not in {t.name for t in threading.enumerate()}, "close() joined"
    with pytest.raises(CkptError):
        _queue(running, started, 3)


def test_wait_times_out_while_a_job_runs() -> None:
    gate = threading.Event()

    class _Slow(_Fifo):
        def run(self, job: object) -> None:
            gate.wait(30)

    jobs = _Slow()
    worker: Worker[object] = Worker("ckptio-test", jobs)
    _queue(worker, jobs, 1)
    assert worker.wait(0.05) is False
    gate.set()
    assert worker.wait(30) is True
    worker.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux /proc")
def test_the_thread_runs_at_lowered_priority_and_the_caller_keeps_its_own() -> None:
    mine = _nice_of(threading.get_native_id())

    class _Probe(_Fifo):
        def run(self, job: object) -> None:
            super().run(job)
            self.niced = _nice_of(threading.get_native_id())

    jobs = _Probe()
    worker: Worker[object] = Worker("ckptio-test", jobs)
    _queue(worker, jobs, 1)
    worker.close()
    assert jobs.tids and jobs.tids[0] != threading.get_native_id(), "ran on its own thread"
    assert jobs.niced == max(NICE, mine), "the worker's thread is niced"
    assert _nice_of(threading.get_native_id()) == mine, "the caller's priority is untouched"


class _Route:
    """A drain Route whose every copy fails, recording the thread it ran on and its nice."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def holds(self, step: int, tier: int) -> bool:
        self.seen.append((threading.current_thread().name, _nice_of(threading.get_native_id())))
        raise OSError(f"tier {tier} unreachable")

    def source(self, step: int, tier: int) -> None:
        return None

    def target(self, step: int, tier: int) -> None:
        raise AssertionError("never asked: holds() failed first")

    def bases(self, step: int, tier: int) -> tuple[int, ...]:
        return ()

    def known(self, step: int, tier: int) -> None:
        return None

    def landed(self, step: int, tier: int) -> None:
        raise AssertionError("never asked")

    def done(self, step: int) -> None:
        self.seen.append(("done", step))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux /proc")
def test_the_drain_runs_on_the_worker() -> None:
    """Drain: its copies run on the worker's niced thread; a failed copy is in status() and is
    raised once by wait(), not again by close(); a submit after close() is refused."""
    route = _Route()
    options = Options(buffer_bytes=MiB, pool_bytes=2 * MiB)
    drain = Drain(route, [1, 1], options)  # type: ignore[arg-type]
    mine = _nice_of(threading.get_native_id())
    drain.submit(4)
    with pytest.raises(OSError, match="unreachable"):
        drain.wait(30)
    assert route.seen == [("ckptio-drain-1", max(NICE, mine)), ("done", 4)], "failed: let go"
    assert "step 4: OSError" in drain.status()[1]["error"]
    assert drain.pinned() == set()
    drain.close()
    with pytest.raises(CkptError):
        drain.submit(5)


def test_calls_run_in_order_on_one_kept_thread_each_outcome_in_its_future() -> None:
    """Calls (a save's threads, saving/workers.py): in order, one thread for every call (none
    started per call), each outcome in its Future and none kept by the Worker; after close()
    the thread is joined and a call is refused."""
    calls = Calls("ckptio-test-calls")
    ran: list[tuple[int, int]] = []
    futures = [calls.submit(lambda i: ran.append((i, threading.get_ident())) or i * 10, i)
               for i in range(5)]
    failed = calls.submit(lambda: {}["missing"])
    after = calls.submit(lambda: "after")
    assert [f.result(30) for f in futures] == [0, 10, 20, 30, 40]
    assert [i for i, _t in ran] == [0, 1, 2, 3, 4], "in order"
    assert len({t for _i, t in ran}) == 1 and ran[0][1] != threading.get_ident(), "one thread"
    assert isinstance(failed.exception(30), KeyError), "the error is the call's, in its Future"
    assert after.result(30) == "after", "a failed call does not stop the next ones"
    assert calls.worker.status()["error"] is None, "the Worker keeps none (raised by the waiter)"
    calls.close()
    assert "ckptio-test-calls" not in {t.name for t in threading.enumerate()}, "joined"
    with pytest.raises(CkptError, match="after close"):
        calls.submit(lambda: None)


def _ioprio_of(tid: int) -> int:
    """ioprio_get(IOPRIO_WHO_PROCESS, tid), by the system call itself (x86-64 / arm64)."""
    number = {"x86_64": 252, "aarch64": 31}[os.uname().machine]
    libc = ctypes.CDLL(None, use_errno=True)
    value = int(libc.syscall(ctypes.c_long(number), ctypes.c_long(1), ctypes.c_long(tid)))
    assert value >= 0, os.strerror(ctypes.get_errno())
    return value


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="ioprio_get: Linux on x86-64 or arm64")
def test_a_niced_thread_also_yields_the_disk_and_the_caller_keeps_its_io_priority() -> None:
    mine = _ioprio_of(threading.get_native_id())

    class _Probe(_Fifo):
        def run(self, job: object) -> None:
            super().run(job)
            self.ioprio = _ioprio_of(threading.get_native_id())

    jobs = _Probe()
    worker: Worker[object] = Worker("ckptio-test", jobs)
    _queue(worker, jobs, 1)
    worker.close()
    assert jobs.ioprio == IOPRIO_BE_LOWEST, "class best-effort, level 7 (the lowest)"
    assert _ioprio_of(threading.get_native_id()) == mine, "the caller's I/O priority is untouched"
