"""Packed saves (format version 4): entries compressed, referenced or XORed against a base,
written sequentially into data files whose sizes are known only once their frames are encoded.

A save asking for compression (``Options.compression`` not "off") or given a base is packed:
persist.SaveJob captures its items as always (into the staging pool, in order), and its hasher
thread, after checksumming a buffer, hands it here.

Call order: ``Packer(...)`` -> ``take`` per checksummed buffer (on the hasher thread; the
frame pipeline and its memory bound: on Packer) -> ``finish`` (the rows' placement fields and
the files) or ``abandon``. How each entry is stored (ref, xor, codec or raw) is decided on its
first frame: on ``Packer._decide``.

Owns: the frame pipeline, the per-entry decision, segments and their files, the rows' placement
fields. Does not own: capture and checksums (persist.py), the codecs (format/codec.py), reading
the base (storage/entry_reader.py), the manifest.
"""

from __future__ import annotations

import mmap
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ckptio.alignment import BLOCK, SMALL_ALIGN, align_up, item_alignment
from ckptio.errors import CkptError, CorruptCheckpointError, in_base
from ckptio.format import codec
from ckptio.format.checksum import new_hasher
from ckptio.format.types import DTYPE_ITEMSIZE, Delta, FileInfo, Placement, Stored, TensorEntry
from ckptio.io import FileHandle
from ckptio.planning.layout import data_file_name
from ckptio.storage.entry_reader import Base, EntryReader
from ckptio.storage.files import StoreFiles

__all__ = ["MIN_RATIO", "SPEED_MARGIN", "Compression", "DeltaBase", "Packer", "Where"]

MIN_RATIO = 1.1  # auto: a sample must shrink at least this much
SPEED_MARGIN = 1.2  # auto, local disk: codec speed x threads >= this x the disk's write rate
FIRST_SEGMENT_FILE = 0


@dataclass(frozen=True)
class Compression:
    """How a packed save compresses: ``codec`` (a save-time name, format/codec.py; None: not
    at all), ``auto`` (only where the sample pays), the store's kind and measured write rate."""

    codec: str | None
    auto: bool
    object_store: bool
    write_bps: float | None  # bytes/s of the store's tuned profile; None: unknown
    threads: int


@dataclass(frozen=True)
class DeltaBase:
    """The base checkpoint a delta save is written against, and a reader of its frames."""

    base: Base
    reader: EntryReader
    per_rank: frozenset[str]  # keys saved as this rank's own value (their base entry has a rank)
    rank: int


@dataclass(frozen=True)
class Where:
    """Where a packed entry's bytes went: the rest of its manifest row."""

    file: str
    offset: int
    stored: Stored | None
    delta: Delta | None


@dataclass
class _Frame:
    data: bytes
    same: bool  # equal to the base's frame


