"""A torch.distributed.checkpoint (DCP) directory, seen as a ckptio Manifest; its tensor items
opened where a read needs them.

``ckptio.load``, ``ckptio.verify`` and ``ckptio.DcpReader`` on a directory written by DCP's
FileSystemWriter (no ``manifest.json``, a ``.metadata``) come here. The Manifest's tree is DCP's
planner_data, so fill.py, reshard.py and read.py load it into any layout unchanged (what is
read and refused: docs/FORMAT.md, "DCP checkpoints").

Call order: ``open_dcp`` (the metadata, the files, every value item; with ``every_item`` every
tensor item opened too, else each left a ``PendingEntry``) -> ``has_pending`` ->
``resolve_reads`` just before each read pass (opens the pending items the pass's regions
overlap, and those alone) -> read.py checks each item's data against its CRC-32 as it reads.

Owns: the synthesized Manifest, pending entries and when items are opened. Does not own: the
pickle and zip parsing (format/), the value decoding and expansion (foreign_common.py), reading bytes
(read.py), matching keys (matching.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ckptio.errors import CkptError, CorruptCheckpointError
from ckptio.format import dcpmeta, keyrules, torchzip, validate
from ckptio.format.types import (
    DTYPE_ITEMSIZE,
    Chunk,
    FileInfo,
    Json,
    Manifest,
    ObjectEntry,
    Read,
    TensorEntry,
)
from ckptio.loading.foreign_common import (
    BLOCK_NBYTES,
    ReadFn,
    decode_value,
    item_name,
    kept_pickled,
    nest,
    not_a_zip,
    raw_read,
    read_bytes,
    read_small,
    value_node,
)
from ckptio.planning.reshard import FlatRange, flat_boxes, intersect
from ckptio.storage.store_contract import Store

__all__ = ["PendingEntry", "has_pending", "open_dcp", "resolve_reads"]


@dataclass(frozen=True)
class PendingEntry(TensorEntry):
    """A tensor item not opened yet: key, dtype, shape, chunk and file as the metadata says
    them, ``offset`` where the item starts (not its data), ``item_length`` its length, no
    checksum. Never read as it is: ``resolve_reads`` opens it first."""

    item_length: int = 0


def open_dcp(store: Store, read: ReadFn, *, allow_pickle: bool = False,
             every_item: bool = True) -> Manifest:
    """The Manifest of the DCP checkpoint in ``store``; with ``every_item`` every tensor item
    opened, else each left a PendingEntry.

    The metadata is decoded with the allow-list unpickler (format/dcpmeta.py); every data file
    it names must be there and long enough for its items; every value item (BYTE_IO: optimizer
    hyper-parameters, Python numbers and containers) is read whole, decoded by foreign_common.py
    (``torch.load(weights_only=True)``, ``weights_only=False`` only with ``allow_pickle``) and
    expanded by ckptio's flatten rules; one that loads only by unpickling (an object either
    refuses) stays a ``torch_pickle`` entry over its bytes, which a load asking for its key
    refuses without ``allow_pickle`` (naming it), so that the other keys still load.

    Each tensor item becomes an entry: key, dtype, shape, chunk and file from the metadata;
    where its ``data/0`` record's bytes start, the CRC-32 that follows them (checksum algorithm
    ``crc32``) and the order its dims lie in from the item's first and last bytes
    (format/torchzip.py), read in one round of coalesced reads (an item's tail and the next
    item's head are neighbours; a descriptor the tail does not hold, another writer's layout,
    in one more round). ``every_item`` (verify, ``ckptio ls`` and diff, tiering copies,
    ``DcpReader``, a one-rank load) reads them here, in the round that reads the values;
    without it (a rank of a many-rank load) ``resolve_reads`` reads them later. Either way an
    item a load reads is checked before its bytes are used: its head's records against their
    CRC-32s, its pickled tensor against the metadata (dtype, size, a dense layout), its data
    against its descriptor's CRC-32 as it is read (read.py); a failure names the key and file.

    Refused, each with a CkptError naming the path and the fix: items written through stream
    transforms, items that are not torch.save zips (e.g. ``serialization_format=SAFETENSORS``),
    tensors stored as a view of part of their storage or with overlapping elements (a
    transposed or channels-last tensor over its whole storage is read: its entry's ``order``
    says how its bytes lie), a transposed shard of a larger tensor, and values that decode to
    something ckptio cannot hold inline (tensors or arrays inside a value)."""
    where = store.path_of(dcpmeta.METADATA_NAME)
    size = store.sizes([dcpmeta.METADATA_NAME]).get(dcpmeta.METADATA_NAME)
    if size is None:
        raise CorruptCheckpointError(f"{where} disappeared while it was being opened")
    raw = read_small(read, dcpmeta.METADATA_NAME, size, dcpmeta.MAX_METADATA_NBYTES, where)
    meta = dcpmeta.decode(raw, where)
    files = _files(store, meta)
    pending = [_pending(t, chunk, item) for t in meta.tensors for chunk, item in t.chunks]
    opening = _Opening(pending if every_item else [])
    whole = [raw_read(item.file, item.offset, item.length) for item in meta.values]
    if opening.reads or whole:
        read([*opening.reads, *whole])  # one round, coalesced
    opened = opening.entries(store, read)
    objects: list[ObjectEntry] = []
    nodes: dict[str, Json] = {t.fqn: {"k": t.fqn} for t in meta.tensors}
    kept: list[TensorEntry] = []  # values that load only by unpickling: left to the load
    for item, got in zip(meta.values, whole):
        raw = read_bytes(got)
        node = value_node(lambda: decode_value(store, item, raw, allow_pickle), item.fqn, objects,
                          allow_pickle)
        if node is None:
            kept.append(kept_pickled(item.fqn, item.file, item.offset, raw))
        nodes[item.fqn] = {"k": item.fqn} if node is None else node
    manifest = Manifest(
        version=2, save_id="dcp", checksum_algorithm="crc32",
        world_size=1 + max((f.rank for f in files), default=0), files=files,
        tensors=(*(opened.get(id(e), e) for e in pending), *kept), objects=tuple(objects),
        aliases=(), tree=nest(nodes, meta.paths, where), meta={"dcp": {"version": meta.version}},
        block_nbytes=BLOCK_NBYTES)
    keyrules.check_keys(manifest, where)
    validate.check_values(manifest, where)
    return manifest


def has_pending(record: Manifest) -> bool:
    """Whether ``record`` (a DCP directory's, opened without ``every_item``) has items not
    opened yet."""
    return record.save_id == "dcp" and any(isinstance(t, PendingEntry) for t in record.tensors)


def resolve_reads(store: Store, read: ReadFn, reads: Sequence[Read]) -> list[Read]:
    """``reads`` ready for read.py: each one holding a pending entry keeps only the entries its
    region overlaps (its first one when it overlaps none: an empty region), and those items
    are opened, all in one round of reads through ``read`` (unverified: the item checks its
    own records). Reads without a pending entry pass unchanged. CkptError (naming key and file)
    for an item that does not open; none is left pending. So a rank opens the items of its own
    shards and of what it replicates, not every item of the directory."""
    kept: list[tuple[Read, tuple[TensorEntry, ...] | None]] = []
    needed: dict[int, PendingEntry] = {}
    for r in reads:
        if not any(isinstance(e, PendingEntry) for e in r.entries):
            kept.append((r, None))
            continue
        touched = tuple(e for e in r.entries if _overlaps(e, r.region)) or r.entries[:1]
        needed.update((id(e), e) for e in touched if isinstance(e, PendingEntry))
        kept.append((r, touched))
    opening = _Opening(list(needed.values()))
    if opening.reads:
        read(opening.reads)
    opened = opening.entries(store, read)
    out = [r if touched is None else Read(r.key, tuple(opened.get(id(e), e) for e in touched),
                                          r.region, r.dest)
           for r, touched in kept]
    for r in out:
        if any(isinstance(e, PendingEntry) for e in r.entries):
            raise CkptError(f"key {r.key!r}: a DCP item was about to be read before it was "
                            "opened (internal: loading/dcpdir.resolve_reads opens them)")
    return out


def _pending(t: dcpmeta.DcpTensor, chunk: Chunk, item: dcpmeta.DcpItem) -> PendingEntry:
    return PendingEntry(key=t.fqn, kind="tensor", dtype=t.dtype, shape=t.shape, chunk=chunk,
                        file=item.file, offset=item.offset,
                        nbytes=chunk.numel * DTYPE_ITEMSIZE[t.dtype], checksum="",
                        item_length=item.length)


def _overlaps(entry: TensorEntry, region: Chunk) -> bool:
    """Whether ``region`` (a box or a flat range) holds an element of ``entry``'s chunk; True
    when they cannot be compared (read.py then names what is wrong)."""
    if len(entry.chunk.offsets) != len(region.offsets) and not (entry.chunk.flat or region.flat):
        return True
    return any(intersect(a, b) is not None
               for a in _boxes(entry.chunk, entry.shape) for b in _boxes(region, entry.shape))


def _boxes(chunk: Chunk, shape: tuple[int, ...]) -> list[Chunk]:
    if not chunk.flat:
        return [chunk]
    return [box for _start, box in flat_boxes(FlatRange(chunk.offsets[0], chunk.sizes[0]), shape)]


class _Opening:
    """The reads that open ``items`` (each one's head, and its last TAIL_NBYTES when it is longer
    than a head: one round, coalesced) and the entries made of them once read."""

    def __init__(self, items: Sequence[PendingEntry]) -> None:
        self.items = list(items)
        self.heads = [raw_read(e.file, e.offset, min(e.item_length, torchzip.HEAD_NBYTES))
                      for e in self.items]
        self.tails = [_tail_read(e) if e.item_length > torchzip.HEAD_NBYTES else None
                      for e in self.items]
        self.reads = [*self.heads, *(t for t in self.tails if t is not None)]

    def entries(self, store: Store, read: ReadFn) -> dict[int, TensorEntry]:
        """id(pending entry) -> its entry, once ``reads`` are filled; descriptors the tails do
        not hold (none for FileSystemWriter's items) are read in one more round."""
        out: dict[int, TensorEntry] = {}
        later: dict[int, Read] = {}
        for pending, head, tail in zip(self.items, self.heads, self.tails):
            entry, record = _entry(store, pending, read_bytes(head))
            if record.crc32 is None:
                entry, descriptor = _with_descriptor(store, entry, pending, head, tail)
                if descriptor is not None:
                    later[id(pending)] = descriptor
            out[id(pending)] = entry
        if later:
            read(list(later.values()))
        for key, descriptor in later.items():
            out[key] = _checked(store, out[key], read_bytes(descriptor))
        return out


def _tail_read(item: PendingEntry) -> Read:
    """A read of the item's last TAIL_NBYTES bytes after its head: data/0's descriptor is
    there, so it comes in the same round as the head (and coalesces with the next item's)."""
    end = item.offset + item.item_length
    start = max(item.offset + torchzip.HEAD_NBYTES, end - torchzip.TAIL_NBYTES)
    return raw_read(item.file, start, end - start)


def _with_descriptor(store: Store, entry: TensorEntry, item: PendingEntry, head: Read,
                     tail: Read | None) -> tuple[TensorEntry, Read | None]:
    """``entry`` with the CRC-32 of the descriptor after its data, when the head or tail read
    holds it; else ``entry`` and a read of that descriptor."""
    at = entry.offset + entry.nbytes
    n = min(torchzip.DESCRIPTOR_NBYTES, item.offset + item.item_length - at)
    for raw in (head, tail):
        if raw is not None and raw.entries[0].offset <= at and \
                at + n <= raw.entries[0].offset + raw.entries[0].nbytes:
            start = at - raw.entries[0].offset
            return _checked(store, entry, read_bytes(raw)[start:start + n]), None
    return entry, raw_read(item.file, at, n)


def _checked(store: Store, entry: TensorEntry, descriptor: bytes) -> TensorEntry:
    """``entry`` with the CRC-32 of its data ``descriptor`` as its checksum."""
    crc = torchzip.parse_descriptor(descriptor, entry.nbytes,
                                    item_name(store, entry.key, entry.file))
    return dataclasses.replace(entry, checksum=f"{crc:08x}")


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


def _entry(store: Store, item: PendingEntry,
           head: bytes) -> tuple[TensorEntry, torchzip.TensorRecord]:
    """The entry of one tensor item, from its head (the checksum filled in later when the
    CRC-32 follows the data)."""
    where = item_name(store, item.key, item.file)
    if head[:4] != b"PK\x03\x04":
        raise not_a_zip(where, item.offset)
    record = torchzip.parse_head(head, item.item_length, where)
    chunk, nbytes = item.chunk, item.nbytes
    if record.dtype != item.dtype or record.size != chunk.sizes:
        raise CorruptCheckpointError(
            f"{where} holds a {record.dtype} tensor of size {record.size}; the metadata says "
            f"{item.dtype} of size {chunk.sizes}: the DCP checkpoint is damaged")
    order = torchzip.dense_order(record.size, record.stride) if nbytes else ()
    if order is None or (nbytes and (record.storage_offset != 0
                                     or record.storage_nbytes != nbytes)):
        raise CkptError(
            f"{where} was stored as a view that is not its whole storage in any dimension "
            f"order (storage offset {record.storage_offset}, stride {record.stride}, "
            f"{record.storage_nbytes} storage bytes for {nbytes}), which ckptio does not read; "
            "load it with torch.distributed.checkpoint.load (or save .contiguous())")
    if order and chunk != Chunk.whole(item.shape):
        raise CkptError(
            f"{where}: a shard (offsets {chunk.offsets}) of the tensor was stored transposed "
            f"(stride {record.stride}); ckptio reads a transposed tensor only when it is one "
            "whole item: load it with torch.distributed.checkpoint.load (or save .contiguous())")
    checksum = "" if record.crc32 is None else f"{record.crc32:08x}"
    return TensorEntry(key=item.key, kind="tensor", dtype=item.dtype, shape=item.shape,
                       chunk=chunk, file=item.file, offset=item.offset + record.data_offset,
                       nbytes=nbytes, checksum=checksum, order=order), record
