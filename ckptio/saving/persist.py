"""Save data path: stream planned items through the staging pool into data files, in two halves.

``capture`` copies every item's bytes into pool buffers in file order, one capture window per
file (capture_window.py), blocking only while the pool is full, and may run on any thread; once
it returns the source tensors may change. Each full buffer goes to a hasher thread, which
checksums the exact bytes and hands the buffer to the I/O backend; a finished write returns the
buffer to the pool. ``finish`` waits for all of it and fsyncs. Keeping checksums off the
capturing thread keeps the training loop's share to the copy. A mapped save (``mapped=True``: a
store on tmpfs) fills regions of the data files' own mappings instead of pool buffers
(mapped_regions.py): hashed as they are, never written.

Owns: the hand-off of full buffers, checksums of the bytes written, one synchronisation of the
device->host copies per save (no per-tensor one), progress counters, waiting for every write,
fsync. Does not own: filling a buffer (capture_window.py), the side streams and events of the
device copies (copy_streams.py), where items go (layout.py), the files themselves
(opened by name through the store's StoreFiles, storage/files.py), their commit (the Store),
the pool (io/stage.py) or the order of a whole save (save_session.py).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from itertools import repeat
from typing import Any

import torch

from ckptio.errors import CkptError
from ckptio.format.checksum import EntryHashers
from ckptio.format.types import FileInfo, FileLayout, Placement, TensorEntry
from ckptio.io import FileHandle
from ckptio.io.worker import Calls
from ckptio.io.buffers import Buffer, torch_dtypes
from ckptio.io.stage import StagingPool
from ckptio.saving.capture_window import Piece, Window
from ckptio.saving.copy_streams import on_streams, ready_events, record_events, side_streams
from ckptio.saving.mapped_regions import MappedTarget
from ckptio.saving.packing import Packer, Where
from ckptio.io.stall import Activity
from ckptio.storage.files import StoreFiles

__all__ = ["Progress", "SaveJob"]

_OFFSET = operator.attrgetter("offset")
_ITEM = operator.attrgetter("item")
_NBYTES = operator.attrgetter("nbytes")
_KEY = operator.attrgetter("key")
_DTYPE = operator.attrgetter("dtype")
_PIECE_NBYTES = operator.itemgetter(2)
_KIND = operator.attrgetter("kind")
_SHAPE = operator.attrgetter("shape")
_CHUNK = operator.attrgetter("chunk")
_CHECKSUM, _BLOCKS = operator.itemgetter(0), operator.itemgetter(1)


class Progress:
    """Bytes of one save: planned, copied into staging, durably written (updated from threads)."""

    def __init__(self, nbytes_total: int) -> None:
        self.nbytes_total = nbytes_total
        self.nbytes_staged = 0
        self.nbytes_written = 0

    def __repr__(self) -> str:
        return (f"Progress(staged={self.nbytes_staged}/{self.nbytes_total}, "
                f"written={self.nbytes_written}/{self.nbytes_total})")


class SaveJob:
    """One save's bytes: ``capture()`` then ``finish()``; ``abandon()`` after any failure."""

    def __init__(self, target: StoreFiles, files: Sequence[FileLayout],
                 sources: dict[str, torch.Tensor], *, pool: StagingPool, algorithm: str, rank: int,
                 ready: Sequence[Any] | None = None, progress: Progress | None = None,
                 block_nbytes: int = 1 << 20, packer: Packer | None = None,
                 write_at_once: bool = False, mapped: bool = False,
                 activity: Activity | None = None, hashing: Calls | None = None) -> None:
        """``ready``: events from ready_events() recorded on the caller's thread; None records
        them here (the job is made on the caller's thread). ``packer``: a packed save
        (packing.py): ``files`` is one layout that only orders the capture, its bytes go to
        the packer's files. ``write_at_once``: checksums and writes start with the first full
        buffer (a synchronous save, whose caller waits for the writes anyway), not once the
        capture is done or the pool runs dry. ``mapped``: the files are made as shared
        mappings (``target`` mappable, no packer) and the capture copies into them.
        ``activity``: where its writes and fsyncs are watched (stall.py). ``hashing``: the
        owner's long-lived hasher thread (saving/workers.py; one job on it at a time); None: a
        thread of the job's own, joined by finish() or abandon()."""
        self.target, self.files, self.sources = target, files, sources
        self.packer = packer
        self.pool, self.rank = pool, rank
        self.algorithm = algorithm
        self.activity = activity or Activity(target.location, rank, 0.0)
        self.progress = progress or Progress(sum(p.item.nbytes for f in files for p in f.placements))
        # Hashers are made by the hasher thread as each entry's first bytes arrive and manifest
        # rows by finish(): the caller, waiting for its capture, pays for neither (thousands of
        # objects, and the garbage collections they set off).
        self._hashes = EntryHashers(algorithm, block_nbytes,  # by entry index, in file order
                                    [p.item.nbytes for f in files for p in f.placements])
        self._handles: dict[int, FileHandle] = {}  # file index -> handle, opened by the hasher
        self._own_hashing = hashing is None
        self._hashing = Calls("ckptio-hash") if hashing is None else hashing  # FIFO: in order
        self._pending: list[Future[None]] = []  # hash-then-submit tasks
        self._lock = threading.Lock()
        self._writes_in_flight = 0
        self._idle = threading.Condition(self._lock)
        # Checksums and writes start once the capture is done or the pool runs dry: until then
        # the second core is left to the copy, which is all the caller waits for.
        self._go = threading.Event()
        if write_at_once:
            self._go.set()
        self._failure: BaseException | None = None
        self._streams = side_streams(sources, ready_events(sources) if ready is None else ready)
        self.mapped = (MappedTarget(target, files, pool.buffer_bytes, cuda=bool(self._streams))
                       if mapped and packer is None else None)

    # ---------------------------------------------------------------- capture (any thread)

    def capture(self, eager_items: int = 0, on_eager: Callable[[], None] | None = None) -> None:
        """Copy every item into pool buffers; the sources are free to change once this returns.

        ``on_eager`` is called once the first ``eager_items`` items are copied (a lazy save's
        caller waits only for those)."""
        captured = 0
        if eager_items == 0 and on_eager is not None:
            on_eager()
        with torch.no_grad(), on_streams(self._streams):
            for index, layout in enumerate(self.files):
                window = Window(self, index)
                try:
                    # the placements' fields read by map, so that runs of small host tensors
                    # are copied with no Python per tensor (Window.put_run)
                    placements = layout.placements
                    offsets = list(map(_OFFSET, placements))
                    items = list(map(_ITEM, placements))
                    sizes = list(map(_NBYTES, items))
                    ends = list(map(operator.add, offsets, sizes))
                    sources = list(map(self.sources.__getitem__, map(_KEY, items)))
                    dtypes = torch_dtypes(list(map(_DTYPE, items)))
                    at, count = 0, len(placements)
                    while at < count:
                        stop = (count if captured >= eager_items else
                                min(count, at + eager_items - captured))
                        took = window.put_run(offsets, sizes, ends, sources, dtypes, at, stop,
                                              captured)
                        if not took:
                            window.put(offsets[at], items[at], sources[at], captured)
                            took = 1
                        at += took
                        captured += took
                        if captured == eager_items and on_eager is not None:
                            window.groups.flush()
                            self._sync_streams()
                            on_eager()
                    window.close(layout.nbytes)
                except BaseException:
                    self._sync_streams()  # copies into the window's buffer land before it is reused
                    raise
                finally:
                    window.abandon()
        self._sync_streams()
        self._go.set()

    def region(self, file: int, start: int) -> Buffer:
        """Where file ``file``'s bytes from ``start`` go: its mapping's region, or a pool buffer."""
        if self.mapped is not None:
            return self.mapped.region(file, start)
        return self.acquire()

    def release(self, buffer: Buffer) -> None:
        """A pool buffer done with goes back (a mapped region stays the file's)."""
        if self.mapped is None:
            self.pool.release(buffer)

    @property
    def async_copies(self) -> bool:
        """Device->host copies may be non_blocking: the pool, or every mapping page-locked."""
        return self.mapped is None or self.mapped.pinned

    def acquire(self) -> Buffer:
        """A free pool buffer; if none is free, let the writers run (they free buffers)."""
        buffer = self.pool.try_acquire()
        if buffer is None:
            self._go.set()
            buffer = self.pool.acquire()
        return buffer

    def _sync_streams(self) -> None:
        """Device->host copies queued so far have landed: their sources may change now. One
        synchronisation per save (and one at a lazy save's eager boundary), never per tensor."""
        for stream in self._streams:
            stream.synchronize()

    def _handle(self, index: int) -> FileHandle:
        """The file's handle, created and preallocated on first use: on the hasher's thread,
        so a save's caller never waits for fallocate (docs/PROBES.md, "Figures moved out of
        the code")."""
        if index not in self._handles:
            layout = self.files[index]
            self._handles[index] = self.target.open_write(layout.name, layout.nbytes)
        return self._handles[index]

    def hand_off(self, file: int, offset: int, buffer: Buffer, nbytes: int,
                 pieces: list[Piece]) -> None:
        """A full buffer leaves the capturing thread (its capture_window.Window): checksum, then write, in
        submission order."""
        try:
            self._raise_failure()
            events = record_events(self._streams)
            task = self._hashing.submit(self._hash_and_write, file, offset, buffer, nbytes, pieces, events)
        except BaseException:
            self.release(buffer)
            raise
        self._pending.append(task)
        self.progress.nbytes_staged += sum(map(_PIECE_NBYTES, pieces))

    def _hash_and_write(self, file: int, offset: int, buffer: Buffer, nbytes: int,
                        pieces: list[Piece], events: list[Any]) -> None:
        try:
            for event in events:
                event.synchronize()  # the device->host copies into this buffer have landed
            self._go.wait()
            if self._failure is not None:
                raise CkptError("an earlier write of this save failed")
            self._hashes.update_pieces(buffer.view, pieces)
            if self.packer is not None or self.mapped is not None:
                if self.packer is not None:
                    self.packer.take(buffer.view, pieces)
                future: Future[int] = Future()  # mapped: the pages are the file, written
                future.set_result(nbytes)
            else:
                future = self._submit(file, offset, buffer.view[:nbytes])
        except BaseException as exc:
            self.release(buffer)
            self._fail(exc)
            raise
        written = sum(map(_PIECE_NBYTES, pieces))
        with self._lock:
            self._writes_in_flight += 1
        future.add_done_callback(lambda f: self._written(f, buffer, written))

    def _submit(self, file: int, offset: int, view: memoryview) -> Future[int]:
        """A write of file ``file`` (opened on first use), watched until it returns."""
        call = self.activity.begin("write", self.target.where(self.files[file].name))
        try:
            future = self.target.submit_write(self._handle(file), offset, view)
        except BaseException:
            self.activity.end(call)
            raise
        future.add_done_callback(lambda _f: self.activity.end(call))
        return future

    def _written(self, future: Future[int], buffer: Buffer, nbytes: int) -> None:
        """A write's end (its callback): record the outcome, return the buffer, then count it
        done; _drain waits for this count, not for the futures, whose waiters wake before
        their callbacks run."""
        error = future.exception()
        if error is not None:
            self._fail(error)
        self.release(buffer)
        with self._lock:
            if error is None:
                self.progress.nbytes_written += nbytes
            self._writes_in_flight -= 1
            self._idle.notify_all()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    # ---------------------------------------------------------------- finish (any thread)

    def finish(self) -> tuple[list[TensorEntry], list[FileInfo]]:
        """Wait for every checksum and write, fsync and close the files; -> manifest rows."""
        self._drain()
        self._raise_failure()
        if self.packer is not None:
            return self._finish_packed(self.packer)
        for index in range(len(self.files)):  # a file of only empty items got no buffer: made here
            _ = self._handle(index) if self.mapped is None else self.mapped.opened(index)
        if self.mapped is not None:  # tmpfs: the pages are the file, nothing to fsync
            self.mapped.close(keep=True)
        while self._handles:
            index = min(self._handles)
            with self.activity.call("fsync", self.target.where(self.files[index].name)):
                self.target.close(self._handles.pop(index), sync=True)
        # the manifest rows, by map over the items' fields (no Python per entry but its
        # dataclass's __init__)
        placed = [p for f in self.files for p in f.placements]
        names = [f.name for f in self.files for _p in f.placements]
        items = list(map(_ITEM, placed))
        digests = self._hashes.all_digests(len(placed))
        entries = list(map(TensorEntry, map(_KEY, items), map(_KIND, items), map(_DTYPE, items),
                           map(_SHAPE, items), map(_CHUNK, items), names, map(_OFFSET, placed),
                           map(_NBYTES, items), map(_CHECKSUM, digests), repeat(None),
                           map(_BLOCKS, digests)))
        return entries, [FileInfo(f.name, f.nbytes, self.rank) for f in self.files]

    def _finish_packed(self, packer: Packer) -> tuple[list[TensorEntry], list[FileInfo]]:
        placed = [p for f in self.files for p in f.placements]
        digests = {index: self._hashes.digests(index) for index in range(len(placed))}
        wheres, infos = packer.finish({i: d[0] for i, d in digests.items()})
        return [_packed_entry(p, wheres[i], *digests[i]) for i, p in enumerate(placed)], infos

    def _drain(self) -> None:
        """Every task and write has finished (failed or not); the pool has all its buffers back."""
        self._go.set()
        for task in self._pending:
            task.exception()
        if self._own_hashing:
            self._hashing.close()
        with self._lock:
            while self._writes_in_flight:
                self._idle.wait()

    def abandon(self) -> None:
        """After a failure: let in-flight work finish (its buffers return), close without fsync."""
        self._drain()
        while self._handles:
            self.target.close(self._handles.pop(min(self._handles)), sync=False)
        if self.mapped is not None:
            self.mapped.close(keep=False)
        if self.packer is not None:
            self.packer.abandon()


def _packed_entry(placement: Placement, where: Where, checksum: str,
                  blocks: tuple[str, ...]) -> TensorEntry:
    """The manifest row of a packed item (packing.py placed its bytes)."""
    item = placement.item
    return TensorEntry(item.key, item.kind, item.dtype, item.shape, item.chunk, where.file,
                       where.offset, item.nbytes, checksum, blocks=blocks, stored=where.stored,
                       delta=where.delta)
