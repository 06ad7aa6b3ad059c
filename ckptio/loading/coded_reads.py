"""Reads of version 4 entries (compressed, referenced, XOR deltas): decode only the frames a
region needs, check them, copy the region out.

A Read that involves such an entry (read.py hands them here) is served frame by frame through
an EntryReader (storage/entry_reader.py): a whole entry decodes all its frames (and, when verifying
with ``check_blocks``, checks its whole checksum too); a resharded region is cut into pieces
(reshard.plan_reads) and, per stored entry, only the frames covering its pieces are read,
decoded and checked before a byte of them is copied. Plain entries of the same Read are read
through the same reader. Reads run ``threads`` at a time (Options.compress_threads).

Owns: frames wanted per Read, copying them into destinations. Does not own: reading and
decoding frames (storage/entry_reader.py), piece arithmetic (reshard.py), plain reads (read.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from ckptio.errors import CorruptCheckpointError
from ckptio.format.checksum import TREE, new_hasher, whole_from_blocks
from ckptio.format.types import DTYPE_ITEMSIZE, Read, TensorEntry
from ckptio.io.buffers import copy_in, torch_dtype
from ckptio.planning.reshard import Piece, execute, plan_reads, region_of, stored_from_entry
from ckptio.storage.entry_reader import EntryReader

__all__ = ["is_coded", "read_coded"]

MAX_PIECE = 1 << 62  # pieces are cut by frames here, not by buffers
GROUP = 8  # frames of a whole entry per task: decoding overlaps reading, on every thread


def is_coded(read: Read) -> bool:
    """Whether a read involves an entry that takes decoding or a base checkpoint."""
    return any(e.coded for e in read.entries)


def read_coded(reader: EntryReader, reads: Sequence[Read], *, check_blocks: bool,
               threads: int = 1) -> int:
    """Fill each read's destination (None: read and check only), ``threads`` tasks at a time
    (each reads, decodes and checks frames: zstd, numpy, hashing and I/O release the GIL; a
    whole entry is cut into runs of GROUP frames, unless ``check_blocks`` checks it whole).
    -> logical bytes read."""
    tasks: list[Callable[[], int]] = []
    reader.plan([r.whole for r in reads
                 if r.whole is not None and r.whole.nbytes <= GROUP * reader.block_nbytes])
    for read in reads:
        entry = read.whole
        if entry is None:
            tasks.append(functools.partial(_region, reader, read))
        elif check_blocks or entry.nbytes <= GROUP * reader.block_nbytes:
            tasks.append(functools.partial(_whole, reader, entry, read.dest, check_blocks))
        else:
            frames = -(-entry.nbytes // reader.block_nbytes)
            tasks.extend(functools.partial(_run_of, reader, entry, read.dest, first,
                                           min(first + GROUP, frames))
                         for first in range(0, frames, GROUP))

    def one(task: Callable[[], int]) -> int:
        with torch.no_grad():
            return task()

    if threads <= 1 or len(tasks) <= 1:
        return sum(one(task) for task in tasks)
    with ThreadPoolExecutor(threads, thread_name_prefix="ckptio-decode") as pool:
        futures = [pool.submit(one, task) for task in tasks]
        try:
            return sum(f.result() for f in futures)
        finally:
            for f in futures:  # the first error is raised; none is left running
                f.cancel()


def _whole(reader: EntryReader, entry: TensorEntry, dest: torch.Tensor | None,
           check_blocks: bool) -> int:
    frames = -(-entry.nbytes // reader.block_nbytes)
    data = reader.frames(entry, 0, frames)
    if check_blocks and reader.algorithm is not None and entry.blocks:
        if reader.algorithm == TREE:  # the frames matched their blocks: no byte hashed again
            whole = whole_from_blocks(reader.algorithm, entry.blocks)
        else:
            hasher = new_hasher(reader.algorithm)
            hasher.update(memoryview(data))
            whole = hasher.hexdigest()
        if whole != entry.checksum:
            raise CorruptCheckpointError(
                f"key {entry.key!r} in {reader.files.where(entry.file)}: its frames match their "
                f"block checksums but not the entry's checksum {entry.checksum}. The manifest is "
                "damaged; load an earlier checkpoint")
    if dest is not None and entry.nbytes:
        src = torch.frombuffer(data, dtype=torch_dtype(entry.dtype))
        copy_in(src, dest, 0, src.numel())
    return entry.nbytes


def _run_of(reader: EntryReader, entry: TensorEntry, dest: torch.Tensor | None, first: int,
            last: int) -> int:
    """Frames ``[first, last)`` of a whole entry, checked, into their elements of ``dest``."""
    data = reader.frames(entry, first, last)
    if dest is not None:
        src = torch.frombuffer(data, dtype=torch_dtype(entry.dtype))
        start = first * reader.block_nbytes // DTYPE_ITEMSIZE[entry.dtype]
        copy_in(src, dest, start, src.numel())
    return len(data)


def _region(reader: EntryReader, read: Read) -> int:
    head = read.entries[0]
    try:
        pieces = plan_reads([stored_from_entry(e) for e in read.entries], region_of(read.region),
                            head.shape, DTYPE_ITEMSIZE[head.dtype], MAX_PIECE)
    except ValueError as exc:
        raise CorruptCheckpointError(f"key {read.key!r}: {exc}") from None
    per_entry: dict[int, list[Piece]] = {}
    for piece in pieces:
        per_entry.setdefault(piece.source, []).append(piece)
    nbytes = 0
    for source, of_entry in per_entry.items():
        nbytes += _pieces(reader, read.entries[source], of_entry, read.dest)
    return nbytes


def _pieces(reader: EntryReader, entry: TensorEntry, pieces: list[Piece],
            dest: torch.Tensor | None) -> int:
    """The frames of ``entry`` that cover ``pieces``, read once, copied into ``dest``."""
    b = reader.block_nbytes
    lo = min(p.offset - entry.offset for p in pieces)
    hi = max(p.offset - entry.offset + p.nbytes for p in pieces)
    first, last = lo // b, -(-hi // b)
    data = reader.frames(entry, first, last)
    if dest is not None:
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        dtype = torch_dtype(entry.dtype)
        for piece in pieces:
            at = piece.offset - entry.offset - first * b
            execute(piece, raw[at:at + piece.nbytes].view(dtype), dest)
    return len(data)
