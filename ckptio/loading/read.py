"""Load data path: every load's reads, whole entries and resharded regions alike, in one pass.

A load hands over Reads (format/types.py): a region of a global tensor, the stored chunks that
hold it, a destination. Each becomes spans of stored entries, the unit one checksum covers.

Call order: ``read_regions`` (version 4 entries through loading/coded_reads.py) ->
``plan_spans`` (span_plan.py: whole entries as one span, other regions as pieces widened to whole
checksum blocks) -> one coalescing (layout.coalesce_reads: neighbours within the caller's gap,
MAX_GAP or layout.read_gap's for a probe, share one aligned read of up to a pool buffer) -> one
read-ahead loop over the staging pool (``_run``: what is checked where, and in what order) ->
bytes checked, then copied into the destinations. Partly wanted checksum blocks go through
the page cache, or come from memory where the load holds them (``known``: received from
another rank; shared_blocks.py).

Owns: the read-ahead loop, truncation checks, copying into destinations. Does not own: Reads ->
spans (span_plan.py), the checksum comparisons (checks.py), which regions are wanted (matching.py,
fill_plan.py), the piece arithmetic (reshard.py), coalescing (layout.py), the files (opened by
name through the store's StoreFiles, storage/files.py), the I/O (io) or how one read is cut
into direct and cached parts (shared_blocks.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ckptio.alignment import align_up
from ckptio.distributed.readshare import Known
from ckptio.errors import CorruptCheckpointError
from ckptio.format.types import DTYPE_ITEMSIZE, Chunk, Read, ReadRange
from ckptio.io import FileHandle
from ckptio.io.buffers import Buffer, copy_in, move_in, torch_dtype, typed
from ckptio.io.stage import StagingPool
from ckptio.loading import direct_reads
from ckptio.loading.checks import Checker
from ckptio.loading.coded_reads import is_coded, read_coded
from ckptio.loading.shared_blocks import Seen, submit_parts
from ckptio.loading.span_plan import Span, in_one_read, plan_spans
from ckptio.planning.layout import MAX_GAP, coalesce_reads
from ckptio.planning.reshard import execute
from ckptio.storage.entry_reader import EntryReader
from ckptio.storage.files import StoreFiles

__all__ = ["read_regions"]

# ------------------------------------------------------------------------------------------------
# the read-ahead loop


def read_regions(source: StoreFiles, reads: Sequence[Read], *, pool: StagingPool,
                 algorithm: str | None, block_nbytes: int, depth: int,
                 check_blocks: bool = False, coded: EntryReader | None = None,
                 known: Known | None = None, max_gap: int = MAX_GAP) -> int:
    """Fill every read's destination from the data files of ``source``. ``algorithm`` None
    skips verification; ``block_nbytes``: the manifest's; ``check_blocks`` (verify): whole
    entries' block checksums are checked too. Reads of version 4 entries (compressed,
    references, XOR deltas) go through ``coded`` (loading/coded_reads.py). ``known``: stored
    bytes the load holds already (checksum blocks another rank sent), not read again;
    ``max_gap``: how far a read reads through a gap (layout.read_gap). -> bytes read from
    storage."""
    nbytes = 0
    if any(is_coded(r) for r in reads):
        if coded is None:
            raise CorruptCheckpointError(
                f"{source.location}: a compressed or delta entry where none is expected (a "
                "foreign checkpoint's manifest cannot hold one)")
        nbytes = read_coded(coded, [r for r in reads if is_coded(r)], check_blocks=check_blocks,
                            threads=coded.threads)
        reads = [r for r in reads if not is_coded(r)]
    return nbytes + _read_plain(source, reads, pool=pool, algorithm=algorithm,
                                block_nbytes=block_nbytes, depth=depth,
                                check_blocks=check_blocks, known=known, max_gap=max_gap)


def _read_plain(source: StoreFiles, reads: Sequence[Read], *, pool: StagingPool,
                algorithm: str | None, block_nbytes: int, depth: int,
                check_blocks: bool, known: Known | None, max_gap: int) -> int:
    reads, permuted = _in_stored_order(reads)
    spans = plan_spans(reads, block_nbytes, pool.buffer_bytes)
    checker = Checker(source, algorithm, block_nbytes, check_blocks)
    for span in spans:
        if span.whole and span.nbytes == 0:  # no read covers it
            checker.whole(span, memoryview(b""), last=True)
    direct, spans = direct_reads.split(source, spans)  # a memory tier's: no staging copy
    nbytes = 0
    if direct:
        with pool.held_back():  # its pre-fault (for later saves) waits: these reads need no pool
            nbytes = direct_reads.read(source, direct, checker)
    ranges = coalesce_reads(spans, max_read=pool.buffer_bytes, max_gap=max_gap,
                            in_one_read=in_one_read)
    nbytes += _run(ranges, pool, source, depth, checker, known)
    with torch.no_grad():
        for read, staged in permuted:
            read.dest.copy_(_permuted_back(read, staged))
    return nbytes


def _in_stored_order(reads: Sequence[Read]) -> tuple[Sequence[Read],
                                                     list[tuple[Read, torch.Tensor]]]:
    """``reads``, each read of an entry whose bytes lie in another dim order
    (``TensorEntry.order``: a DCP or torch.save tensor saved transposed, always the whole
    tensor) replaced by a read of the whole entry into a new tensor in that order; and, for
    each, (the read, that tensor), to copy its region once the bytes are in."""
    if not any(e.order for read in reads for e in read.entries):
        return reads, []
    out: list[Read] = []
    permuted: list[tuple[Read, torch.Tensor]] = []
    for read in reads:
        entry = read.entries[0]
        if not entry.order or read.dest is None:
            out.append(read)
            continue
        stored = dataclasses.replace(entry, shape=entry.stored_shape,
                                     chunk=Chunk.whole(entry.stored_shape), order=())
        staged = torch.empty(stored.shape, dtype=torch_dtype(entry.dtype))
        out.append(Read(read.key, (stored,), stored.chunk, staged))
        permuted.append((read, staged))
    return out, permuted


def _permuted_back(read: Read, staged: torch.Tensor) -> torch.Tensor:
    """The region ``read`` wants of its entry's tensor, read in its stored order into
    ``staged``."""
    order = read.entries[0].order
    logical = staged.permute(tuple(order.index(d) for d in range(len(order))))
    region = read.region
    if region.flat:  # (a copy in row-major order, made now that the bytes are in)
        return logical.reshape(-1)[region.offsets[0]:region.offsets[0] + region.sizes[0]]
    return logical[tuple(slice(o, o + n) for o, n in zip(region.offsets, region.sizes))]


@dataclass
class _InFlight:
    """A submitted read, the buffer it fills and the pool that buffer came from (its own pool
    when the read is larger than a pool buffer: closed on release); ``applied``: for a read
    whose spans all check on their own, its check and copy, run by the I/O thread that read it
    (None: the loop applies it, in order)."""

    range: ReadRange[Span]
    pool: StagingPool
    own: bool
    buffer: Buffer
    future: Future[int]
    held: int = 0  # of its bytes, those storage did not serve (from memory, cached again)
    applied: Future[int] | None = None

    def done(self) -> Future[int]:
        """What must finish before the buffer is reused."""
        return self.applied if self.applied is not None else self.future

    def release(self) -> None:
        _give_back(self.pool, self.own, self.buffer)


def _give_back(pool: StagingPool, own: bool, buffer: Buffer) -> None:
    pool.release(buffer)
    if own:
        pool.close()


def _run(ranges: list[ReadRange[Span]], pool: StagingPool, source: StoreFiles, depth: int,
         checker: Checker, known: Known | None = None) -> int:
    """Keep up to ``2 * depth`` reads in flight (and no more than the pool has buffers). A read
    whose spans all check on their own is checked and copied out by the I/O thread that read it,
    where its bytes are hot and beside the other reads (both cores of a one-process load busy,
    not one); any other (a whole entry hashed across
    several reads) is applied here, in order. While the oldest read is done (applied, for the
    former), it is taken rather than a buffer waited for (a pool still being faulted in hands
    its buffers out one by one). The first failure, in read order, is raised once every read in
    flight has finished. -> bytes read."""
    todo = deque(ranges)
    handles: dict[tuple[str, bool], FileHandle] = {}  # (file, cached) -> its handle
    seen = Seen()  # parts read through the cache: read again, not counted again
    pending: deque[_InFlight] = deque()
    ahead = max(1, min(pool.nbuffers, 2 * depth))
    stop = threading.Event()  # set on a failure: reads still in flight skip their copies
    nbytes = 0
    try:
        while todo or pending:
            while todo and len(pending) < ahead:
                flight = _submit(todo[0], handles, pool, source, checker, stop,
                                 pending[0].done().done if pending else None, known, seen)
                if flight is None:
                    break
                todo.popleft()
                pending.append(flight)
            flight = pending.popleft()
            try:
                if flight.applied is not None:
                    flight.applied.result()
                else:
                    _apply(flight.range, flight.buffer, flight.future.result(), checker)
                nbytes += flight.range.nbytes - flight.held
            finally:
                flight.release()
    finally:
        stop.set()
        for flight in pending:
            flight.done().exception()  # the read (and its copy) must finish before reuse
            flight.release()
        for fh in handles.values():
            source.close(fh, sync=False)
    return nbytes


def _submit(rng: ReadRange[Span], handles: dict[tuple[str, bool], FileHandle], pool: StagingPool,
            source: StoreFiles, checker: Checker, stop: threading.Event,
            ready: Callable[[], bool] | None, known: Known | None,
            seen: Seen) -> _InFlight | None:
    """Submit ``rng``'s read into a free buffer; None, submitting nothing, if ``ready()`` (the
    oldest read in flight is done) holds before a buffer is free."""
    own = rng.nbytes > pool.buffer_bytes  # a block span larger than a buffer
    buffers = StagingPool(1, align_up(rng.nbytes), prefault=False) if own else pool
    buffer = buffers.acquire() if ready is None or own else buffers.acquire_unless(ready)
    if buffer is None:
        return None
    try:
        future, held = submit_parts(source, handles, rng, buffer.view[:rng.nbytes],
                                    checker.block_nbytes, known, seen)
    except BaseException:
        _give_back(buffers, own, buffer)
        raise
    flight = _InFlight(rng, buffers, own, buffer, future, held)
    if checker.on_io_threads and _checks_alone(rng):
        applied: Future[int] = Future()
        flight.applied = applied
        future.add_done_callback(lambda read: _apply_there(flight, applied, read, checker, stop))
    flight.done().add_done_callback(lambda _done: pool.wake())  # acquire_unless checks again
    return flight


def _checks_alone(rng: ReadRange[Span]) -> bool:
    """Whether every span of the read is checked within it: block spans and whole entries that
    lie inside it (not a whole entry hashed across several reads)."""
    end = rng.offset + rng.nbytes
    return all(not s.whole or (s.offset >= rng.offset and s.end <= end)
               for s in rng.entries)


def _apply_there(flight: _InFlight, applied: Future[int], read: Future[int], checker: Checker,
                 stop: threading.Event) -> None:
    """``_apply`` on the thread that completed ``read``; its outcome goes to ``applied``."""
    try:
        got = read.result()
        if not stop.is_set():
            with torch.no_grad():  # thread-local: destinations may require grad
                _apply(flight.range, flight.buffer, got, checker)
    except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it in order
        applied.set_exception(exc)
    else:
        applied.set_result(got)


def _apply(rng: ReadRange[Span], buffer: Buffer, got: int, checker: Checker) -> None:
    """Check and copy out each span's part of a completed read of ``got`` bytes."""
    for span in rng.entries:
        lo, hi = max(span.offset, rng.offset), min(span.end, rng.offset + rng.nbytes)
        if rng.offset + got < hi:
            raise CorruptCheckpointError(
                f"data file {checker.path(span.entry)} is truncated: wanted bytes [{lo}, {hi}), "
                f"file ends at {'' if got else 'or before '}{rng.offset + got}; the checkpoint "
                "is damaged: load an earlier one")
        start = lo - rng.offset
        view = buffer.view[start:start + hi - lo]
        if span.whole:  # checked before the copy: an entry within one read never lands corrupt
            checker.whole(span, view, last=hi == span.end)
            _copy_whole(span, buffer, start, lo, hi)
        else:
            checker.blocks(span, view)
            _copy_pieces(span, buffer.data[start:start + hi - lo])


