"""Copy one committed checkpoint from a store to another, verified, committed manifest last:
what the drain does for each step it moves to a slower tier.

    nbytes = copy_checkpoint(staging, source, target, pace=throttle)

1. copy each file the manifest names (data and index files) through one staging buffer, the
   source's names kept, each file durable (fsync / completed upload) before the next; every
   entry's bytes are hashed as they pass (``_Streamed``) and checked against the manifest's
   checksums: the source is read once. A checkpoint with compressed, delta or not-yet-resolved
   DCP entries is verified first instead (loading/load_session.verify), then copied. The
   manifest is decoded unless ``known`` has the record this process committed as its bytes;
2. every entry checked (a damaged copy in host memory is never propagated: the mismatch is
   raised and what this copy wrote is removed);
3. commit the source's manifest bytes in the target (storage's atomic commit, under the
   target's claim). A failure before the commit removes the files this copy wrote
   (storage/steps.attempt), and a kill leaves the target without a manifest: incomplete, which
   restore never picks and the next copy of that step writes over (the files it names, and
   only those, are removed first, under the target's claim).

Files are copied as bytes rather than loaded and saved again: no tensors are made, host memory
stays one buffer, and the target holds exactly the bytes whose checksums were verified.

Owns: that copy. Does not own: which step to copy when (drain.py), the staging's lifetime
(ckptio/resources.py), the stores (storage/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckptio.alignment import BLOCK, is_aligned
from ckptio.errors import CkptError, CorruptCheckpointError, StorageIOError
from ckptio.format.checksum import stored_algorithm
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.format.types import Manifest, TensorEntry
from ckptio.loading import dcpdir, load_session
from ckptio.loading.checks import Checker
from ckptio.io import stall
from ckptio.storage import steps
from ckptio.storage.files import IOResources, StoreFiles
from ckptio.storage.store_contract import Store, new_save_id

__all__ = ["Known", "Pace", "copy_checkpoint"]

Pace = Callable[[int], None]  # called with the bytes just copied; may sleep to hold a rate
# the source's manifest bytes -> the record this process committed as those bytes, or None
Known = Callable[[bytes], Manifest | None]


def copy_checkpoint(resources: IOResources, source: Store, target: Store,
                    pace: Pace | None = None, *, known: Known | None = None) -> int:
    """Copy the checkpoint committed in ``source`` to ``target`` (see the module docstring);
    -> bytes copied. CorruptCheckpointError if the source fails verification (nothing is
    written, or what was is removed). ``known``: the record this process committed as the
    source's manifest bytes (saving/commits.py), which then is not decoded again."""
    manifest = source.read_manifest()
    record = _committed_here(source, manifest, known)
    if record is None:
        opened = load_session.open_checkpoint(resources, source, None, allow_pickle=False)
        record = opened.record
        if not _streamable(record):
            load_session.verify(resources, opened)
    files = {f.name: f.nbytes for f in record.files}
    for name, nbytes in files.items():
        if not is_aligned(nbytes):
            raise CkptError(f"{source.path_of(name)}: {nbytes} bytes, not a multiple of {BLOCK}; "
                            "only checkpoints ckptio saved are copied between tiers")
    activity = stall.watched(target.location, 0, resources.options.io_stall_warn_s)
    try:
        _copy_files(resources, source, target, record, files, manifest, pace, activity)
    finally:
        activity.finish()
    return sum(files.values())


def _copy_files(resources: IOResources, source: Store, target: Store, record: Manifest,
                files: dict[str, int], manifest: bytes, pace: Pace | None,
                activity: stall.Activity) -> None:
    """copy_checkpoint's files and commit, their reads, writes, fsyncs and commit watched (a
    copy hung in the source's or the target's storage is warned about as a save's is:
    io/stall.py)."""
    names = list(files)
    with steps.attempt(target, names):
        held = target.exclusive("raise")
        committed = False
        try:
            leftovers = list(target.sizes(names))  # of an interrupted copy of this step
            if leftovers and target.remove(leftovers):
                raise StorageIOError(f"{target.location}: could not remove the files an "
                                     f"interrupted copy left: {', '.join(leftovers)}")
            with resources.lock:
                _pool, reader = resources.files(source)
                reader = reader.watched(activity)  # a hung read of the source is said too
                pool, writer = resources.files(target)
                if pool is not _pool:  # a staging that remakes its pool per store cannot copy
                    raise CkptError("copy_checkpoint: the staging made another pool for "
                                    f"{target.location}; give it use_profile=False options")
                check = _Streamed(reader, record) if _streamable(record) else None
                buffer = pool.acquire()
                try:
                    for name, nbytes in files.items():
                        _copy_file(reader, writer, name, nbytes, buffer.view, pace, check,
                                   activity)
                finally:
                    pool.release(buffer)
                if check is not None:
                    check.finished()
            with activity.call("commit", target.path_of(MANIFEST_NAME)):
                target.commit(manifest, new_save_id(), held)
            committed = True
        finally:
            held.release(failed=not committed)


