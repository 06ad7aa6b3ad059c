"""io/pages.populate: pages faulted in a step at a time (the pool's pre-fault and a memory
tier's mapped files), every page of the range resident after it, none beyond; a range the
kernel refuses is said (the bytes done), never raised."""

from __future__ import annotations

import ctypes
import mmap

from ckptio.io.pages import POPULATE_STEP, populate

PAGE = mmap.PAGESIZE


def _resident(address: int, nbytes: int) -> list[bool]:
    """Whether each page of [address, address + nbytes) is in memory (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = (nbytes + PAGE - 1) // PAGE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(address, nbytes, vec) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in vec.raw]


def test_every_page_of_the_range_and_none_beyond_is_faulted_in() -> None:
    nbytes = 2 * POPULATE_STEP + 3 * PAGE  # steps and a short last one
    area = mmap.mmap(-1, nbytes + 4 * PAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    try:
        assert not any(_resident(address, nbytes + 4 * PAGE))
        assert populate(address, nbytes) == nbytes
        resident = _resident(address, nbytes + 4 * PAGE)
        assert all(resident[:nbytes // PAGE]) and not any(resident[nbytes // PAGE:])
    finally:
        del address
        area.close()


def test_a_range_the_kernel_refuses_is_said_not_raised() -> None:
    """A read-only mapping cannot take a write fault: 0 bytes done, for the caller to finish
    (the pool's pre-fault then touches the pages itself)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    readonly = libc.mmap(None, 4 * PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                         -1, 0)
    try:
        assert populate(readonly, 4 * PAGE) == 0
    finally:
        libc.munmap(readonly, 4 * PAGE)
