"""A fault-injecting IOBackend: wraps a real backend and fails the calls you choose.

    faulty = FaultyBackend(PosixBackend(), fail_write=3)              # the 3rd write fails (EIO)
    faulty = FaultyBackend(backend, fail_open_write=2, error="enospc")  # 2nd file: disk full
    faulty = inject(checkpointer, fail_write=1)    # install into a ckptio.Checkpointer

Every injected failure is a StorageIOError naming the file and the offset, worded like the posix
backend's own errors, so code under test cannot tell it from a real one. Failures of
``submit_write``/``submit_read`` arrive through the returned future (as the IOBackend contract
says) unless ``raise_in_submit=True``, which raises from the submit call itself (a backend whose
queue submission fails synchronously, e.g. io_uring_submit).

Counters are 1-based and count every call of that kind through the wrapper (or only the calls
whose path contains ``match``). Each fault fires once; later calls pass through, so the same
Checkpointer can be shown to recover. ``injected`` lists the faults that fired, so a test can
check its fault was reached; ``open_handles`` lists handles opened and not yet closed, so a test
can check that a failure leaks no file descriptor.
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ckptio.errors import StorageIOError
from ckptio.io.backend_contract import FileHandle, IOBackend

__all__ = ["FaultyBackend", "FsyncGate", "HeldWrites", "inject"]

ErrorSpec = str | int | Callable[[str, str, int], BaseException]

_ERRNOS = {"eio": errno_mod.EIO, "enospc": errno_mod.ENOSPC, "edquot": errno_mod.EDQUOT}
_HINTS = {
    errno_mod.ENOSPC: "the disk is full: free space or save elsewhere",
    errno_mod.EDQUOT: "the disk quota is exhausted",
}


def injected_error(what: str, path: str, offset: int, error: ErrorSpec = "eio") -> BaseException:
    """The exception an injected fault raises: a StorageIOError naming ``path`` and ``offset``
    (``error`` "eio", "enospc", "edquot" or an errno), or whatever a callable ``error`` builds."""
    if callable(error):
        return error(what, path, offset)
    code = _ERRNOS[error] if isinstance(error, str) else int(error)
    hint = _HINTS.get(code, "see the OS error")
    return StorageIOError(
        f"{what} {path} at byte {offset} failed: {os.strerror(code)} (injected fault); {hint}")


def _failed(exc: BaseException) -> Future[int]:
    future: Future[int] = Future()
    future.set_running_or_notify_cancel()
    future.set_exception(exc)
    return future


class FaultyBackend:
    """An IOBackend that forwards to ``inner`` and fails the k-th call of a kind.

    fail_open_write / fail_open_read / fail_write / fail_read / fail_close: 1-based index of the
    call of that kind to fail (None: never). fail_close fails only closes with sync=True (an fsync
    error: the data is not durable); the inner handle is still closed, as close(2) would.
    error: "eio" (default), "enospc", "edquot", an errno, or a callable (what, path, offset) ->
    exception, e.g. to raise a raw OSError from a backend that breaks the contract.
    raise_in_submit: raise from submit_write/submit_read instead of failing the future.
    match: count only calls whose file path contains this string.
    delay_s: sleep this long in every submit_write before forwarding it (slows a save down).
    """

    def __init__(
        self,
        inner: IOBackend,
        *,
        fail_open_write: int | None = None,
        fail_open_read: int | None = None,
        fail_write: int | None = None,
        fail_read: int | None = None,
        fail_close: int | None = None,
        error: ErrorSpec = "eio",
        raise_in_submit: bool = False,
        match: str | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.inner = inner
        self.name = f"faulty({getattr(inner, 'name', type(inner).__name__)})"
        self.fail_at = {"open_write": fail_open_write, "open_read": fail_open_read,
                        "write": fail_write, "read": fail_read, "close": fail_close}
        self.error = error
        self.raise_in_submit = raise_in_submit
        self.match = match
        self.delay_s = delay_s
        self.calls: Counter[str] = Counter()
        self.injected: list[str] = []
        self.open_handles: dict[int, FileHandle] = {}
        self._lock = threading.Lock()

    # -- pickling: like any backend, no lock or live handle crosses a process boundary ---------
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_lock"]
        state["open_handles"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _should_fail(self, kind: str, path: str) -> bool:
        if self.match is not None and self.match not in path:
            return False
        with self._lock:
            self.calls[kind] += 1
            fire = self.calls[kind] == self.fail_at[kind]
            if fire:
                self.injected.append(f"{kind} #{self.calls[kind]} {path}")
            return fire

    # -- the IOBackend contract ---------------------------------------------------------------
    def open_write(self, path: str, nbytes: int) -> FileHandle:
        if self._should_fail("open_write", path):
            raise injected_error("preallocating", path, 0, self.error)
        fh = self.inner.open_write(path, nbytes)
        with self._lock:
            self.open_handles[id(fh)] = fh
        return fh

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:
        if self._should_fail("open_read", path):
            raise injected_error("opening", path, 0, self.error)
        fh = self.inner.open_read(path, cached=cached)
        with self._lock:
            self.open_handles[id(fh)] = fh
        return fh

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._should_fail("write", fh.path):
            exc = injected_error("writing", fh.path, offset, self.error)
            if self.raise_in_submit:
                raise exc
            return _failed(exc)
        return self.inner.submit_write(fh, offset, data)

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        if self._should_fail("read", fh.path):
            exc = injected_error("reading", fh.path, offset, self.error)
            if self.raise_in_submit:
                raise exc
            return _failed(exc)
        return self.inner.submit_read(fh, offset, into)

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        with self._lock:
            self.open_handles.pop(id(fh), None)
        fail = sync and self._should_fail("close", fh.path)
        self.inner.close(fh, sync=sync and not fail)
        if fail:
            raise injected_error("fsync", fh.path, 0, self.error)

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        return self.inner.register_buffers(view, part_bytes=part_bytes)

    def shutdown(self) -> None:
        self.inner.shutdown()


class FsyncGate(FaultyBackend):
    """Holds a save at the fsync of its first data file: sets ``reached`` there, goes on once
    ``go`` is set (AssertionError if not within ``timeout_s``: a test's guard against a hang)."""

    def __init__(self, inner: IOBackend, reached: threading.Event, go: threading.Event,
                 timeout_s: float = 120.0) -> None:
        super().__init__(inner)
        self.reached, self.go, self.timeout_s = reached, go, timeout_s

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        if sync and not self.reached.is_set():
            self.reached.set()
            if not self.go.wait(self.timeout_s):
                raise AssertionError("FsyncGate: go was not set in time")
        super().close(fh, sync=sync)


def inject(checkpointer: Any, store: Any = None, **faults: Any) -> FaultyBackend:
    """Wrap ``checkpointer``'s backend for ``store``'s kind (a local directory's by default)
    in a FaultyBackend. ``checkpointer.close()`` drops the wrapper; the next save or load gets
    a plain backend."""
    from ckptio.storage.local.local_store import LocalStore

    wrapped = checkpointer.resources().wrap_backend(
        LocalStore(".") if store is None else store,
        lambda backend: FaultyBackend(backend, **faults))
    return wrapped


class HeldWrites:
    """Holds every write of ``checkpointer``'s saves (through ``inject``) until ``opened`` is
    set (at most ``timeout_s``): a save kept in flight while a test looks at it."""

    def __init__(self, checkpointer: Any, timeout_s: float = 60.0) -> None:
        self.opened = threading.Event()
        backend = inject(checkpointer)
        passing = backend.submit_write

        def held(*args: Any, **kwargs: Any) -> Any:
            self.opened.wait(timeout_s)
            return passing(*args, **kwargs)

        backend.submit_write = held  # type: ignore[method-assign]
