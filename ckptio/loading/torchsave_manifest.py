"""A file written by ``torch.save(obj, path)``, seen as a ckptio Manifest.

``ckptio.load("model.pt", state)`` and ``ckptio.verify("model.pt")`` come here when the path is
a file (the store is its directory, the file one data file in it). Each tensor becomes an entry
over its storage record's bytes, checked against the record's CRC-32 (algorithm ``crc32``) when
it is read whole; Python values are expanded by ckptio's flatten rules into inline values, so
the caller's nested state (a model, an optimizer with its int-keyed state and param_groups, a
scheduler, a step) is filled in place by fill.py.

Call order: ``open_torch_save`` (three rounds of reads through the store's backend, then the
allow-list unpickler; the rounds and what is refused: on open_torch_save) -> the load path
reads the entries like any checkpoint's (read.py, fill.py).

Owns: detecting a torch.save file, the reads and the synthesized Manifest. Does not own: the zip
and pickle parsing (format/torchsave.py), reading bytes (read.py), matching keys (matching.py).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from typing import Any

import torch

from ckptio.errors import (CheckpointNotFoundError, CkptError, CorruptCheckpointError,
                           PickleRefusedError, UnsupportedStateError)
from ckptio.format import dtensorpickle, keyrules, torchzip, validate, values
from ckptio.format import torchsave as fmt
from ckptio.format.checksum import crc32, crc32_of_part
from ckptio.format.allowlist import DType
from ckptio.format.types import (
    DTYPE_ITEMSIZE,
    MAX_TREE_DEPTH,
    Chunk,
    FileInfo,
    Json,
    Manifest,
    ObjectEntry,
    TensorEntry,
)

# a record has one CRC and no block checksums, as a DCP item: the same widening
from ckptio.loading.foreign_common import BLOCK_NBYTES, ReadFn, raw_read, read_bytes
from ckptio.storage.store_contract import Store

__all__ = ["Archive", "MAX_SLACK_NBYTES", "Walk", "open_torch_save", "read_archive"]

MAX_SLACK_NBYTES = 64 << 20  # a view of part of a storage: at most this much more is read



def open_torch_save(store: Store, name: str, read: ReadFn) -> Manifest:
    """The Manifest of torch.save file ``name`` in ``store``.

    Three rounds of reads through the store's backend: the file's tail (its zip central
    directory: every record's size and CRC-32; a directory larger than TAIL_NBYTES is read in
    one more read), the local header of ``data.pkl`` and of every storage record (where their
    bytes start), then ``data.pkl`` itself, decoded with the allow-list unpickler of
    format/torchsave.py (weights_only's set; any other global raises PickleRefusedError and
    nothing runs). Python values (ints, floats, strings, None, the ``betas`` tuple) become
    inline values.

    Refused, each with a CkptError naming the file: a legacy
    (``_use_new_zipfile_serialization=False``) file (re-save it:
    ``torch.save(torch.load(path, weights_only=True), path)``), a top-level object that is not
    a dict, list or tuple, a tensor that is a view of its storage with gaps or overlaps (saved
    without ``.contiguous()``/``.clone()``; a transposed or channels-last tensor over its whole
    storage is read: its entry's ``order`` says how its bytes lie; a row-major view of a part,
    FSDP2's padded shard or a slice, is read when the rest of its storage is at most
    MAX_SLACK_NBYTES: ``Walk.settle``), two different views of one storage (two keys with the
    same view become an alias: tied weights), big-endian files."""
    archive = read_archive(store, name, read)
    obj, where = archive.obj, archive.where
    if not isinstance(obj, (dict, list, tuple)) or isinstance(obj, fmt.TorchSize):
        raise CkptError(f"{where} holds a {type(obj).__name__}, not a dict, list or tuple: "
                        "ckptio loads a torch.save file of a state dict (load it with torch.load)")
    walk = Walk(archive)
    tree = walk.expand(obj, "", 0)
    walk.settle(read)
    manifest = Manifest(
        version=2, save_id="torch.save", checksum_algorithm="crc32", world_size=1,
        files=(FileInfo(name, archive.size, 0),), tensors=tuple(walk.tensors),
        objects=tuple(walk.objects), aliases=tuple(walk.aliases), tree=tree,
        meta={"torch.save": {"archive": archive.prefix}}, block_nbytes=BLOCK_NBYTES)
    keyrules.check_keys(manifest, where)
    validate.check_values(manifest, where)
    return manifest


@dataclass(frozen=True)
class Archive:
    """A torch.save file opened: its decoded object, its storage records by key and the offset
    where each record's bytes start."""

    name: str
    where: str
    size: int
    prefix: str
    obj: Any
    storages: dict[str, fmt.Record]
    starts: dict[str, int]


