"""The logical bytes of version 4 entries, read through a store's files: compressed frames
decoded, references read from their base checkpoint, XOR deltas XORed with it; every frame
checked against its block checksum (the whole checksum for a one-frame entry).

``EntryReader.frames(entry, first, last)`` returns the logical bytes of frames ``[first, last)``
of an entry of any form (a plain entry too): what a resharding load needs of an entry, and what
a delta save needs of its base. ``Bases`` opens the sibling checkpoints a manifest names
(``bases``: ``<parent>/<name>`` of the checkpoint's own location, the same kind of store), each
once, and finds the base entry of an entry (the same key, chunk and rank). A base must be
self-contained (a delta never references a delta) and cut into frames of the same size.

A load that reads many small entries whole first ``plan``s them: their bytes (and their
bases') are then fetched by spans of many entries (storage/spans.py), one request each.

Owns: those reads, frame decoding in order, XOR with the base, the checks and their messages
(naming the key, the file and, for a base, its step). Does not own: the codecs (format/codec.py),
which frames a load needs (loading/coded_reads.py), which entries a save writes as deltas (saving/).
Torch-free (the CLI's verify path may use it without torch).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ckptio.alignment import align_down, align_up
from ckptio.errors import CkptError, CorruptCheckpointError, StorageIOError
from ckptio.format import codec, manifest
from ckptio.format.checksum import new_hasher
from ckptio.format.types import Chunk, Manifest, TensorEntry
from ckptio.io.backend_contract import FileHandle
from ckptio.storage import steps
from ckptio.storage.files import StoreFiles
from ckptio.storage.spans import SPAN, Range, Spans
from ckptio.storage.store_contract import Store

__all__ = ["Base", "Bases", "EntryReader", "base_key", "sibling_location"]

BaseKey = tuple[str, Chunk, "int | None"]


def base_key(entry: TensorEntry) -> BaseKey:
    """What pairs an entry with its base entry: key, chunk and rank."""
    return entry.key, entry.chunk, entry.rank


def sibling_location(location: str, name: str) -> str:
    """The location of checkpoint ``name`` beside the one at ``location`` (same parent; a
    bare relative name's parent is the working directory, not ``/``)."""
    parent, slash, _ = location.rstrip("/").rpartition("/")
    return f"{parent}/{name}" if slash else name


@dataclass(frozen=True)
class Base:
    """An opened base checkpoint: its step name, store, manifest and entries by base_key."""

    name: str
    store: Store
    record: Manifest
    entries: dict[BaseKey, TensorEntry]

    def entry_for(self, entry: TensorEntry, where: str) -> TensorEntry:
        """The base entry of ``entry``; CorruptCheckpointError if it has none that fits."""
        found = self.entries.get(base_key(entry))
        if found is None or (found.dtype, found.nbytes) != (entry.dtype, entry.nbytes):
            raise CorruptCheckpointError(
                f"key {entry.key!r} of {where} needs its base entry in checkpoint {self.name} "
                f"({self.store.location}), which has none of the same chunk, dtype and size: the "
                "base was replaced or damaged; load a self-contained checkpoint")
        return found


class Bases:
    """The base checkpoints of the checkpoint at ``location``, opened on first use (thread-safe)."""

    def __init__(self, location: str, open_store: Callable[[str], Store], *,
                 block_nbytes: int) -> None:
        self.location, self.open_store, self.block_nbytes = location, open_store, block_nbytes
        self._opened: dict[str, Base] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Base:
        with self._lock:
            base = self._opened.get(name)
            if base is None:
                base = self._opened[name] = self._open(name)
            return base

    def _open(self, name: str) -> Base:
        store = self.open_store(sibling_location(self.location, name))
        where = store.path_of(manifest.MANIFEST_NAME)
        try:
            record = manifest.decode(store.read_manifest(), where)
        except StorageIOError as exc:  # the storage failed (EIO): not damage, said as such
            raise StorageIOError(
                f"{self.location} is a delta of base checkpoint {name}, whose manifest cannot "
                f"be read now ({exc}); the base is needed: retry, and if it keeps failing "
                "check the storage (dmesg)") from None
        except CkptError as exc:
            raise CorruptCheckpointError(
                f"{self.location} is a delta of base checkpoint {name}, which cannot be read "
                f"({exc}); the base is needed to load it: restore the base or load another "
                "checkpoint") from None
        try:
            steps.check_files(store, record)  # a data file removed or cut short: damage
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(
                f"{self.location} is a delta of base checkpoint {name}, which is damaged "
                f"({exc}); the base is needed to load it: restore the base or load another "
                "checkpoint") from None
        if record.bases:
            raise CorruptCheckpointError(
                f"{where}: base checkpoint {name} of {self.location} is itself a delta (of "
                f"{', '.join(record.bases)}); a base must be self-contained")
        if record.block_nbytes != self.block_nbytes:
            raise CorruptCheckpointError(
                f"base checkpoint {name} ({where}) has frames of {record.block_nbytes} bytes, "
                f"{self.location} of {self.block_nbytes}; they cannot be combined")
        return Base(name, store, record, {base_key(t): t for t in record.tensors})


class EntryReader:
    """Frames of entries of one checkpoint (``files``) and of its bases, checked when
    ``algorithm`` is given; thread-safe (a load decodes ``threads`` entries at a time). Close
    it (or use ``with``) to close the files it opened."""

    def __init__(self, files: StoreFiles, *, block_nbytes: int, algorithm: str | None,
                 bases: Bases | None, threads: int = 1) -> None:
        self.files, self.block_nbytes, self.algorithm = files, block_nbytes, algorithm
        self.bases, self.threads = bases, threads
        self._handles: dict[tuple[int, str], tuple[StoreFiles, FileHandle]] = {}
        self._base_files: dict[str, StoreFiles] = {}
        self._lock = threading.Lock()
        self._spans = Spans(self._handle)

    def __enter__(self) -> EntryReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for files, fh in handles:
            files.close(fh, sync=False)

    # ---------------------------------------------------------------- frames of an entry

    def plan(self, entries: list[TensorEntry]) -> None:
        """These entries will be read whole, in this order: read their bytes (and their bases')
        by spans of many entries (storage/spans.py) rather than one read per entry."""
        ranges: list[Range] = []
        for entry in entries:
            if entry.delta is None or entry.delta.kind == "xor":
                ranges.append(_range_of(self.files, entry))
            if entry.delta is not None:
                files, base, _label = self._base(entry)
                ranges.append(_range_of(files, base))
        self._spans.plan([r for r in ranges if r[3] <= SPAN])

    def frames(self, entry: TensorEntry, first: int, last: int) -> bytearray:
        """The logical bytes of frames ``[first, last)`` of ``entry``, checked."""
        if entry.delta is not None and entry.delta.kind == "ref":
            files, base, label = self._base(entry)
            if base.checksum != entry.checksum:
                raise CorruptCheckpointError(
                    f"key {entry.key!r} references base checkpoint {entry.delta.checkpoint}, "
                    f"whose entry's checksum is {base.checksum}, not {entry.checksum}: the base "
                    "was replaced; load a self-contained checkpoint")
            return self._checked(files, base, first, last, label)
        out = self._decoded(self.files, entry, first, last)
        if entry.delta is None:
            self._check(self.files, entry, first, out, "")
            return out
        files, base, label = self._base(entry)
        codec.xor_into(memoryview(out), self._checked(files, base, first, last, label))
        self._check(self.files, entry, first, out,
                    f" (XOR of this checkpoint's bytes with {label})")
        return out

    def _base(self, entry: TensorEntry) -> tuple[StoreFiles, TensorEntry, str]:
        assert entry.delta is not None  # internal: called for delta entries only
        if self.bases is None:
            raise CkptError(f"key {entry.key!r} needs base checkpoint {entry.delta.checkpoint}, "
                            "but this read was given no bases")
        base = self.bases.get(entry.delta.checkpoint)
        with self._lock:
            files = self._base_files.get(base.name)
            if files is None:
                files = self._base_files[base.name] = self.files.beside(base.store)
        label = f"base checkpoint {base.name}"
        return files, base.entry_for(entry, self.files.location), label

    def _checked(self, files: StoreFiles, entry: TensorEntry, first: int, last: int,
                 label: str) -> bytearray:
        out = self._decoded(files, entry, first, last)
        self._check(files, entry, first, out, f" of {label}")
        return out

    def _decoded(self, files: StoreFiles, entry: TensorEntry, first: int,
                 last: int) -> bytearray:
        """The entry's own stored frames ``[first, last)``, decoded (not yet XORed)."""
        b = self.block_nbytes
        lo, hi = first * b, min(last * b, entry.nbytes)
        stored = entry.stored
        if stored is None:
            return bytearray(self._read(files, entry, entry.offset + lo, hi - lo))
        start = entry.offset + sum(stored.frames[:first])
        data = self._read(files, entry, start, sum(stored.frames[first:last]))
        out = bytearray(hi - lo)
        view, at = memoryview(out), 0
        for i in range(first, last):
            size = stored.frames[i]
            try:
                codec.decode_frame(stored.codec, data[at:at + size],
                                   view[(i - first) * b:min((i - first + 1) * b, hi - lo)])
            except ValueError as exc:
                raise CorruptCheckpointError(
                    f"frame {i} of key {entry.key!r} in {files.where(entry.file)} (bytes "
                    f"[{start + at}, {start + at + size})) is damaged: {exc}; load an earlier "
                    "checkpoint") from None
            at += size
        return out

    def _read(self, files: StoreFiles, entry: TensorEntry, offset: int,
              nbytes: int) -> memoryview:
        """Bytes ``[offset, offset + nbytes)`` of the entry's file, by one aligned read."""
        if nbytes == 0:
            return memoryview(b"")
        planned = self._spans.take(files, entry.file, offset, nbytes)
        if planned is not None:
            return planned
        start, end = align_down(offset), align_up(offset + nbytes)
        buffer = mmap.mmap(-1, end - start)  # page-aligned: fit for O_DIRECT
        got = files.submit_read(self._handle(files, entry.file), start,
                                memoryview(buffer)).result()
        if got < offset + nbytes - start:
            raise CorruptCheckpointError(
                f"data file {files.where(entry.file)} is truncated: key {entry.key!r} needs "
                f"bytes [{offset}, {offset + nbytes}), the file ends at {start + got}; load an "
                "earlier checkpoint")
        return memoryview(buffer)[offset - start:offset - start + nbytes]

    def _handle(self, files: StoreFiles, name: str) -> FileHandle:
        key = (id(files), name)
        with self._lock:
            held = self._handles.get(key)
        if held is None:
            fh = files.open_read(name)
            with self._lock:
                held = self._handles.setdefault(key, (files, fh))
            if held[1] is not fh:
                files.close(fh, sync=False)
        return held[1]

    def _check(self, files: StoreFiles, entry: TensorEntry, first: int, data: bytearray,
               label: str) -> None:
        """Each frame of ``data`` (frames from ``first``) against its block checksum."""
        if self.algorithm is None:
            return
        b, view = self.block_nbytes, memoryview(data)
        for i in range(first, first + -(-len(data) // b)):
            expected = entry.blocks[i] if entry.blocks else entry.checksum
            hasher = new_hasher(self.algorithm)
            hasher.update(view[(i - first) * b:(i - first + 1) * b])
            if hasher.hexdigest() != expected:
                raise CorruptCheckpointError(
                    f"checksum mismatch for key {entry.key!r}{label}, frame {i} (logical bytes "
                    f"[{i * b}, {min((i + 1) * b, entry.nbytes)})) in "
                    f"{files.where(entry.file)}: stored {expected}, read {hasher.hexdigest()}. "
                    "The data is corrupt; load an earlier checkpoint")


def _range_of(files: StoreFiles, entry: TensorEntry) -> Range:
    """The stored bytes of a whole entry in its file."""
    nbytes = entry.stored.nbytes if entry.stored is not None else entry.nbytes
    return files, entry.file, entry.offset, nbytes