@dataclass
class _Entry:
    placement: Placement
    base: TensorEntry | None
    fed: int = 0
    partial: bytearray | None = None
    mode: Future[str] = field(default_factory=Future)
    frames: list[Future[_Frame]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.placement.item.nbytes


class Packer:
    """One rank's packed entries: ``take`` each checksummed buffer's pieces (in order, on the
    hasher thread), then ``finish`` (or ``abandon``).

    Each entry is cut into frames of ``block_nbytes`` logical bytes (the block checksums'
    granularity, so a resharding load decodes only what it needs); frames are encoded by at
    most ``threads`` worker threads (the bound: never the training thread); the buffer goes
    back to the pool once its frames are encoded (a frame cut by a buffer's end is copied).
    Finished entries are appended to a segment in memory, which becomes a data file
    (``open_write`` with its exact size, padded to BLOCK, one write, fsynced at the end) once it
    passes ``segment_nbytes``: a segment holds whole entries, so the memory held is at most a
    segment plus the largest entry's stored bytes."""

    def __init__(self, target: StoreFiles, placements: tuple[Placement, ...], *, first_index: int,
                 save_id: str, rank: int, compression: Compression, base: DeltaBase | None,
                 block_nbytes: int, algorithm: str, segment_nbytes: int) -> None:
        self.target, self.compression, self.base = target, compression, base
        self.placements, self.first_index = placements, first_index
        self.save_id, self.rank = save_id, rank
        self.block_nbytes, self.algorithm, self.segment_nbytes = block_nbytes, algorithm, segment_nbytes
        self._workers = ThreadPoolExecutor(max(1, compression.threads),
                                           thread_name_prefix="ckptio-compress")
        self._entries: dict[int, _Entry] = {}
        self._done: dict[int, Where] = {}
        self._segment = bytearray()
        self._files: list[FileInfo] = []
        self._writing: list[tuple[FileHandle, Future[int], mmap.mmap | bytearray]] = []
        self._zeros: dict[tuple[int, str], bytes] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- the hasher thread

    def take(self, view: memoryview, pieces: list[tuple[int, int, int]]) -> None:
        """Encode the frames of ``pieces`` (entry index, start in ``view``, nbytes); returns
        once every frame that reads ``view`` is encoded (the buffer may then be reused)."""
        waits: list[Future[_Frame]] = []
        for index, start, n in pieces:
            entry = self._entry(index)
            data = view[start:start + n]
            while len(data):
                frame, data = self._cut(entry, data)
                if frame is not None:
                    waits.append(self._submit(entry, frame))
        for future in waits:
            future.exception()
        self._place_finished()

    def _entry(self, index: int) -> _Entry:
        entry = self._entries.get(index)
        if entry is None:
            placement = self.placements[index - self.first_index]
            entry = self._entries[index] = _Entry(placement, self._base_entry(placement))
        return entry

    def _base_entry(self, placement: Placement) -> TensorEntry | None:
        if self.base is None:
            return None
        item = placement.item
        rank = self.base.rank if item.key in self.base.per_rank else None
        found = self.base.base.entries.get((item.key, item.chunk, rank))
        if found is None or (found.dtype, found.nbytes, found.kind) != (item.dtype, item.nbytes,
                                                                         item.kind):
            return None
        return found

    def _cut(self, entry: _Entry, data: memoryview) -> tuple[memoryview | bytearray | None,
                                                             memoryview]:
        """The next whole frame of ``entry`` from ``data`` (None: kept as a partial frame) and
        what is left of ``data``."""
        index = len(entry.frames)
        want = min(self.block_nbytes, entry.nbytes - index * self.block_nbytes)
        have = len(entry.partial) if entry.partial is not None else 0
        if have == 0 and len(data) >= want:
            entry.fed += want
            return data[:want], data[want:]
        take = min(want - have, len(data))
        entry.partial = (entry.partial or bytearray()) + data[:take]
        entry.fed += take
        if len(entry.partial) < want:
            return None, data[take:]
        frame, entry.partial = entry.partial, None
        return frame, data[take:]

    def _submit(self, entry: _Entry, frame: memoryview | bytearray) -> Future[_Frame]:
        index = len(entry.frames)
        future = self._workers.submit(self._encode, entry, index, frame)
        entry.frames.append(future)
        return future

    # ---------------------------------------------------------------- the workers

    def _encode(self, entry: _Entry, index: int, frame: memoryview | bytearray) -> _Frame:
        try:
            same = (entry.base is not None and self._same_algorithm()
                    and self._digest(frame) == _block(entry.base, index))
            if index == 0:
                first = self._decide(entry, frame, same)
                return first
            mode = entry.mode.result()
        except BaseException as exc:
            if index == 0 and not entry.mode.done():
                entry.mode.set_exception(exc)
            raise
        return _Frame(self._stored(entry, mode, index, frame, same), same)

    def _decide(self, entry: _Entry, frame: memoryview | bytearray, same: bool) -> _Frame:
        """The entry's mode from its first frame (the sample), and that frame.

        * with a base entry (same key, chunk, rank): every frame equal to the base's (its
          checksum is the base's block checksum) -> a ``ref`` (nothing written); else, with a
          codec, an ``xor`` entry when the first frame's XOR with the base compresses smaller
          than the frame itself;
        * compressed by the codec: always for an explicit codec; for ``auto`` when the sample's
          ratio is at least ``MIN_RATIO`` and either the store is an object store or the
          codec's speed on the sample times ``threads`` beats the store's write rate (the
          tuner's profile) by ``SPEED_MARGIN`` (a local save whose profile is missing or too
          fast for the codec, with no base, never gets here: packed.py makes it a plain save,
          "off"'s own path);
        * else raw. A frame that does not shrink is stored raw (codec.py), and an entry whose
          frames are all raw has no ``stored`` field."""
        name = self._codec_name(entry)
        if name is None:
            entry.mode.set_result("raw")
            return _Frame(bytes(frame), same)
        started = time.perf_counter()
        plain = codec.encode_frame(name, frame)
        seconds = time.perf_counter() - started
        if entry.base is not None:
            xored = self._stored(entry, "xor", 0, frame, same)
            if len(xored) < len(plain):
                entry.mode.set_result("xor")
                return _Frame(xored, same)
        mode = "codec" if self._pays(len(frame), len(plain), seconds) else "raw"
        entry.mode.set_result(mode)
        return _Frame(bytes(plain) if mode == "codec" else bytes(frame), same)

    def _pays(self, nbytes: int, stored: int, seconds: float) -> bool:
        c = self.compression
        if not c.auto:
            return True
        if nbytes < MIN_RATIO * stored:
            return False
        if c.object_store:
            return True
        speed = nbytes / max(seconds, 1e-9)
        return c.write_bps is not None and speed * c.threads >= SPEED_MARGIN * c.write_bps

    def _codec_name(self, entry: _Entry) -> str | None:
        if self.compression.codec is None:
            return None
        return codec.stored_name(self.compression.codec,
                                 DTYPE_ITEMSIZE[entry.placement.item.dtype])

    def _stored(self, entry: _Entry, mode: str, index: int, frame: memoryview | bytearray,
                same: bool) -> bytes:
        """Frame ``index`` as stored in ``mode``."""
        if mode == "raw":
            return bytes(frame)
        name = self._codec_name(entry)
        assert name is not None  # internal: "codec" and "xor" modes have a codec
        if mode == "codec":
            return bytes(codec.encode_frame(name, frame))
        if same:
            return self._zero_frame(name, len(frame))
        assert self.base is not None and entry.base is not None  # internal: xor has a base
        xored = bytearray(frame)
        try:
            stored = self.base.reader.frames(entry.base, index, index + 1)
        except CorruptCheckpointError as exc:  # the base's bytes: the manager saves full next
            raise in_base(exc, self.base.base.name) from None
        codec.xor_into(memoryview(xored), stored)
        return bytes(codec.encode_frame(name, xored))

    def _zero_frame(self, name: str, nbytes: int) -> bytes:
        with self._lock:
            if (nbytes, name) not in self._zeros:
                self._zeros[(nbytes, name)] = bytes(codec.encode_frame(name, bytes(nbytes)))
            return self._zeros[(nbytes, name)]

    def _same_algorithm(self) -> bool:
        """A frame may be a ref only to a base whose checksums are of the same kind: a ref's
        whole checksum must equal its base entry's (a base saved before xxh3_64_tree is not)."""
        return self.base is not None and self.base.base.record.checksum_algorithm == self.algorithm

    def _digest(self, frame: memoryview | bytearray) -> str:
        hasher = new_hasher(self.algorithm)
        hasher.update(memoryview(frame))
        return hasher.hexdigest()

    # ---------------------------------------------------------------- placing entries

    def _place_finished(self) -> None:
        """Every entry whose frames are all encoded gets its place (in entry order)."""
        for index in sorted(self._entries):
            entry = self._entries[index]
            if entry.fed < entry.nbytes or not all(f.done() for f in entry.frames):
                break
            del self._entries[index]
            self._done[index] = self._place(entry, [f.result() for f in entry.frames])
            if len(self._segment) >= self.segment_nbytes:
                self._write_segment()

    def _place(self, entry: _Entry, frames: list[_Frame]) -> Where:
        base, item = entry.base, entry.placement.item
        if base is not None and self.base is not None and frames and all(f.same for f in frames):
            return Where(base.file, base.offset, base.stored, Delta("ref", self.base.base.name))
        mode = entry.mode.result() if frames else "raw"
        sizes = tuple(len(f.data) for f in frames)
        stored = None
        if sum(sizes) != item.nbytes:
            name = self._codec_name(entry)
            assert name is not None  # internal: only a codec shrinks frames
            stored = Stored(name, sum(sizes), sizes)
        align = SMALL_ALIGN if stored is not None else item_alignment(item.nbytes)
        offset = align_up(len(self._segment), align)
        self._segment.extend(bytes(offset - len(self._segment)))
        for f in frames:
            self._segment.extend(f.data)
        delta = Delta("xor", self.base.base.name) if mode == "xor" and self.base else None
        return Where(self._segment_name(), offset, stored, delta)

    def _segment_name(self) -> str:
        return data_file_name(self.save_id, self.rank, FIRST_SEGMENT_FILE + len(self._files))

    def _write_segment(self) -> None:
        """The segment as a data file of its exact (padded) size, written in one request."""
        name, nbytes = self._segment_name(), align_up(len(self._segment))
        self._files.append(FileInfo(name, nbytes, self.rank))
        fh = self.target.open_write(name, nbytes)
        data: mmap.mmap | bytearray
        if fh.direct:  # O_DIRECT: a page-aligned copy; else the segment itself, zero-padded
            data = mmap.mmap(-1, max(nbytes, BLOCK))
            data[:len(self._segment)] = self._segment
        else:
            data = self._segment
            data.extend(bytes(nbytes - len(data)))
        self._segment = bytearray()
        self._writing.append((fh, self.target.submit_write(fh, 0, memoryview(data)[:nbytes]),
                              data))
        while len(self._writing) > 2:  # bound the segments held in memory
            self._close_oldest(sync=True)

    def _close_oldest(self, *, sync: bool) -> None:
        fh, future, _data = self._writing.pop(0)
        error = future.exception()
        self.target.close(fh, sync=sync and error is None)
        if error is not None and sync:
            raise error

    # ---------------------------------------------------------------- the end

    def finish(self, digests: dict[int, str]) -> tuple[dict[int, Where], list[FileInfo]]:
        """Every entry placed and every file durable; -> each entry's place (by entry index)
        and the files written. ``digests``: each entry's checksum (a ref must match its base)."""
        self._workers.shutdown(wait=True)  # every frame encoded: the base is read no more
        self._close_base()
        self._place_finished()
        if self._entries:
            missing = min(self._entries)
            raise CkptError(f"internal: packed entry {missing} was not captured whole")
        for number, _placement in enumerate(self.placements, self.first_index):
            if number not in self._done:  # no bytes, no frames: a place in a file of the save
                name = self._files[0].name if self._files else self._segment_name()
                self._done[number] = Where(name, 0, None, None)
        if self._segment or not self._files:
            self._write_segment()
        while self._writing:
            self._close_oldest(sync=True)
        for index, where in self._done.items():
            if where.delta is not None and where.delta.kind == "ref":
                self._check_ref(index, where, digests[index])
        return dict(self._done), list(self._files)

    def _check_ref(self, index: int, where: Where, checksum: str) -> None:
        assert self.base is not None  # internal: refs exist with a base
        item = self.placements[index - self.first_index].item
        rank = self.base.rank if item.key in self.base.per_rank else None
        base = self.base.base.entries[(item.key, item.chunk, rank)]
        if base.checksum != checksum:
            raise CkptError(f"key {item.key!r}: every frame matched base checkpoint "
                            f"{self.base.base.name}'s but the whole checksum does not; nothing "
                            "was committed (save again without base=)")

    def abandon(self) -> None:
        """After a failure: stop the workers, close the files unsynced and remove them."""
        self._workers.shutdown(wait=True, cancel_futures=True)
        self._close_base()
        while self._writing:
            self._close_oldest(sync=False)
        names = [f.name for f in self._files]
        if names:
            self.target.store.remove(names)

    def _close_base(self) -> None:
        """Close the base's files the delta's encoding opened (each save opens its own: left
        open, a long run kept one per save, and a dropped base's disk space with them)."""
        if self.base is not None:
            self.base.reader.close()


def _block(entry: TensorEntry, index: int) -> str:
    """Block checksum ``index`` of a stored entry (its checksum when it is one block)."""
    return entry.blocks[index] if entry.blocks else entry.checksum