def read_archive(store: Store, name: str, read: ReadFn) -> Archive:
    """Torch.save file ``name`` of ``store`` opened (the rounds of reads and the refusals: on
    open_torch_save); its small records checked against their CRC-32s."""
    where = store.path_of(name)
    size = store.sizes([name]).get(name)
    if size is None:
        raise CorruptCheckpointError(f"{where} disappeared while it was being opened")
    head, tail = raw_read(name, 0, min(size, 8)), raw_read(name, max(0, size - fmt.TAIL_NBYTES),
                                                   min(size, fmt.TAIL_NBYTES))
    read([head, tail])
    first = read_bytes(head)
    if not fmt.is_zip(first):
        if fmt.is_legacy(first):
            raise CkptError(
                f"{where} is a legacy torch.save file (_use_new_zipfile_serialization=False), "
                "which ckptio does not read: re-save it in the default format, e.g. "
                f"torch.save(torch.load({where!r}, weights_only=True), {where!r})")
        raise CheckpointNotFoundError(f"{where} is neither a ckptio or DCP checkpoint "
                                      "directory nor a torch.save file (no zip header at "
                                      "its start)")
    records = _directory(store, name, size, read_bytes(tail), read, where)
    prefix = next(iter(records)).partition("/")[0]
    pkl = records.get(f"{prefix}/data.pkl")
    if pkl is None:
        raise CorruptCheckpointError(f"{where}: no {prefix}/data.pkl record; not a torch.save "
                                     "file, or a damaged one")
    if pkl.nbytes > fmt.MAX_PICKLE_NBYTES:
        raise CorruptCheckpointError(f"{where}: its data.pkl is {pkl.nbytes} bytes, more than "
                                     f"the {fmt.MAX_PICKLE_NBYTES} ckptio reads")
    storages = {n.removeprefix(f"{prefix}/data/"): r for n, r in records.items()
                if n.startswith(f"{prefix}/data/")}
    small = [r for r in (pkl, records.get(f"{prefix}/byteorder")) if r is not None]
    locals_ = {r.name: raw_read(name, r.local_offset, min(fmt.LOCAL_NBYTES, size - r.local_offset))
               for r in [*small, *storages.values()]}
    read(list(locals_.values()))
    starts = {n: fmt.data_offset(read_bytes(r), records[n], size, where) for n, r in locals_.items()}
    whole = {r.name: raw_read(name, starts[r.name], r.nbytes) for r in small}
    read(list(whole.values()))
    for r in small:
        if crc32(read_bytes(whole[r.name])) != r.crc32:
            raise CorruptCheckpointError(f"{where}: record {r.name!r} fails its CRC-32; the "
                                         "torch.save file is damaged")
    order = whole.get(f"{prefix}/byteorder")
    if order is not None and read_bytes(order) != b"little":
        raise CkptError(f"{where} was saved {read_bytes(order)!r}-endian; ckptio reads "
                        "little-endian data only")
    obj = fmt.decode_pickle(read_bytes(whole[pkl.name]), where)
    return Archive(name, where, size, prefix, obj, storages, starts)


def _directory(store: Store, name: str, size: int, tail: bytes, read: ReadFn,
               where: str) -> dict[str, fmt.Record]:
    offset, nbytes = fmt.directory_span(tail, size, where)
    start = size - len(tail)
    if offset >= start:
        cd = tail[offset - start:offset - start + nbytes]
    else:
        raw = raw_read(name, offset, nbytes)
        read([raw])
        cd = read_bytes(raw)
    records = fmt.parse_directory(cd, where)
    if not records:
        raise CorruptCheckpointError(f"{where}: an empty zip, not a torch.save file")
    for r in records.values():
        if r.local_offset >= size:
            raise CorruptCheckpointError(f"{where}: record {r.name!r} starts at byte "
                                         f"{r.local_offset}, past the end of the {size}-byte "
                                         "file; the torch.save file is damaged or truncated")
    return records


