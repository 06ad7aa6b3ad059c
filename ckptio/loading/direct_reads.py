"""Whole entries read straight into their destinations: a memory tier's restore in one copy.

A store whose files are pages of host memory (StoreFiles.in_memory: a local directory on
tmpfs, the memory tier) is read with buffered reads, which take any address; there the staging
pool's copy is a pass over the bytes that the load can do without. A whole entry that one CPU
tensor wants, contiguous, of the entry's dtype and size, is read by the backend straight into
that tensor's bytes (the kernel's copy out of the tmpfs pages is the one copy) and hashed
there, on the I/O thread that read it. A file this process still maps (a save here wrote it:
the memory tier's Mappings, a rollback's restore) is copied out of that mapping instead, block
by block, each block hashed as it lands (no read, no page faults; a fresh process maps
nothing: mapping a file costs a page-table fill that a read does not pay). Its bytes land
before their check: a mismatch raises CorruptCheckpointError naming the key, as any load's
does, and leaves the destination filled in part (a manager's restore then loads another copy).

Call order (read.py's _read_plain, after planning spans): ``split`` -> ``read`` -> the loop
for the rest. Owns: which spans qualify, their reads and copies, the order errors are raised
in. Does not own: the checks (checks.py), the I/O (the store's backend), the mappings
(storage/local/mapped.py), the spans (read.py).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from ckptio.errors import CorruptCheckpointError
from ckptio.format.types import DTYPE_ITEMSIZE, TensorEntry
from ckptio.io import FileHandle
from ckptio.io.backend_contract import Filled
from ckptio.io.buffers import torch_dtype
from ckptio.loading.checks import Checker
from ckptio.storage.local.mapped import MappedFile
from ckptio.storage.files import StoreFiles

__all__ = ["BATCH_NBYTES", "COPY_NBYTES", "read", "split"]

BATCH_NBYTES = 32 << 20  # bytes of one file one I/O thread reads in one batch
COPY_NBYTES = 512 << 10  # bytes copied out of a mapping at once: hashed while in the cache
_copiers: dict[int, ThreadPoolExecutor] = {}  # pid -> the threads that copy out of mappings
_copiers_lock = threading.Lock()
_PYBUF_WRITE = 0x200
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory  # (address, nbytes, flags): format "B"
_memory_view.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_memory_view.restype = ctypes.py_object


class WholeSpan(Protocol):
    """A whole entry's span (read.py's _Span): its bytes and the tensors they go to."""

    entry: TensorEntry
    offset: int
    nbytes: int
    whole: bool
    dests: list[torch.Tensor]

    @property
    def file(self) -> str: ...

    @property
    def end(self) -> int: ...


def split(source: StoreFiles, spans: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(the spans read straight into their destination, the rest), both in the given order."""
    if not spans or not source.in_memory():
        return [], list(spans)
    direct: list[Any] = []
    rest: list[Any] = []
    for span in spans:
        (direct if _fits(span) else rest).append(span)
    return direct, rest


def _fits(span: WholeSpan) -> bool:
    if not span.whole or len(span.dests) != 1 or span.nbytes == 0 or span.entry.coded:
        return False
    dest, entry = span.dests[0], span.entry
    return (dest.device.type == "cpu" and dest.is_contiguous() and not entry.order
            and dest.dtype == torch_dtype(entry.dtype)
            and dest.numel() * DTYPE_ITEMSIZE[entry.dtype] == entry.nbytes)


