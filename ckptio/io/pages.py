"""Faulting pages in ahead of their use, a short step at a time: populate().

The staging pool's pre-fault (io/stage.py) and a memory tier's files mapped ahead
(storage/local/mapped.py) fault their pages in on background threads. One
madvise(MADV_POPULATE_WRITE), or one MAP_POPULATE, over a whole buffer or file holds the
process's address-space lock for as long as its pages take to allocate, and every thread that
maps memory meanwhile waits for it: a new thread's stack, the allocator's large blocks, the
training loop's tensors (a thread started inside a restore waited that long:
docs/BENCH_LOOP.md, "Pages faulted in a step at a time"). populate() asks for POPULATE_STEP
bytes per call, so such a thread waits for one step at most; the GIL is released in each call.

Owns: the step and the call. Does not own: the memory (its callers map and free it).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

__all__ = ["POPULATE_STEP", "populate"]

POPULATE_STEP = 2 << 20  # bytes faulted in per call
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib.madvise


def populate(address: int, nbytes: int) -> int:
    """Fault in the pages of [address, address + nbytes) (page-aligned) for writing, one step
    per call -> the bytes faulted in: short of ``nbytes`` where the kernel refused (it lacks
    MADV_POPULATE_WRITE, or the memory is short), the rest left to the caller."""
    madvise = _madvise()
    for at in range(0, nbytes, POPULATE_STEP):
        if madvise(address + at, min(POPULATE_STEP, nbytes - at), _MADV_POPULATE_WRITE) != 0:
            return at
    return nbytes
