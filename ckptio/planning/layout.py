"""Where bytes go: pack write items into a few large files at aligned offsets, and coalesce the
byte extents a load needs into a few large aligned reads.

Owns: the file-splitting rule, data file names and read coalescing (the one loop every load's
reads go through, and how far it reads through a gap: ``MAX_GAP``, or ``read_gap`` for a
probe of a format's framing).
Does not own: the block size and alignment rule (ckptio/alignment.py), which extents a load
needs or how they are verified (loading/read.py).
Pure: dataclasses in, dataclasses out; no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from ckptio.alignment import align_down, align_up, item_alignment
from ckptio.format.types import FileLayout, Placement, ReadRange, WriteItem

__all__ = ["Extent", "MAX_GAP", "PROBE_GAP", "coalesce_reads", "data_file_name", "plan_files",
           "read_gap"]

MAX_GAP = 512 << 10  # a load reads through gaps up to this size rather than issue another request
PROBE_GAP = 0  # a probe of local files: the blocks it asks for, neighbours joined, no gap read


def read_gap(*, probe: bool, direct_io: bool, remote: bool) -> int:
    """How far the reads of one pass read through a gap between the extents they want.

    A data pass: ``MAX_GAP``. A probe (a foreign format's framing read before its data: a DCP
    item's head and tail, a torch.save record's header) of a store read with O_DIRECT
    (``direct_io``) and not across a network: ``PROBE_GAP``. There the bytes between (the
    items' data) are read again by the data pass, not from the page cache, so reading through
    them read a directory of small items twice, and a request costs less than those bytes. On
    an object store (``remote``) a request costs more than the bytes through a gap: ``MAX_GAP``
    there, and on any other store (the memory tier, a user's store), as before."""
    return PROBE_GAP if probe and direct_io and not remote else MAX_GAP


def data_file_name(save_id: str, rank: int, index: int) -> str:
    return f"data-{save_id}-r{rank:05d}-{index:04d}.bin"


def plan_files(
    items: Sequence[WriteItem], *, save_id: str, rank: int, max_file_bytes: int
) -> tuple[FileLayout, ...]:
    """Place items in order; start a new file when the next item would pass max_file_bytes.

    Every file's size is padded to BLOCK so the last O_DIRECT write is whole. The placements of
    the last items seen are kept: a save of an unchanged layout (the same items) only names its
    files anew.
    """
    global _last_placed
    items = tuple(items)
    last = _last_placed
    if last is not None and last[0] == max_file_bytes and last[1] == items:
        return tuple(FileLayout(data_file_name(save_id, rank, index), nbytes, placements)
                     for index, (nbytes, placements) in enumerate(last[2]))
    files = _place(items, save_id=save_id, rank=rank, max_file_bytes=max_file_bytes)
    _last_placed = (max_file_bytes, items, tuple((f.nbytes, f.placements) for f in files))
    return files


# (max_file_bytes, items, (file nbytes, placements) per file) of the last plan_files call
_last_placed: tuple[int, tuple[WriteItem, ...], tuple[tuple[int, tuple[Placement, ...]], ...]] | None = None


def _place(items: Sequence[WriteItem], *, save_id: str, rank: int,
           max_file_bytes: int) -> tuple[FileLayout, ...]:
    files: list[FileLayout] = []
    placements: list[Placement] = []
    end = 0
    for item in items:
        offset = align_up(end, item_alignment(item.nbytes))
        if placements and offset + item.nbytes > max_file_bytes:
            files.append(_close(save_id, rank, len(files), end, placements))
            placements, offset = [], 0
        placements.append(Placement(item, offset))
        end = offset + item.nbytes
    if placements:
        files.append(_close(save_id, rank, len(files), end, placements))
    return tuple(files)


def _close(save_id: str, rank: int, index: int, end: int, placements: list[Placement]) -> FileLayout:
    name = data_file_name(save_id, rank, index)
    return FileLayout(name=name, nbytes=align_up(end), placements=tuple(placements))


class Extent(Protocol):
    """Bytes [offset, offset + nbytes) of one data file a load needs: a stored entry (TensorEntry),
    or a part of one."""

    @property
    def file(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


E = TypeVar("E", bound=Extent)


@dataclass
class _OpenRange(Generic[E]):
    file: str
    start: int
    end: int
    entries: list[E] = field(default_factory=list)

    def freeze(self) -> ReadRange[E]:
        return ReadRange(self.file, self.start, self.end - self.start, tuple(self.entries))

    def add(self, extent: E, stop: int) -> None:
        self.end = max(self.end, stop)
        if not self.entries or self.entries[-1] is not extent:
            self.entries.append(extent)


def _never(_extent: Extent) -> bool:
    return False


def coalesce_reads(extents: Iterable[E], *, max_read: int, max_gap: int,
                   in_one_read: Callable[[E], bool] = _never) -> list[ReadRange[E]]:
    """Cover every non-empty extent with BLOCK-aligned reads of at most ``max_read`` bytes.

    Neighbouring extents (gap <= max_gap) share a read. An extent larger than max_read spans
    several consecutive reads, unless ``in_one_read(extent)``: such an extent is never split (a
    read that cannot take it whole ends before it), and one larger than max_read gets one read of
    its own, larger than max_read. Reads come out sorted by (file, offset).
    """
    ranges: list[ReadRange[E]] = []
    current: _OpenRange[E] | None = None
    for extent in sorted(extents, key=lambda e: (e.file, e.offset)):
        pos, end = extent.offset, extent.offset + extent.nbytes
        unsplit = in_one_read(extent)
        while pos < end:
            if current is None or not _joins(current, extent.file, pos, end, unsplit, max_read,
                                             max_gap):
                if current is not None:
                    ranges.append(current.freeze())
                start = align_down(pos)
                current = _OpenRange(extent.file, start, start)
            stop = align_up(end)
            if not unsplit:
                stop = min(stop, current.start + max_read)
            current.add(extent, stop)
            pos = stop
    if current is not None:
        ranges.append(current.freeze())
    return ranges


def _joins(current: _OpenRange[E], file: str, pos: int, end: int, unsplit: bool,
           max_read: int, max_gap: int) -> bool:
    """Whether bytes from ``pos`` (up to ``end``: all of them when ``unsplit``) go into
    ``current``."""
    if current.file != file or pos > current.end + max_gap:
        return False
    if unsplit:
        return align_up(end) - current.start <= max_read
    return current.start + max_read > max(pos, current.end)
