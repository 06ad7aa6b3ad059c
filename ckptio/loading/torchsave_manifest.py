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
and pickle parsing (format/torchsave.py), reading bytes (read.py), matching keys (fill.py).
"""

from __future__ import annotations

import io
from typing import Any

import torch

from ckptio.errors import (CheckpointNotFoundError, CkptError, CorruptCheckpointError,
                           UnsupportedStateError)
from ckptio.format import torchsave as fmt
from ckptio.format.checksum import crc32
from ckptio.format import torchzip, validate, values
from ckptio.format.dcpmeta import DType
from ckptio.format.types import (DTYPE_ITEMSIZE, MAX_TREE_DEPTH, Chunk, FileInfo, Json,
                                 Manifest, ObjectEntry, TensorEntry)
# a record has one CRC and no block checksums, as a DCP item: the same widening
from ckptio.loading.foreign_common import BLOCK_NBYTES, ReadFn, raw_read, read_bytes
from ckptio.storage.store_contract import Store

__all__ = ["open_torch_save"]



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
    a dict, list or tuple, a tensor that is a partial or overlapping view of its storage (saved
    without ``.contiguous()``/``.clone()``; a transposed or channels-last tensor over its whole
    storage is read: its entry's ``order`` says how its bytes lie), two different views of one
    storage (two keys with the same view become an alias: tied weights), big-endian files."""
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
    if not isinstance(obj, (dict, list, tuple)) or isinstance(obj, fmt.TorchSize):
        raise CkptError(f"{where} holds a {type(obj).__name__}, not a dict, list or tuple: "
                        "ckptio loads a torch.save file of a state dict (load it with torch.load)")
    walk = _Walk(name, where, storages, starts)
    tree = walk.expand(obj, "", 0)
    manifest = Manifest(
        version=2, save_id="torch.save", checksum_algorithm="crc32", world_size=1,
        files=(FileInfo(name, size, 0),), tensors=tuple(walk.tensors),
        objects=tuple(walk.objects), aliases=tuple(walk.aliases), tree=tree,
        meta={"torch.save": {"archive": prefix}}, block_nbytes=BLOCK_NBYTES)
    validate.check_keys(manifest, where)
    validate.check_values(manifest, where)
    return manifest


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


class _Walk:
    """The decoded object as ckptio's flatten would hold it: tree nodes, tensor entries (one per
    storage; a second key with the same view is an alias), inline values."""

    def __init__(self, file: str, where: str, storages: dict[str, fmt.Record],
                 starts: dict[str, int]) -> None:
        self.file, self.where, self.storages, self.starts = file, where, storages, starts
        self.tensors: list[TensorEntry] = []
        self.objects: list[ObjectEntry] = []
        self.aliases: list[tuple[str, str]] = []
        # storage -> key, dtype, size, order of its first view
        self.seen: dict[str, tuple[str, str, tuple[int, ...], tuple[int, ...]]] = {}
        self.leaves: set[str] = set()

    def expand(self, value: Any, key: str, depth: int) -> Json:
        if depth > MAX_TREE_DEPTH:
            raise CkptError(f"{self.where}: key {key!r} nests deeper than {MAX_TREE_DEPTH} levels")
        sub = (lambda k: f"{key}.{k}" if key else str(k))
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
        try:
            self.objects.append(ObjectEntry(key, values.encode(_real(value))))
        except values.NotEncodable:
            raise CkptError(f"{self.where}: key {key!r} holds a {type(value).__name__}, which "
                            "ckptio does not load from torch.save files") from None
        return {"k": key}

    def _tensor(self, t: Any, key: str) -> None:
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
        if not nbytes:  # no elements: whatever its view, nothing to read
            self.tensors.append(TensorEntry(
                key=key, kind="tensor", dtype=t.dtype, shape=size, chunk=Chunk.whole(size),
                file=self.file, offset=0, nbytes=0, checksum=f"{crc32(b''):08x}"))
            return
        order = torchzip.dense_order(size, stride)
        if offset != 0 or nbytes != record.nbytes or order is None:
            raise CkptError(
                f"{self.where}: key {key!r} was saved as a view of part of a storage, or with "
                f"overlapping elements (storage offset {offset}, size {size}, stride {stride}, "
                f"{record.nbytes} storage bytes for {nbytes}), which ckptio does not read; "
                "save .contiguous().clone() of it, or load the file with torch.load")
        first = self.seen.get(storage.key)
        if first is not None:
            if first[1:] != (t.dtype, size, order):
                raise CkptError(f"{self.where}: keys {first[0]!r} and {key!r} are different views "
                                "of one storage, which ckptio does not read yet; load the file "
                                "with torch.load")
            self.aliases.append((key, first[0]))
            return
        self.seen[storage.key] = (key, t.dtype, size, order)
        start = self.starts[record.name]
        self.tensors.append(TensorEntry(
            key=key, kind="tensor", dtype=t.dtype, shape=size, chunk=Chunk((0,) * len(size), size),
            file=self.file, offset=start, nbytes=nbytes, checksum=f"{record.crc32:08x}",
            order=order))


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