def _copy_file(reader: StoreFiles, writer: StoreFiles, name: str, nbytes: int,
               view: memoryview, pace: Pace | None, check: _Streamed | None,
               activity: stall.Activity) -> None:
    src = reader.open_read(name)
    try:
        dst = writer.open_write(name, nbytes)
        closing = False
        try:
            offset = 0
            while offset < nbytes:
                piece = view[:min(len(view), nbytes - offset)]
                got = reader.submit_read(src, offset, piece).result()
                if got != len(piece):
                    raise StorageIOError(f"{reader.where(name)} ends at byte {offset + got}, "
                                         f"before the {nbytes} bytes its manifest names")
                if check is not None:
                    check.passing(name, offset, piece)
                with activity.call("write", writer.where(name)):
                    writer.submit_write(dst, offset, piece).result()
                offset += len(piece)
                if pace is not None:
                    pace(len(piece))
            closing = True
            with activity.call("fsync", writer.where(name)):
                writer.close(dst, sync=True)
        finally:
            if not closing:
                writer.close(dst, sync=False)
    finally:
        reader.close(src, sync=False)


def _committed_here(source: Store, data: bytes, known: Known | None) -> Manifest | None:
    """The record ``known`` has for exactly ``data``, where the copy checks every entry as it
    passes and it has no regular section (whose chunks a full open lists): its data files
    checked present and long enough, as the full open does. Else None: open it in full."""
    record = None if known is None else known(data)
    if record is None or record.regular or not _streamable(record):
        return None
    steps.check_files(source, record)
    return record


def _streamable(record: Manifest) -> bool:
    """Whether every entry is checked from its stored bytes alone as they pass (no decoding,
    no base checkpoint, no DCP item left to open)."""
    return not any(e.coded or e.order for e in record.tensors) and not dcpdir.has_pending(record)


@dataclass
class _Whole:
    """One entry's bytes as one span (checks.Span)."""

    entry: TensorEntry
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class _Streamed:
    """Each entry's checksums over the bytes of its file as the copy reads them, in order
    (entries may overlap: each is fed every byte of its own range)."""

    def __init__(self, reader: StoreFiles, record: Manifest) -> None:
        self.checker = Checker(reader, stored_algorithm(record.checksum_algorithm),
                               record.block_nbytes, check_blocks=True)
        self.waiting: dict[str, list[_Whole]] = {}  # per file, by offset: not yet reached
        self.active: dict[str, list[_Whole]] = {}  # per file: started, not yet ended
        for entry in sorted(record.tensors, key=lambda e: (e.file, e.offset)):
            if entry.nbytes == 0:  # stored nowhere: its checksum is the empty input's
                self.checker.whole(_Whole(entry, entry.offset, 0), memoryview(b""), last=True)
            else:
                self.waiting.setdefault(entry.file, []).append(_Whole(entry, entry.offset, entry.nbytes))

    def passing(self, name: str, offset: int, piece: memoryview) -> None:
        """Bytes [offset, offset + len(piece)) of file ``name``, read in order."""
        end, waiting = offset + len(piece), self.waiting.get(name, [])
        active = self.active.setdefault(name, [])
        while waiting and waiting[0].offset < end:
            active.append(waiting.pop(0))
        still = []
        for span in active:
            lo, hi = max(span.offset, offset), min(span.end, end)
            self.checker.whole(span, piece[lo - offset:hi - offset], last=hi == span.end)
            if hi < span.end:
                still.append(span)
        self.active[name] = still

    def finished(self) -> None:
        """Every entry was checked whole (a manifest naming bytes past a file's end fails)."""
        left = [s.entry for spans in (*self.waiting.values(), *self.active.values()) for s in spans]
        if left:
            raise CorruptCheckpointError(
                f"key {left[0].key!r}: {self.checker.path(left[0])} was not read as far as "
                f"byte {left[0].offset + left[0].nbytes}, where its manifest ends it; the "
                "checkpoint is damaged, load an earlier one")