def read(source: StoreFiles, spans: Sequence[WholeSpan], checker: Checker) -> int:
    """Read and check every span into its destination, in batches of neighbours of one file
    (StoreFiles.submit_reads: each batch on one I/O thread, each part hashed as it lands); the
    first failure, in batch order, is raised once every batch has finished. -> bytes read."""
    # every destination's bytes first: torch's calls release the GIL, and once reads are in
    # flight their threads would hold each of these calls up
    views = [_bytes_of(s.dests[0], s.nbytes) for s in spans]
    handles: dict[str, FileHandle] = {}
    maps: dict[str, MappedFile | None] = {}
    batches: list[Future[int]] = []
    try:
        for batch in _batches(list(zip(spans, views))):
            file = batch[0][0].file
            if file not in maps:
                maps[file] = source.borrow_mapped(file)
            reads = [(s.offset, v) for s, v in batch]
            entry, each = maps[file], _Checking(batch, checker).each
            if entry is not None:
                batches.append(_copier().submit(_copy_each, entry, reads, each))
                continue
            if file not in handles:
                handles[file] = source.open_read(file, cached=True)
            batches.append(source.submit_reads(handles[file], reads, each))
    finally:
        errors = [f.exception() for f in batches]  # every read over before its file closes
        for fh in handles.values():
            source.close(fh, sync=False)
        for borrowed in maps.values():
            if borrowed is not None:
                source.release_mapped(borrowed)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return sum(span.nbytes for span in spans)


def _copier() -> ThreadPoolExecutor:
    """The threads that copy out of mappings (as many as the I/O backend's by default),
    made at this process's first such copy (a forked child has none of its parent's)."""
    with _copiers_lock:
        pid = os.getpid()
        if pid not in _copiers:
            _copiers.clear()
            _copiers[pid] = ThreadPoolExecutor(min(4, os.cpu_count() or 1),
                                               thread_name_prefix="ckptio-copy")
        return _copiers[pid]


def _copy_each(source: MappedFile, reads: Sequence[tuple[int, memoryview]],
               each: Filled) -> int:
    """backend_contract.BatchReads.submit_reads' work out of a mapping: every read in order,
    COPY_NBYTES at a time, ``each`` after each (the block still in the core's cache); a read
    past the file's end stops there and ``each`` sees it short. -> bytes copied."""
    total = 0
    for i, (offset, into) in enumerate(reads):
        want = min(len(into), max(0, source.nbytes - offset))
        to = ctypes.addressof(ctypes.c_char.from_buffer(into)) if len(into) else 0
        done = 0
        while done < want:
            n = min(COPY_NBYTES, want - done)
            ctypes.memmove(to + done, source.address + offset + done, n)  # frees the GIL
            done += n
            each(i, done, done == len(into))
        if done < len(into) or not into:
            each(i, done, True)
        total += done
    return total


def _bytes_of(dest: torch.Tensor, nbytes: int) -> memoryview:
    """The ``nbytes`` of contiguous CPU tensor ``dest`` as writable bytes, made from its address
    (one C call, where a view through numpy took five per tensor, and a ctypes array made a new
    type for each size it had not seen); the span holds ``dest``, and read() returns only once
    every read into it has ended."""
    return _memory_view(dest.data_ptr(), nbytes, _PYBUF_WRITE)



def _batches(pairs: list[tuple[WholeSpan, memoryview]]) -> list[list[tuple[WholeSpan, memoryview]]]:
    """The spans by file and offset, cut into runs of about BATCH_NBYTES of one file."""
    out: list[list[tuple[WholeSpan, memoryview]]] = []
    size = 0
    for pair in sorted(pairs, key=lambda p: (p[0].file, p[0].offset)):
        if not out or out[-1][0][0].file != pair[0].file or size >= BATCH_NBYTES:
            out.append([])
            size = 0
        out[-1].append(pair)
        size += pair[0].nbytes
    return out


class _Checking:
    """A batch's checks, on the I/O thread that reads it: each part as it lands."""

    def __init__(self, batch: list[tuple[WholeSpan, memoryview]], checker: Checker) -> None:
        self.batch, self.checker = batch, checker
        self.seen = [0] * len(batch)

    def each(self, i: int, filled: int, last: bool) -> None:
        span, view = self.batch[i]
        if last and filled < span.nbytes:
            raise CorruptCheckpointError(
                f"data file {self.checker.path(span.entry)} is truncated: wanted bytes "
                f"[{span.offset}, {span.end}), file ends at {'' if filled else 'or before '}"
                f"{span.offset + filled}; the checkpoint is damaged: load an earlier one")
        self.checker.whole(span, view[self.seen[i]:filled], last=last)
        self.seen[i] = filled
