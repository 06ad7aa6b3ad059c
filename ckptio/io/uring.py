"""io_uring backend: many positioned reads and writes in flight on one ring, completions as futures.

Owns: admission (at most ``depth`` writes and READS_PER_DEPTH x ``depth`` reads in the kernel;
submit blocks beyond that), batching
(requests queued while the ring is busy go to the kernel in one io_uring_enter), the reaper thread
that maps completions back to requests, resubmission of short transfers and of EINTR/EAGAIN, and
registered (fixed) buffers for memory the caller registers. Opening, preallocating, fsync and
error messages are the POSIX backend's: the same files come out of both.
Does not own: the kernel ABI (ring.py) or which backend a save uses (io/__init__.py).
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from ckptio.errors import StorageIOError
from ckptio.io.backend_contract import FileHandle
from ckptio.io.posix import PosixBackend, _error
from ckptio.io.ring import MAX_REGISTERED, OP_NOP, OP_READ, OP_READ_FIXED, OP_WRITE, OP_WRITE_FIXED, Ring, address_of

__all__ = ["UringBackend"]

log = logging.getLogger("ckptio")
_WAKE = 0  # user_data of the NOP that wakes the reaper for shutdown; requests count from 1
_RETRY = (errno.EINTR, errno.EAGAIN)
# Reads admitted into the kernel per unit of ``depth`` (writes: one): a load keeps twice the
# depth of reads submitted (loading/read.py), and admitting only ``depth`` of them left a rank's
# disk queue short while the reaper checked and copied (docs/BENCH_RESTART.md, the seventh
# round). 1 gives the reads the writes' depth again (the A/B there).
READS_PER_DEPTH = 2


@dataclass
class _Request:
    write: bool
    fh: FileHandle
    offset: int
    view: memoryview  # kept referenced until the kernel is done with the memory
    address: int
    buf_index: int  # -1: not in a registered buffer
    future: Future[int] = field(default_factory=Future)
    done: int = 0  # bytes transferred so far

    def opcode(self) -> int:
        if self.buf_index >= 0:
            return OP_WRITE_FIXED if self.write else OP_READ_FIXED
        return OP_WRITE if self.write else OP_READ


class UringBackend:
    name = "uring"

    def __init__(self, *, depth: int = 4, direct_io: str = "auto") -> None:
        self.depth, self.direct_io = depth, direct_io
        self._files = PosixBackend(depth=1, direct_io=direct_io)  # opens and closes; no threads
        self._lock = threading.Lock()  # guards the submission ring and the request table
        self.read_depth = depth * READS_PER_DEPTH
        self._slots = threading.Semaphore(depth)  # writes in the kernel
        self._read_slots = threading.Semaphore(self.read_depth)  # reads in the kernel
        self._ring: Ring | None = None
        self._reaper: threading.Thread | None = None
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._registered: list[tuple[int, int]] = []  # (address, nbytes) per fixed buffer
        self._parts: _Parts | None = None  # a region pinned part by part (register_buffers)
        self._stopping = False
        self._broken: str | None = None  # the reaper died: every later request fails at once

    def __getstate__(self) -> dict[str, object]:
        return {"depth": self.depth, "direct_io": self.direct_io}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(depth=state["depth"], direct_io=state["direct_io"])  # type: ignore[misc]

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        # Preallocated: writes that extend a file ran at a quarter of the speed through io_uring.
        return self._files.open_write(path, nbytes)

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:
        return self._files.open_read(path, cached=cached)

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        self._files.close(fh, sync=sync)

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        """Register ``view`` (e.g. the staging pool) as fixed buffers; later requests inside it
        skip the kernel's per-request page pinning. ``part_bytes``: pin each part of that size
        at the first request inside it (a fresh pool is faulted in part by part beside the
        requests in flight rather than all before the first; a sparse table). False if the
        kernel refused (memlock limit, or no sparse tables before Linux 5.19)."""
        base = address_of(view)
        with self._lock:
            ring = self._started()
            try:
                if part_bytes:
                    parts = _Parts(base, len(view), min(part_bytes, MAX_REGISTERED))
                    ring.register_sparse(parts.slots)
                    self._parts = parts
                else:
                    regions = [(base + at, min(MAX_REGISTERED, len(view) - at))
                               for at in range(0, len(view), MAX_REGISTERED)]
                    ring.register_buffers(regions)
                    self._registered = regions
            except OSError:
                return False
        return True

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        return self._submit(True, fh, offset, data)

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        return self._submit(False, fh, offset, into)

    def _submit(self, write: bool, fh: FileHandle, offset: int, view: memoryview) -> Future[int]:
        if len(view) == 0:
            future: Future[int] = Future()
            future.set_result(0)
            return future
        address = address_of(view)
        request = _Request(write, fh, offset, view, address, self._fixed_index(address, len(view)))
        self._admission(write).acquire()  # bounded in the kernel: the completion ring never overflows
        request_id = 0
        try:
            with self._lock:
                if self._broken is not None:
                    raise OSError(errno.EIO, f"{self._broken}; call shutdown() to start a new ring")
                ring = self._started()
                request_id = next(self._ids)
                self._requests[request_id] = request
                self._push(ring, request_id, request)
                ring.submit()
        except OSError as exc:
            self._finish(request_id, request, error=_error("submitting to io_uring for", fh.path, offset, exc))
        except BaseException:
            self._finish(request_id, request, error=StorageIOError(
                f"submitting to io_uring for {fh.path} was interrupted"))
            raise
        return request.future

    def _admission(self, write: bool) -> threading.Semaphore:
        return self._slots if write else self._read_slots

    def _fixed_index(self, address: int, nbytes: int) -> int:
        parts, ring = self._parts, self._ring
        if parts is not None and ring is not None:
            return parts.slot(ring, address, nbytes)
        for index, (base, size) in enumerate(self._registered):
            if base <= address and address + nbytes <= base + size:
                return index
        return -1

    def _push(self, ring: Ring, request_id: int, r: _Request) -> None:
        ring.push(r.opcode(), r.fh.token, r.offset + r.done, r.address + r.done, len(r.view) - r.done,
                  request_id, max(r.buf_index, 0))

    def _started(self) -> Ring:
        """The ring and its reaper, created on first use (caller holds the lock)."""
        if self._ring is None:
            # Twice the admitted requests (reads and writes) of submission slots: resubmissions
            # of short transfers never wait.
            self._ring = Ring(max(2, 2 * (self.depth + self.read_depth)))
            self._stopping = False
            self._reaper = threading.Thread(target=self._reap_forever, args=(self._ring,),
                                            name="ckptio-uring", daemon=True)
            self._reaper.start()
        return self._ring

    def _reap_forever(self, ring: Ring) -> None:
        try:
            while True:
                ring.wait()
                for request_id, result in ring.reap():
                    if request_id != _WAKE:
                        self._complete(ring, request_id, result)
                with self._lock:
                    if self._stopping and not self._requests:
                        return
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter, never swallowed
            with self._lock:
                self._broken = f"the io_uring reaper stopped: {exc!r}"
            self._fail_all(self._broken)
            log.error("ckptio: %s; requests on this backend fail until shutdown()", self._broken)

    def _fail_all(self, why: str) -> None:
        with self._lock:
            requests, self._requests = self._requests, {}
        for request in requests.values():
            self._admission(request.write).release()
            request.future.set_exception(StorageIOError(
                f"{'writing' if request.write else 'reading'} {request.fh.path} at byte "
                f"{request.offset} did not finish: {why}"))

    def _complete(self, ring: Ring, request_id: int, result: int) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return  # already failed by _fail_all: its completion arrives late
        if result < 0 and -result not in _RETRY:
            err = OSError(-result, os.strerror(-result))
            self._finish(request_id, request, error=_error(
                "writing" if request.write else "reading", request.fh.path,
                request.offset + request.done, err))
            return
        request.done += max(result, 0)
        if result == 0 and request.write:
            self._finish(request_id, request, error=StorageIOError(
                f"writing {request.fh.path} at byte {request.offset + request.done} failed: the "
                "kernel wrote 0 bytes; see the OS log"))
        elif request.done == len(request.view) or (result == 0 and not request.write):
            self._finish(request_id, request)  # complete, or a read that reached end of file
        else:  # a short transfer or a retryable error: the rest goes back in, in the same slot
            with self._lock:
                self._push(ring, request_id, request)
                ring.submit()

    def _finish(self, request_id: int, request: _Request, *, error: StorageIOError | None = None) -> None:
        with self._lock:
            known = self._requests.pop(request_id, None) is not None or request_id == 0
        if known:  # _fail_all may have taken it already
            self._admission(request.write).release()
        if error is not None:
            request.future.set_exception(error)
        else:
            request.future.set_result(request.done)

    def shutdown(self) -> None:
        """Wait for requests in flight, stop the reaper and release the ring."""
        with self._lock:
            ring, reaper = self._ring, self._reaper
            if ring is None or reaper is None:
                return
            self._stopping = True
            if reaper.is_alive():
                ring.push(OP_NOP, 0, 0, 0, 0, _WAKE)
                ring.submit()
        reaper.join()
        with self._lock:
            ring.close()
            self._ring, self._reaper, self._registered, self._broken = None, None, [], None
            self._parts = None


@dataclass
class _Parts:
    """A region registered as a sparse table of ``part``-byte fixed buffers, each pinned at the
    first request that lies within it; one the kernel refuses stays unpinned (plain requests)."""

    base: int
    nbytes: int
    part: int
    pinned: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def slots(self) -> int:
        return -(-self.nbytes // self.part)

    def slot(self, ring: Ring, address: int, nbytes: int) -> int:
        """The fixed buffer holding [address, address + nbytes), pinned now if it is not yet;
        -1 where none does."""
        slot = (address - self.base) // self.part
        start = self.base + slot * self.part
        end = min(start + self.part, self.base + self.nbytes)
        if address < self.base or address + nbytes > end:
            return -1
        if slot in self.pinned:
            return slot
        with self.lock:
            if slot not in self.pinned and slot not in self.refused:
                try:
                    ring.update_buffer(slot, start, min(self.part, self.base + self.nbytes - start))
                    self.pinned.add(slot)
                except OSError as exc:
                    self.refused.add(slot)
                    log.info("ckptio: io_uring did not pin part %d of the pool (%s); its "
                             "requests map their pages one by one", slot, exc)
        return slot if slot in self.pinned else -1
