"""Coalesced reads of the small entries of a load: the byte ranges a load will read, grouped
per file into spans of up to ``SPAN`` bytes, each span fetched by one read (on an object store:
one ranged GET instead of one per entry), a few spans ahead of the decoding threads.

``Spans.plan`` takes the ranges in the order they will be read; ``Spans.take`` returns the bytes
of a planned range (fetching its span, and the next ``AHEAD`` spans, on first use), or None for a
range that was not planned (the caller reads it itself). A span is let go once every range in
it was taken. Owns: the grouping, the fetches, the truncation check of a span. Does not own:
which ranges an entry needs or decoding them (storage/entry_reader.py).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ckptio.alignment import align_down, align_up
from ckptio.errors import CorruptCheckpointError
from ckptio.io.backend_contract import FileHandle
from ckptio.storage.files import StoreFiles

__all__ = ["AHEAD", "GAP", "SPAN", "Range", "Spans"]

SPAN = 8 << 20  # bytes a span covers at most (a range of more is not planned)
GAP = 1 << 20  # unread bytes a span may cover between two ranges
AHEAD = 4  # spans fetched ahead of the one first needed

Range = tuple[StoreFiles, str, int, int]  # files, file name, offset, nbytes


@dataclass
class _Span:
    files: StoreFiles
    name: str
    start: int
    end: int
    left: int = 0  # planned ranges not yet taken
    read: Future[int] | None = None
    buffer: mmap.mmap | None = None
    ranges: list[tuple[int, int]] = field(default_factory=list)


class Spans:
    """The planned spans of one reader (thread-safe)."""

    def __init__(self, handle: Callable[[StoreFiles, str], FileHandle]) -> None:
        self._handle = handle
        self._order: list[_Span] = []
        self._at: dict[tuple[int, str, int, int], int] = {}
        self._lock = threading.Lock()

    def plan(self, ranges: list[Range]) -> None:
        """Group ``ranges`` (in reading order) into spans; a range already planned is skipped."""
        open_: dict[tuple[int, str], int] = {}
        with self._lock:
            for files, name, offset, nbytes in ranges:
                key = (id(files), name, offset, nbytes)
                if nbytes <= 0 or nbytes > SPAN or key in self._at:
                    continue
                index = open_.get(key[:2])
                span = self._order[index] if index is not None else None
                if (span is None or index is None or offset < span.end
                        or offset - span.end > GAP or offset + nbytes - span.start > SPAN):
                    index = open_[key[:2]] = len(self._order)
                    span = _Span(files, name, offset, offset)
                    self._order.append(span)
                span.end = max(span.end, offset + nbytes)
                span.left += 1
                self._at[key] = index

    def take(self, files: StoreFiles, name: str, offset: int, nbytes: int) -> memoryview | None:
        """The bytes of a planned range (None: not planned)."""
        with self._lock:
            index = self._at.pop((id(files), name, offset, nbytes), None)
            if index is None:
                return None
            span = self._order[index]
            for ahead in self._order[index:index + 1 + AHEAD]:
                self._submit(ahead)
            buffer, read = span.buffer, span.read
            span.left -= 1
            if span.left == 0:
                span.buffer = None
        assert buffer is not None and read is not None  # internal: submitted above
        start = align_down(span.start)
        got = read.result()
        if got < offset + nbytes - start:
            raise CorruptCheckpointError(
                f"data file {files.where(name)} is truncated: it needs bytes [{offset}, "
                f"{offset + nbytes}), the file ends at {start + got}; load an earlier checkpoint")
        return memoryview(buffer)[offset - start:offset - start + nbytes]

    def _submit(self, span: _Span) -> None:
        if span.read is not None or span.left == 0:
            return
        start, end = align_down(span.start), align_up(span.end)
        span.buffer = mmap.mmap(-1, end - start)  # page-aligned: fit for O_DIRECT
        fh = self._handle(span.files, span.name)
        span.read = span.files.submit_read(fh, start, memoryview(span.buffer))