def _copy_whole(span: Span, buffer: Buffer, start: int, lo: int, hi: int) -> None:
    """File bytes [lo, hi) of a whole entry, at ``start`` of the buffer, into its destinations."""
    if not span.dests:
        return
    entry = span.entry
    itemsize = DTYPE_ITEMSIZE[entry.dtype]
    at = lo - entry.offset
    if at % itemsize or (hi - lo) % itemsize:  # a misaligned entry cut by a read boundary
        for dest in span.dests:  # contiguous (in_one_read): its bytes, in order
            dest.reshape(-1).view(torch.uint8)[at:at + hi - lo].copy_(
                buffer.data[start:start + hi - lo])
        return
    dtype = torch_dtype(entry.dtype)
    src = None
    for dest in span.dests:
        if not move_in(buffer, start, hi - lo, dest, dtype, at):
            src = typed(buffer, start, hi - lo, dtype) if src is None else src
            copy_in(src, dest, at // itemsize, (hi - lo) // itemsize)


def _copy_pieces(span: Span, data: torch.Tensor) -> None:
    """A block span's bytes (``data``, uint8) into the destinations of its pieces."""
    dtype = torch_dtype(span.entry.dtype)
    for piece, dest in span.pieces:
        if dest is not None:
            at = piece.offset - span.offset
            raw = data[at:at + piece.nbytes]
            if raw.storage_offset() % dtype.itemsize:  # a foreign entry at a misaligned offset
                raw = raw.clone()
            execute(piece, raw.view(dtype), dest)
