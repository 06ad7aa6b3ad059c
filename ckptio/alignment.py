"""Byte geometry: the block size of ckptio's files and I/O, and every rounding done on it.

Owns: ``BLOCK`` (the O_DIRECT granularity of offsets, lengths, file sizes and buffer addresses),
the item alignment rule (``item_alignment``: a block for items of a block or more, ``SMALL_ALIGN``
below) and the arithmetic on alignments (``align_up``, ``align_down``, ``padding``,
``is_aligned``), by default on ``BLOCK``, and the union of byte ranges (``merged``). Every
other module asks here: no second block constant, no literal block size, no hand-written
rounding (tests/test_structure.py).
Does not own: where items and files go (planning/layout.py), the checksum blocks of an entry
(format/checksum.py), which sizes must be aligned (options.py and the tuners ask ``is_aligned``).
Pure: integers in and out; imports nothing of ckptio.
"""

from __future__ import annotations

__all__ = ["BLOCK", "SMALL_ALIGN", "align_down", "align_up", "is_aligned", "item_alignment",
           "merged", "padding"]

BLOCK = 4096  # O_DIRECT granularity we use for offsets, lengths and buffer addresses
SMALL_ALIGN = 64  # small items: cache-line aligned, so thousands of them waste little space


def align_up(value: int, alignment: int = BLOCK) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (itself when already one)."""
    return (value + alignment - 1) // alignment * alignment


def align_down(value: int, alignment: int = BLOCK) -> int:
    """``value`` rounded down to a multiple of ``alignment``."""
    return value // alignment * alignment


def padding(value: int, alignment: int = BLOCK) -> int:
    """The bytes that take ``value`` up to the next multiple of ``alignment`` (0 when aligned)."""
    return -value % alignment


def is_aligned(value: int, alignment: int = BLOCK) -> bool:
    """Whether ``value`` is a multiple of ``alignment``."""
    return value % alignment == 0


def item_alignment(nbytes: int) -> int:
    """Items of a page or more start on a page (O_DIRECT-readable, mmap-able); smaller ones on 64."""
    return BLOCK if nbytes >= BLOCK else SMALL_ALIGN


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``(lo, hi)`` byte ranges with those that touch or overlap joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