class Walk:
    """The decoded object as ckptio's flatten would hold it: tree nodes, tensor entries (one per
    storage; a second key with the same view is an alias), inline values. ``rank``: the rank
    whose own values these are (None: a one-rank checkpoint's); ``sharded``: a DTensor's
    shard becomes its chunk of the global tensor (a many-rank directory; a lone file of one
    rank's shard is refused), a replica kept only where ``dtensorpickle.primary``."""

    def __init__(self, archive: Archive, rank: int | None = None, sharded: bool = False) -> None:
        self.file, self.where = archive.name, archive.where
        self.storages, self.starts = archive.storages, archive.starts
        self.rank, self.sharded = rank, sharded
        self.tensors: list[TensorEntry] = []
        self.objects: list[ObjectEntry] = []
        self.aliases: list[tuple[str, str]] = []
        # storage -> key, dtype, size, order, offset of its first view
        self.seen: dict[str, tuple[str, str, tuple[int, ...], tuple[int, ...] | None, int]] = {}
        self.parts: list[tuple[TensorEntry, fmt.Record, int]] = []  # settle() finishes them
        self.leaves: set[str] = set()

    def expand(self, value: Any, key: str, depth: int) -> Json:
        if depth > MAX_TREE_DEPTH:
            raise CkptError(f"{self.where}: key {key!r} nests deeper than {MAX_TREE_DEPTH} levels")
        def sub(k: object) -> str:
            return f"{key}.{k}" if key else str(k)

        if isinstance(value, dict):
            items = []
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise CkptError(f"{self.where}: key {key!r} has a dict key of type "
                                    f"{type(k).__name__}; ckptio holds str and int keys only")
                items.append([k, self.expand(v, sub(k), depth + 1)])
            return {"d": items}
        if isinstance(value, list):
            return {"l": [self.expand(v, sub(i), depth + 1) for i, v in enumerate(value)]}
        if isinstance(value, tuple) and not isinstance(value, fmt.TorchSize):
            return {"t": [self.expand(v, sub(i), depth + 1) for i, v in enumerate(value)]}
        if key in self.leaves:
            raise UnsupportedStateError(
                f"{self.where}: key {key!r} names two different values (a dict key containing "
                "'.' collides with a nested key: ckptio joins keys with '.'); the file is not "
                "damaged: load it with torch.load, or rename one key and save it again")
        self.leaves.add(key)
        if isinstance(value, torchzip.TensorRef):
            self._tensor(value, key)
            return {"k": key}
        if isinstance(value, dtensorpickle.DTensorRef):
            self._dtensor(value, key)
            return {"k": key}
        try:
            self.objects.append(ObjectEntry(key, values.encode(_real(value)), self.rank))
        except values.NotEncodable:
            raise PickleRefusedError(  # allow_pickle: torch.load's result (load_session.py)
                f"{self.where}: key {key!r} holds a {type(value).__name__}, which "
                "ckptio does not load from torch.save files: load the file with torch.load, "
                "or ckptio.load(path, allow_pickle=True) if you trust it") from None
        return {"k": key}

    def _dtensor(self, ref: dtensorpickle.DTensorRef, key: str) -> None:
        offsets, sizes = dtensorpickle.box(ref, key, self.where)
        if sizes != ref.shape and not self.sharded:
            raise CkptError(
                f"{self.where}: key {key!r} is one rank's shard of a DTensor (mesh {ref.mesh}, "
                f"coordinate {ref.coordinate}); ckptio reads such files as part of the "
                "directory that holds every rank's file (a torch_checkpointing checkpoint): "
                "pass the directory")
        if ref.local.dtype != ref.dtype or tuple(ref.local.size) != sizes:
            raise CorruptCheckpointError(
                f"{self.where}: key {key!r}: its local tensor is {ref.local.dtype} "
                f"{tuple(ref.local.size)}, its DTensor spec says {ref.dtype} {sizes} (global "
                f"{ref.shape}); the file is damaged")
        if not self.sharded:
            self._tensor(ref.local, key)
        elif dtensorpickle.primary(ref) and (all(sizes) or not all(ref.shape)):
            self._tensor(ref.local, key, (ref.shape, offsets))

    def _tensor(self, t: Any, key: str,
                place: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> None:
        """``place``: a DTensor shard's (global shape, offsets); its entry is then part of one
        global tensor (rank None)."""
        storage = t.storage
        record = self.storages.get(storage.key)
        if record is None:
            raise CorruptCheckpointError(f"{self.where}: key {key!r} refers to storage "
                                         f"{storage.key!r}, which has no data record")
        itemsize = DTYPE_ITEMSIZE[t.dtype]
        storage_nbytes = storage.numel * (1 if storage.kind.dtype is None else itemsize)
        if storage_nbytes != record.nbytes:
            raise CorruptCheckpointError(
                f"{self.where}: key {key!r}: storage {storage.key!r} holds {record.nbytes} bytes, "
                f"its pickle says {storage_nbytes}")
        size, stride, offset = t.size, t.stride, t.offset
        if not (type(offset) is int and type(size) is tuple and type(stride) is tuple
                and all(type(i) is int and 0 <= i < 1 << 62 for i in (*size, *stride))):
            raise CorruptCheckpointError(f"{self.where}: key {key!r} has a malformed view")
        numel = 1
        for d in size:
            numel *= d
        nbytes = numel * itemsize
        shape, offsets = place or (size, (0,) * len(size))
        rank = None if place is not None else self.rank
        if not nbytes:  # no elements: whatever its view, nothing to read
            self.tensors.append(TensorEntry(
                key=key, kind="tensor", dtype=t.dtype, shape=shape, chunk=Chunk(offsets, size),
                file=self.file, offset=0, nbytes=0, checksum=f"{crc32(b''):08x}", rank=rank))
            return
        order = torchzip.dense_order(size, stride)
        if order and place is not None and size != shape:
            order = None  # a transposed shard: read.py permutes whole tensors only
        head = offset * itemsize
        whole = offset == 0 and nbytes == record.nbytes and order is not None
        if not whole and not (order == () and head + nbytes <= record.nbytes
                              and record.nbytes - nbytes <= MAX_SLACK_NBYTES):
            raise CkptError(
                f"{self.where}: key {key!r} was saved as a view of part of a storage with gaps "
                f"or overlapping elements, or of a storage more than {MAX_SLACK_NBYTES} bytes "
                f"larger than it (storage offset {offset}, size {size}, stride {stride}, "
                f"{record.nbytes} storage bytes for {nbytes}), which ckptio does not read; "
                "save .contiguous().clone() of it, or load the file with torch.load")
        first = self.seen.get(storage.key)
        if first is not None:
            if first[1:] != (t.dtype, size, order, offset):
                raise CkptError(f"{self.where}: keys {first[0]!r} and {key!r} are different views "
                                "of one storage, which ckptio does not read yet; load the file "
                                "with torch.load")
            self.aliases.append((key, first[0]))
            return
        self.seen[storage.key] = (key, t.dtype, size, order, offset)
        assert order is not None  # internal: a whole storage has one, a part is row-major (())
        entry = TensorEntry(
            key=key, kind="tensor", dtype=t.dtype, shape=shape, chunk=Chunk(offsets, size),
            file=self.file, offset=self.starts[record.name] + head, nbytes=nbytes,
            checksum=f"{record.crc32:08x}", order=order, rank=rank)
        if whole:
            self.tensors.append(entry)
        else:
            self.parts.append((entry, record, head))

    def settle(self, read: ReadFn) -> None:
        """The entries of tensors that are part of their storage (FSDP2's padded shards, a
        slice): the storage's bytes around each read (one round) and the entry given the
        CRC-32 of its own bytes (checksum.crc32_of_part)."""
        around = []
        for entry, record, head in self.parts:
            tail = record.nbytes - head - entry.nbytes
            start = self.starts[record.name]
            around.append((raw_read(self.file, start, head) if head else None,
                           raw_read(self.file, entry.offset + entry.nbytes, tail)
                           if tail else None, tail))
        read([r for h, t, _ in around for r in (h, t) if r is not None])
        for (entry, record, _), (h, t, tail) in zip(self.parts, around):
            part = crc32_of_part(record.crc32, crc32(read_bytes(h)) if h else 0,
                                 crc32(read_bytes(t)) if t else 0, entry.nbytes, tail)
            self.tensors.append(replace(entry, checksum=f"{part:08x}"))
        self.parts = []


def _real(value: Any) -> Any:
    """A decoded stand-in as the torch value it stands for."""
    if isinstance(value, fmt.TorchSize):
        return torch.Size(value)
    if isinstance(value, DType):
        return getattr(torch, value.name)
    if isinstance(value, fmt.Device):
        return torch.device(*value.args)
    if isinstance(value, io.BytesIO):  # the allow-list's stand-in: a plain BytesIO
        return io.BytesIO(value.getvalue())
    return value
