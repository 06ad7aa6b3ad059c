"""Where bytes go: pack write items into a few large files at aligned offsets, and coalesce the
entries a load needs into a few large aligned reads.

Owns: the alignment rule, the file-splitting rule, data file names and read coalescing.
Pure: dataclasses in, dataclasses out; no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ckptio.options import BLOCK
from ckptio.format.types import FileLayout, Placement, ReadRange, TensorEntry, WriteItem

SMALL_ALIGN = 64  # small items: cache-line aligned, so thousands of them waste little space


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def align_down(value: int, alignment: int) -> int:
    return value // alignment * alignment


def item_alignment(nbytes: int) -> int:
    """Items of a page or more start on a page (O_DIRECT-readable, mmap-able); smaller ones on 64."""
    return BLOCK if nbytes >= BLOCK else SMALL_ALIGN


def data_file_name(save_id: str, rank: int, index: int) -> str:
    return f"data-{save_id}-r{rank:05d}-{index:04d}.bin"


def plan_files(
    items: Sequence[WriteItem], *, save_id: str, rank: int, max_file_bytes: int
) -> tuple[FileLayout, ...]:
    """Place items in order; start a new file when the next item would pass max_file_bytes.

    Every file's size is padded to BLOCK so the last O_DIRECT write is whole.
    """
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
    return FileLayout(name=name, nbytes=align_up(end, BLOCK), placements=tuple(placements))


@dataclass
class _OpenRange:
    file: str
    start: int
    end: int
    entries: list[TensorEntry] = field(default_factory=list)

    def freeze(self) -> ReadRange:
        return ReadRange(self.file, self.start, self.end - self.start, tuple(self.entries))


def coalesce_reads(
    entries: Iterable[TensorEntry], *, max_read: int, max_gap: int
) -> list[ReadRange]:
    """Cover every non-empty entry with BLOCK-aligned reads of at most ``max_read`` bytes.

    Neighbouring entries (gap <= max_gap) share a read; an entry larger than max_read spans
    several consecutive reads. Reads come out sorted by (file, offset).
    """
    ranges: list[ReadRange] = []
    current: _OpenRange | None = None
    for entry in sorted(entries, key=lambda e: (e.file, e.offset)):
        pos, end = entry.offset, entry.offset + entry.nbytes
        while pos < end:
            if not (
                current is not None
                and current.file == entry.file
                and pos <= current.end + max_gap
                and current.start + max_read > max(pos, current.end)
            ):
                if current is not None:
                    ranges.append(current.freeze())
                start = align_down(pos, BLOCK)
                current = _OpenRange(entry.file, start, start)
            stop = min(align_up(end, BLOCK), current.start + max_read)
            current.end = max(current.end, stop)
            if not current.entries or current.entries[-1] is not entry:
                current.entries.append(entry)
            pos = stop
    if current is not None:
        ranges.append(current.freeze())
    return ranges
