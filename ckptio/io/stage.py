"""Host staging: a fixed pool of aligned, pre-faulted buffers reused by every save and load.

Owns: staging memory (allocated once, pre-faulted because this kind of VM faults fresh pages
slowly, page-locked with cudaHostRegister when CUDA is present so device copies run
asynchronously) and its admission (acquire blocks while every buffer is in use). Does not own:
a buffer's bytes as tensors and the copies between tensors and buffers (io/buffers.py), what
is copied where (saving/persist.py, loading/read.py) or I/O (io/).
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

from ckptio.errors import CkptError
from ckptio.io.buffers import Buffer
from ckptio.io.pages import populate

__all__ = ["StagingPool", "available_host_bytes"]


class StagingPool:
    """``nbuffers`` buffers of ``buffer_bytes`` in one anonymous mapping.

    Every page is faulted in when the pool is made (``prefault``) and stays resident: the mapping
    is never unmapped or advised away while the pool lives, so no save pays for page faults and
    the resident set does not grow save after save. Free buffers are handed out lowest index
    first. With CUDA present the mapping is page-locked (``pinned``), so
    non_blocking device->host copies into it are truly asynchronous.
    """

    def __init__(self, nbuffers: int, buffer_bytes: int, *, prefault: bool = True,
                 background: bool = False,
                 when_resident: Callable[[StagingPool], None] | None = None) -> None:
        """``background``: fault the pages in on a thread of the pool's own, buffer by buffer,
        each buffer handed out as soon as it is faulted (so a first save overlaps the pre-fault
        with its first writes instead of waiting for all of it). Without CUDA only: page-locking
        faults every page at once anyway. ``when_resident``: called with the pool on that
        thread once every page is in (not if stopped at exit or close); it must not wait for
        a lock that close()'s caller may hold."""
        self.buffer_bytes = buffer_bytes
        self.nbuffers = nbuffers
        self._prefault = prefault
        self._mapping = _private_mapping(nbuffers * buffer_bytes)
        whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        background = background and prefault and not torch.cuda.is_available()
        if prefault and not background:
            whole.zero_()  # fault every page now, once, rather than inside a timed save
        self.pinned = _pin(whole)
        self._all = [
            Buffer(i, memoryview(self._mapping)[i * buffer_bytes:(i + 1) * buffer_bytes],
                   whole[i * buffer_bytes:(i + 1) * buffer_bytes])
            for i in range(nbuffers)
        ]
        self._cond = threading.Condition()
        self._faulter: threading.Thread | None = None
        self._stop = threading.Event()  # set at interpreter exit: hand out the rest unfaulted
        self._unfaulted = nbuffers if background else 0  # not yet handed out by the pre-fault
        self._claimed = 0 if background else nbuffers  # buffers the pre-fault or a taker began
        self._taken: list[Buffer] = []  # claimed by an acquire: faulted by its copies
        self._all_in = not background  # every page faulted in (or left to the copies)
        self._held = 0  # held_back()s open: the pre-fault waits between buffers
        self._waiting = 0  # acquires waiting for a buffer: the pre-fault goes on for them
        self._when_resident = when_resident
        if background:
            self._free: list[tuple[int, Buffer]] = []  # a heap: lowest index first
            # Not a daemon: joined at exit once the exit hook has stopped it (within a buffer);
            # a daemon one, caught inside torch's zero_() by interpreter finalization, aborted
            # the process ("terminate called without an active exception").
            self._faulter = threading.Thread(target=self._fault_in, name="ckptio-prefault")
            _faulting.add(self)
            self._faulter.start()
        else:
            self._free = [(b.index, b) for b in self._all]

    def _fault_in(self) -> None:
        """The background pre-fault: each buffer's pages, then the buffer is free to use; the
        buffers an acquire took meanwhile (their copies fault them) are populated last, so
        the pool is resident when it says so."""
        while (buffer := self._claim()) is not None:
            if not self._stop.is_set():
                # No torch op: it would start a second team of intra-op threads beside the
                # training loop's, and on few cores both teams then slowed every training step
                # while it lasted (docs/BENCH_LIMIT.md, "What was found, and what changed").
                _populate(buffer.data.data_ptr(), buffer.nbytes)
            with self._cond:
                self._unfaulted -= 1
                heapq.heappush(self._free, (buffer.index, buffer))
                self._cond.notify()
        for buffer in self._taken:  # in use maybe: populating changes no byte
            if not self._stop.is_set():
                _populate(buffer.data.data_ptr(), buffer.nbytes)
        if self._stop.is_set():
            return
        self._all_in = True
        if self._when_resident is not None:
            self._when_resident(self)

    def _claim(self) -> Buffer | None:
        """The next buffer nobody began to fault in, for the pre-fault (None: none left)."""
        with self._cond:
            while self._held and not self._waiting and not self._stop.is_set():
                self._cond.wait()
            if self._claimed == self.nbuffers:
                return None
            self._claimed += 1
            return self._all[self._claimed - 1]

    def _take_unfaulted(self) -> Buffer | None:
        """With the condition held and no buffer free: the next buffer the pre-fault has not
        begun, taken as it is (the taker's copies fault its pages in, beside the pre-fault's
        own, on two cores instead of one); None when the pre-fault has begun them all."""
        if self._claimed == self.nbuffers:
            return None
        buffer = self._all[self._claimed]
        self._claimed += 1
        self._unfaulted -= 1
        self._taken.append(buffer)
        return buffer

    @contextlib.contextmanager
    def held_back(self) -> Iterator[None]:
        """While inside: a background pre-fault starts no further buffer (the one under way
        ends), so that a load that never uses the pool (loading/direct_reads.py) has the
        cores and the memory bandwidth to itself; an acquire that waits for a buffer still
        gets one faulted in."""
        with self._cond:
            self._held += 1
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    @property
    def resident(self) -> bool:
        """Every page of the pool is faulted in now: pre-faulted, and a background pre-fault
        has finished (not stopped at exit). False for a pool made without ``prefault``."""
        return self._prefault and not self._stop.is_set() and self._all_in

    def faulted(self) -> None:
        """Return once every page of the pool is faulted in (at once, unless ``background``)."""
        if self._faulter is not None:
            self._faulter.join()

    @property
    def nbytes(self) -> int:
        return self.nbuffers * self.buffer_bytes

    def whole_view(self) -> memoryview:
        """The whole mapping (for registering it with an I/O backend)."""
        return memoryview(self._mapping)

    def acquire(self) -> Buffer:
        """The free buffer of lowest index (so a save's buffers, and their kept views, are the
        same from one save to the next); waits while none is free."""
        with self._cond:
            while not self._free:
                taken = self._take_unfaulted()
                if taken is not None:
                    return taken
                self._wait_for_buffer()
            return heapq.heappop(self._free)[1]

    def _wait_for_buffer(self) -> None:
        """Wait (holding the condition) for a release or a faulted buffer, counted as waiting."""
        self._waiting += 1
        self._cond.notify_all()  # a held-back pre-fault goes on for this waiter
        try:
            self._cond.wait()
        finally:
            self._waiting -= 1

    def acquire_unless(self, ready: Callable[[], bool]) -> Buffer | None:
        """The free buffer of lowest index, waiting while none is free; None as soon as
        ``ready()`` holds instead (checked now and whenever wake() is called: a caller with
        other work, e.g. a completed read, does it rather than wait for a buffer)."""
        with self._cond:
            while not self._free:
                if ready():
                    return None
                self._wait_for_buffer()
            return heapq.heappop(self._free)[1]

    def wake(self) -> None:
        """Wake acquire_unless's waiters to check their ``ready`` again."""
        with self._cond:
            self._cond.notify_all()

    def try_acquire(self) -> Buffer | None:
        """A free buffer, or None at once if every buffer is in use."""
        with self._cond:
            return heapq.heappop(self._free)[1] if self._free else None

    def release(self, buffer: Buffer) -> None:
        with self._cond:
            heapq.heappush(self._free, (buffer.index, buffer))
            self._cond.notify()

    def idle(self) -> bool:
        """No buffer is held by a save or load (those the background pre-fault has not handed
        out yet are held by nobody)."""
        with self._cond:
            return len(self._free) + self._unfaulted == self.nbuffers

    def stop_faulting(self) -> None:
        """Hand out the buffers not yet faulted in as they are (interpreter exit: the
        background pre-fault stops within one buffer's time)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()  # a held-back pre-fault stops waiting

    def close(self) -> None:
        """Drop the pool's references; the memory is freed once no view of it is alive (an
        exception's traceback may still hold one, so the mapping is never force-closed). A
        background pre-fault still running stops within one buffer first."""
        self.stop_faulting()
        self.faulted()
        if not self.idle():
            raise CkptError("StagingPool.close: buffers are still in use by a save or load")
        if self.pinned and self._all:
            torch.cuda.cudart().cudaHostUnregister(self._all[0].data.data_ptr())
            self.pinned = False
        self._all.clear()
        self._free.clear()
        del self._mapping


_faulting: weakref.WeakSet[StagingPool] = weakref.WeakSet()  # pools made with background=True


def _stop_faulting_at_exit() -> None:
    """At interpreter exit, before non-daemon threads are joined: pre-faulting stops (in at most
    one buffer's time), so exit neither waits for it nor finalizes under it."""
    for pool in list(_faulting):
        pool.stop_faulting()


threading._register_atexit(_stop_faulting_at_exit)  # type: ignore[attr-defined]

_mappings: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # every pool mapping of this process
_inherited: list[mmap.mmap] = []  # in a forked child: the parent's, never freed here


def _keep_parents_mappings_in_child() -> None:
    """After a fork, in the child: the parent's pool mappings are not here (MADV_DONTFORK), but
    their Python objects are, and freeing one (the parent's Checkpointers forgotten, collected
    whenever) would unmap its range, where the child may have mapped a pool of its own by then:
    that pool's next copy faulted the child. They are kept for the child's life instead; the
    parent's pre-fault threads are not here either (nothing to stop at the child's exit)."""
    _inherited.extend(_mappings)
    _mappings.clear()
    _faulting.clear()


os.register_at_fork(after_in_child=_keep_parents_mappings_in_child)


def _private_mapping(nbytes: int) -> mmap.mmap:
    """Anonymous memory of this process alone: private pages fault in faster than shared ones
    here (docs/BENCH_LOOP.md, "The first save"), and a child forked later (a DataLoader's
    workers) inherits none of it, so no write into the pool ever copies a page for a child."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    _mappings.add(mapping)
    dontfork = getattr(mmap, "MADV_DONTFORK", None)
    if dontfork is not None and nbytes:
        mapping.madvise(dontfork)
    return mapping


def _populate(address: int, nbytes: int) -> None:
    """Fault in the pages of [address, address + nbytes) (page-aligned), GIL released: by
    madvise(MADV_POPULATE_WRITE) a step at a time (io/pages.py), faster than touching each
    page (docs/BENCH_LIMIT.md, "small states and the first save"); what the kernel refused by
    a plain memset."""
    done = populate(address, nbytes)
    if done < nbytes:
        ctypes.memset(address + done, 0, nbytes - done)


def available_host_bytes() -> int:
    """Host memory the kernel could give without swapping (Linux MemAvailable), else free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _pin(whole: torch.Tensor) -> bool:
    """Page-lock the pool for CUDA (no-op without it). The mapping stays ours; CUDA only pins it."""
    if not torch.cuda.is_available() or whole.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(whole.data_ptr(), whole.numel(), 0)
    if int(err) != 0:  # e.g. a memlock limit: copies still work, only synchronously
        return False
    return True
