"""A torch.distributed.checkpoint (DCP) directory, seen as a ckptio Manifest.

``ckptio.load`` and ``ckptio.verify`` on a directory written by DCP's FileSystemWriter (no
``manifest.json``, a ``.metadata``) come here: the metadata is decoded with the allow-list
unpickler (format/dcpmeta.py), then every tensor item's first and last bytes are read, in one
round of coalesced reads (an item's tail and the next item's head are neighbours), to find where
its ``data/0`` record's bytes start and the CRC-32 that follows them (format/torchzip.py), and every
value item (BYTE_IO: optimizer hyper-parameters, Python numbers and containers) is read whole
and decoded with ``torch.load(weights_only=True)`` (``weights_only=False`` only with
``allow_pickle=True``). The result is a Manifest whose tensor entries point at those bytes
(checksum algorithm ``crc32``; a value item's zip records are checked against their CRC-32s
when it is decoded), whose values are expanded by ckptio's flatten rules (a DCP
``optim.param_groups.0.betas`` tuple becomes ``...betas.0`` and ``...betas.1``), and whose tree is
DCP's planner_data, so fill.py, reshard.py and read.py load it into any layout unchanged.

Every read goes through the store's backend (``read``: the caller's read_regions over the
store), so an ``s3://`` DCP prefix is read the same way.

Refused, each with a CkptError naming the path and the fix: per-rank ``__{rank}.metadata``
layouts, items written through stream transforms, items that are not torch.save zips (e.g.
``serialization_format=SAFETENSORS``), tensors stored as a view of part of their storage or
with overlapping elements (a transposed or channels-last tensor over its whole storage is read:
its entry's ``order`` says how its bytes lie), a transposed shard of a larger tensor, and values
that decode to something ckptio cannot hold inline (tensors or arrays inside a value).

Owns: detecting a DCP directory, the phase-1 reads, the synthesized Manifest. Does not own: the
pickle and zip parsing (format/), reading bytes (read.py), matching keys (fill.py).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import threading
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckptio.errors import CkptError, CorruptCheckpointError, PickleRefusedError
from ckptio.format import containers, dcpmeta, torchzip, validate, values
from ckptio.format.types import (
    DTYPE_ITEMSIZE,
    MAX_TREE_DEPTH,
    Chunk,
    FileInfo,
    Json,
    Manifest,
    ObjectEntry,
    Read,
    TensorEntry,
)
from ckptio.storage.base import Store

__all__ = ["BLOCK_NBYTES", "ReadFn", "expand_value", "holds_dcp", "nest", "open_dcp", "raw_read", "read_bytes",
           "read_small", "torch_load_value"]

ReadFn = Callable[[list[Read]], int]  # raw reads through the store's backend, unverified
BLOCK_NBYTES = 1 << 61  # DCP items have no block checksums: a partial read widens to the item
_RANK_METADATA = "__0.metadata"
_CANONICAL_INT = re.compile(r"0|[1-9][0-9]{0,17}")


def holds_dcp(store: Store) -> bool:
    """Whether ``store`` holds a DCP checkpoint ckptio reads (a ``.metadata``); CkptError for a
    per-rank metadata layout (``use_collectives=False``), which it does not."""
    found = store.sizes([dcpmeta.METADATA_NAME, _RANK_METADATA])
    if dcpmeta.METADATA_NAME in found:
        return True
    if _RANK_METADATA in found:
        raise CkptError(
            f"{store.location} is a DCP checkpoint saved without collectives: one "
            "__<rank>.metadata per rank and no .metadata, which ckptio does not read. Load it "
            "with torch.distributed.checkpoint.load, or save with collectives")
    return False


def raw_read(file: str, offset: int, nbytes: int) -> Read:
    """A read of ``nbytes`` bytes of ``file`` from ``offset``, unverified, into a new tensor."""
    entry = TensorEntry(key=f"{file}@{offset}", kind="tensor", dtype="uint8", shape=(nbytes,),
                        chunk=Chunk((0,), (nbytes,)), file=file, offset=offset, nbytes=nbytes,
                        checksum="")
    return Read.of(entry, torch.empty(nbytes, dtype=torch.uint8))


def read_bytes(read: Read) -> bytes:
    return bytes(read.dest.numpy().tobytes())


def read_small(read: ReadFn, name: str, size: int, limit: int, where: str,
               refused: str = "") -> bytes:
    """The whole ``size`` bytes of file ``name`` (a metadata or index file at ``where``),
    unverified; CorruptCheckpointError when it is larger than ``limit`` (``refused`` says what
    it then is not)."""
    if size > limit:
        raise CorruptCheckpointError(f"{where} is {size} bytes, more than the {limit} ckptio "
                                     f"reads{refused}")
    raw = raw_read(name, 0, size)
    read([raw])
    return read_bytes(raw)


def open_dcp(store: Store, read: ReadFn, *, allow_pickle: bool = False) -> Manifest:
    """The Manifest of the DCP checkpoint in ``store`` (see the module docstring)."""
    where = store.path_of(dcpmeta.METADATA_NAME)
    size = store.sizes([dcpmeta.METADATA_NAME]).get(dcpmeta.METADATA_NAME)
    if size is None:
        raise CorruptCheckpointError(f"{where} disappeared while it was being opened")
    raw = read_small(read, dcpmeta.METADATA_NAME, size, dcpmeta.MAX_METADATA_NBYTES, where)
    meta = dcpmeta.decode(raw, where)
    files = _files(store, meta)
    heads = {id(item): raw_read(item.file, item.offset, min(item.length, torchzip.HEAD_NBYTES))
             for t in meta.tensors for _chunk, item in t.chunks}
    tails = {id(item): _tail_read(item) for t in meta.tensors for _chunk, item in t.chunks
             if item.length > torchzip.HEAD_NBYTES}
    whole = {id(item): raw_read(item.file, item.offset, item.length) for item in meta.values}
    read([*heads.values(), *tails.values(), *whole.values()])  # one round, coalesced
    tensors: list[TensorEntry] = []
    descriptors: dict[int, Read] = {}  # index in tensors -> read of a descriptor not yet read
    for t in meta.tensors:
        for chunk, item in t.chunks:
            entry, record = _entry(store, t, chunk, item, read_bytes(heads[id(item)]))
            if record.crc32 is None:
                entry, raw = _with_descriptor(store, entry, item, heads[id(item)],
                                              tails.get(id(item)))
                if raw is not None:
                    descriptors[len(tensors)] = raw
            tensors.append(entry)
    if descriptors:  # none for FileSystemWriter's items: every descriptor is in a tail
        read(list(descriptors.values()))
    for i, raw in descriptors.items():
        tensors[i] = _checked(store, tensors[i], read_bytes(raw))
    objects: list[ObjectEntry] = []
    nodes: dict[str, Json] = {t.fqn: {"k": t.fqn} for t in meta.tensors}
    for item in meta.values:
        value = _decode_value(store, item, read_bytes(whole[id(item)]), allow_pickle)
        nodes[item.fqn] = expand_value(value, item.fqn, objects, 0)
    manifest = Manifest(
        version=2, save_id="dcp", checksum_algorithm="crc32",
        world_size=1 + max((f.rank for f in files), default=0), files=files,
        tensors=tuple(tensors), objects=tuple(objects), aliases=(),
        tree=nest(nodes, meta.paths, where), meta={"dcp": {"version": meta.version}},
        block_nbytes=BLOCK_NBYTES)
    validate.check_keys(manifest, where)
    validate.check_values(manifest, where)
    return manifest


def _tail_read(item: dcpmeta.DcpItem) -> Read:
    """A read of the item's last TAIL_NBYTES bytes after its head: data/0's descriptor is
    there, so it comes in the same round as the head (and coalesces with the next item's)."""
    end = item.offset + item.length
    start = max(item.offset + torchzip.HEAD_NBYTES, end - torchzip.TAIL_NBYTES)
    return raw_read(item.file, start, end - start)


def _with_descriptor(store: Store, entry: TensorEntry, item: dcpmeta.DcpItem, head: Read,
                     tail: Read | None) -> tuple[TensorEntry, Read | None]:
    """``entry`` with the CRC-32 of the descriptor after its data, when the head or tail read
    holds it; else ``entry`` and a read of that descriptor."""
    at = entry.offset + entry.nbytes
    n = min(torchzip.DESCRIPTOR_NBYTES, item.offset + item.length - at)
    for raw in (head, tail):
        if raw is not None and raw.entries[0].offset <= at and \
                at + n <= raw.entries[0].offset + raw.entries[0].nbytes:
            start = at - raw.entries[0].offset
            return _checked(store, entry, read_bytes(raw)[start:start + n]), None
    return entry, raw_read(item.file, at, n)


def _checked(store: Store, entry: TensorEntry, descriptor: bytes) -> TensorEntry:
    """``entry`` with the CRC-32 of its data ``descriptor`` as its checksum."""
    crc = torchzip.parse_descriptor(descriptor, entry.nbytes, _item_name(store, entry.key,
                                                                         entry.file))
    return dataclasses.replace(entry, checksum=f"{crc:08x}")


def _item_name(store: Store, key: str, file: str) -> str:
    return f"{store.path_of(file)} (item of key {key!r})"


def _files(store: Store, meta: dcpmeta.DcpMeta) -> tuple[FileInfo, ...]:
    """The data files the metadata names: present, and long enough for every item in them."""
    items = [item for t in meta.tensors for _chunk, item in t.chunks] + list(meta.values)
    ends: dict[str, int] = {}
    for item in items:
        ends[item.file] = max(ends.get(item.file, 0), item.offset + item.length)
    sizes = store.sizes(sorted(ends))
    out = []
    for name, end in sorted(ends.items()):
        size = sizes.get(name)
        if size is None:
            raise CorruptCheckpointError(
                f"data file {store.path_of(name)} named by {dcpmeta.METADATA_NAME} is missing; "
                "the DCP checkpoint is incomplete or damaged: load an earlier one")
        if size < end:
            raise CorruptCheckpointError(
                f"data file {store.path_of(name)} is truncated: {size} bytes, its items end at "
                f"{end}; the DCP checkpoint is damaged: load an earlier one")
        out.append(FileInfo(name, size, dcpmeta.file_rank(name) or 0))
    return tuple(out)


def _entry(store: Store, t: dcpmeta.DcpTensor, chunk: Chunk, item: dcpmeta.DcpItem,
           head: bytes) -> tuple[TensorEntry, torchzip.TensorRecord]:
    """The entry of one tensor item, from its head (the checksum filled in later when the
    CRC-32 follows the data)."""
    where = _item_name(store, t.fqn, item.file)
    if head[:4] != b"PK\x03\x04":
        raise CkptError(f"{where} is not a torch.save zip (DCP's serialization_format="
                        "SAFETENSORS, or another writer); ckptio reads only FileSystemWriter's "
                        "default items: load it with torch.distributed.checkpoint.load")
    record = torchzip.parse_head(head, item.length, where)
    nbytes = chunk.numel * DTYPE_ITEMSIZE[t.dtype]
    if record.dtype != t.dtype or record.size != chunk.sizes:
        raise CorruptCheckpointError(
            f"{where} holds a {record.dtype} tensor of size {record.size}; the metadata says "
            f"{t.dtype} of size {chunk.sizes}: the DCP checkpoint is damaged")
    order = torchzip.dense_order(record.size, record.stride) if nbytes else ()
    if order is None or (nbytes and (record.storage_offset != 0
                                     or record.storage_nbytes != nbytes)):
        raise CkptError(
            f"{where} was stored as a view that is not its whole storage in any dimension "
            f"order (storage offset {record.storage_offset}, stride {record.stride}, "
            f"{record.storage_nbytes} storage bytes for {nbytes}), which ckptio does not read; "
            "load it with torch.distributed.checkpoint.load (or save .contiguous())")
    if order and chunk != Chunk.whole(t.shape):
        raise CkptError(
            f"{where}: a shard (offsets {chunk.offsets}) of the tensor was stored transposed "
            f"(stride {record.stride}); ckptio reads a transposed tensor only when it is one "
            "whole item: load it with torch.distributed.checkpoint.load (or save .contiguous())")
    checksum = "" if record.crc32 is None else f"{record.crc32:08x}"
    return TensorEntry(key=t.fqn, kind="tensor", dtype=t.dtype, shape=t.shape, chunk=chunk,
                       file=item.file, offset=item.offset + record.data_offset, nbytes=nbytes,
                       checksum=checksum, order=order), record


def _decode_value(store: Store, item: dcpmeta.DcpItem, raw: bytes, allow_pickle: bool) -> Any:
    where = _item_name(store, item.fqn, item.file)
    if raw[:4] != b"PK\x03\x04":
        raise CkptError(f"{where} is not a torch.save zip; ckptio reads only FileSystemWriter's "
                        "default items: load it with torch.distributed.checkpoint.load")
    try:  # the records' CRC-32s first: a value item has no checksum a read checks
        bad = zipfile.ZipFile(io.BytesIO(raw)).testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
        raise CorruptCheckpointError(f"{where} is not a readable zip ({exc}); the DCP data "
                                     "file is damaged: load an earlier checkpoint") from None
    if bad is not None:
        raise CorruptCheckpointError(f"{where}: record {bad!r} fails its CRC-32; the DCP data "
                                     "file is damaged: load an earlier checkpoint")
    return torch_load_value(raw, where, allow_pickle, note=(
        " (or keys=... to leave it out is not enough: values are decoded when the checkpoint is "
        "opened)"))


def torch_load_value(raw: bytes, where: str, allow_pickle: bool, note: str = "") -> Any:
    """The value torch.save wrote as ``raw``, decoded with ``torch.load(weights_only=True)``
    (``weights_only=False`` with ``allow_pickle``); PickleRefusedError for an object the
    allow-list refuses, CorruptCheckpointError for bytes that are not a torch.save value.
    ``where`` names the bytes in the messages."""
    try:
        if allow_pickle:
            return torch.load(io.BytesIO(raw), weights_only=False, map_location="cpu")
        return _weights_only_load(raw)
    except pickle.UnpicklingError as exc:
        if allow_pickle:
            raise CorruptCheckpointError(f"{where} cannot be decoded: {exc}") from None
        raise PickleRefusedError(
            f"{where} holds a Python object that torch.load(weights_only=True) refuses "
            f"({str(exc).splitlines()[0][:200]}); unpickling runs arbitrary code, so it needs "
            f"load(..., allow_pickle=True) for a checkpoint you trust{note}") from None
    except (RuntimeError, EOFError, ValueError, KeyError) as exc:
        raise CorruptCheckpointError(f"{where} is not a readable torch.save value: "
                                     f"{type(exc).__name__}: {exc}") from None


_SAFE_GLOBALS_LOCK = threading.Lock()


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()``: how pickle protocol 2 writes ``b""`` (other bytes are ``_codecs.encode``,
    which torch allows); with arguments (a size to allocate) refused."""
    if args:
        raise ValueError("bytes() is rebuilt without arguments only")
    return b""


# What torch.load(weights_only=True) lacks for DCP's TrainState: io.BytesIO (rebuilt from its
# bytes and position; no other code runs) and b"".
_EXTRA_GLOBALS: list[Any] = [io.BytesIO, (_empty_bytes, "builtins.bytes")]


def _weights_only_load(raw: bytes) -> Any:
    """``torch.load(weights_only=True)`` that also rebuilds ``io.BytesIO`` and ``b""``
    (_EXTRA_GLOBALS). torch's allow-list is process-global: they are added for this call only,
    under a lock, and only those the caller has not added already (so none is removed from
    under them)."""
    with _SAFE_GLOBALS_LOCK:
        present = torch.serialization.get_safe_globals()
        extra = [g for g in _EXTRA_GLOBALS if g not in present]
        with torch.serialization.safe_globals(extra):
            return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")


def expand_value(value: Any, key: str, objects: list[ObjectEntry], depth: int) -> Json:
    """``value`` as ckptio's flatten would hold it under ``key``: containers as tree nodes,
    every other value an inline object entry."""
    if depth > MAX_TREE_DEPTH:
        raise CkptError(f"key {key!r}: the value nests deeper than {MAX_TREE_DEPTH} levels")
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CkptError(f"key {key!r}: a dict key of type {type(k).__name__} in a DCP "
                                "value; ckptio holds str and int keys only")
            items.append([k, expand_value(v, f"{key}.{k}", objects, depth + 1)])
        return _typed(value, key, {"d": items})
    if isinstance(value, list):
        return {"l": [expand_value(v, f"{key}.{i}", objects, depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return _typed(value, key, {"t": [expand_value(v, f"{key}.{i}", objects, depth + 1)
                                         for i, v in enumerate(value)]})
    try:
        objects.append(ObjectEntry(key, values.encode(value)))
    except values.NotEncodable:
        raise CkptError(
            f"key {key!r}: a DCP value holds a {type(value).__name__}, which ckptio does not "
            "load from DCP checkpoints yet (only None, bool, int, float, complex, str, bytes, "
            "io.BytesIO, torch.Size, dtype, device and containers of them); load it with "
            "torch.distributed.checkpoint.load, or leave it out of the saved state") from None
    return {"k": key}


def _typed(value: Any, key: str, node: Json) -> Json:
    """``node`` wrapped in the type of a namedtuple or defaultdict (format/containers.py; one
    with another factory stays a dict)."""
    info = containers.info_of(value, key, refuse=False)
    return node if info is None else {"c": [info, node]}


def nest(nodes: Mapping[str, Json], paths: Mapping[str, tuple[str | int, ...]], where: str,
         error: type[CkptError] = CorruptCheckpointError) -> Json:
    """The tree holding each key's node at its path (DCP's planner_data: a str part is a dict
    key, an int a list index; a key without a path sits at the top). A dict key DCP stored as a
    canonical decimal string ("0", "17") comes back as an int: DCP turns every dict key into a
    str, and optimizer state is keyed by int. A level whose indices are exactly 0..n-1 is a
    list; one with gaps (DCP saves nothing for an empty dict in a list) keeps its indices as
    dict keys, so every key still names its own value. ``error`` (naming ``where``) for paths
    that collide."""
    root: dict[Any, Any] = {}
    for key, node in nodes.items():
        path = paths.get(key, (key,))
        parent = root
        for part in path[:-1]:
            child = parent.setdefault(_part(part), {})
            if not isinstance(child, dict):
                raise error(f"{where}: key {key!r} lies inside another key's value in DCP's "
                            "planner_data")
            parent = child
        last = _part(path[-1])
        if last in parent:
            raise error(f"{where}: key {key!r} is named twice by DCP's planner_data")
        parent[last] = _Leaf(node)
    return _node(root)


class _Leaf:
    def __init__(self, node: Json) -> None:
        self.node = node


def _part(part: str | int) -> tuple[str, str | int]:
    """(container kind, key): ("l", index) for a list index, ("d", key) for a dict key."""
    if isinstance(part, int):
        return ("l", part)
    return ("d", int(part) if _CANONICAL_INT.fullmatch(part) else part)


def _node(level: dict[Any, Any] | _Leaf) -> Json:
    if isinstance(level, _Leaf):
        return level.node
    if {part for part in level} == {("l", i) for i in range(len(level))}:
        return {"l": [_node(level[("l", i)]) for i in range(len(level))]}
    return {"d": [[key, _node(child)] for (_kind, key), child in level.items()]}
