"""DCP's save plans and results, translated into ckptio's write items and manifest: pure.

    check_plan(plan, rank, path)                 every tensor item's dtype is one ckptio stores
    inline_value(item, data)                     a BYTE_IO item's value as ckptio values, its
                                                 bytes (a bytes or BytesIO value), or None
    write_item(item, data, path, raw)            a DCP WriteItem (resolved) -> types.WriteItem
    written(item, entry, rank, file_nbytes)      a persisted entry -> what a WriteResult carries
    manifest_of(metadata, results, ...)          every rank's results -> the Manifest to commit
    paths_of(keys, planner_data)                 each key's path from DCP's planner_data (for nest)

Owns: the internal key of a rank's chunk (``fqn@offsets``: a rank may hold several chunks of
one key), what the plans' and results' ``storage_data`` hold (``RankStorage``, ``Written``:
both cross processes pickled, so they are plain frozen dataclasses), the rules of the tree.
Does not own: DCP's calls and their order (writer.py), bytes (saving/), the commit (storage/).
No I/O: dataclasses and DCP's plan objects in, dataclasses out.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.planner import WriteItem as DcpItem
from torch.distributed.checkpoint.storage import WriteResult

from ckptio.errors import CkptError
from ckptio.format import manifest
from ckptio.format.types import (
    DTYPE_ITEMSIZE,
    Chunk,
    FileInfo,
    Json,
    Manifest,
    ObjectEntry,
    TensorEntry,
    WriteItem,
)
from ckptio.loading.foreign_common import expand_value, nest, torch_load_value
from ckptio.loading.torchvalues import TORCH_SAVE
from ckptio.planning import leaves

__all__ = ["TORCH_SAVE", "InlineValue", "RankStorage", "RawBytes", "Written", "check_plan",
           "dtype_name", "inline_value", "item_key", "manifest_of", "paths_of", "write_item", "written"]


@dataclass(frozen=True)
class RankStorage:
    """``SavePlan.storage_data`` of one rank's plan, set by the coordinator: this save's id."""

    save_id: str
    rank: int


@dataclass(frozen=True)
class Written:
    """``WriteResult.storage_data``: where one item's bytes went and their checksums."""

    kind: str
    sizes: tuple[int, ...]  # the chunk's sizes (a BYTE_IO item: its byte count)
    file: str
    offset: int
    nbytes: int
    checksum: str
    blocks: tuple[str, ...]
    rank: int  # the rank that wrote the file
    file_nbytes: int


@dataclass(frozen=True)
class InlineValue:
    """``WriteResult.storage_data`` of a BYTE_IO item kept as ckptio inline values (nothing
    written to a data file): its tree node and object entries, as ckptio.save stores them."""

    node: Json
    objects: tuple[ObjectEntry, ...]


@dataclass(frozen=True)
class RawBytes:
    """A BYTE_IO item whose value is ``bytes`` or an ``io.BytesIO`` (DCP's TrainState): its
    content, stored as a data entry of ``kind`` ``bytes`` / ``bytesio`` as ckptio.save does."""

    kind: str
    data: bytes


def inline_value(item: DcpItem, data: Any) -> InlineValue | RawBytes | None:
    """A BYTE_IO item's value as ckptio inline values, so the checkpoint reads like one
    ckptio.save made (``ckptio ls`` shows lr and betas, ``ckptio diff`` compares them, no
    torch.load at load time); a bytes or BytesIO value as its content (RawBytes); None (keep
    its torch.save bytes, kind ``torch_save``) when ``torch.load(weights_only=True)`` refuses
    it or a leaf is no inline value (a tensor, an array, a custom object)."""
    if item.type != WriteItemType.BYTE_IO:
        return None
    raw = data.getvalue() if hasattr(data, "getvalue") else bytes(data)
    try:
        value = torch_load_value(raw, item.index.fqn, allow_pickle=False)
    except CkptError:  # refused by weights_only, or not a torch.save value: kept as bytes
        return None
    if isinstance(value, bytearray):
        return RawBytes("bytearray", bytes(value))
    if isinstance(value, bytes):
        return RawBytes("bytes", value)
    if isinstance(value, io.BytesIO):
        return RawBytes("bytesio", value.getvalue())
    objects: list[ObjectEntry] = []
    try:
        node = expand_value(value, item.index.fqn, objects, 0)
    except CkptError:
        return None
    return InlineValue(node, tuple(objects))


def item_key(index: MetadataIndex) -> str:
    """The key of one rank's chunk of ``index.fqn``, unique on that rank."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


def dtype_name(dtype: torch.dtype, fqn: str) -> str:
    return leaves.dtype_name(dtype, fqn, "convert the tensor before saving, or save it with "
                                         "DCP's FileSystemWriter")


def check_plan(plan: SavePlan, rank: int, path: str) -> None:
    """Refuse, before any byte is written, a plan whose tensors ckptio cannot store."""
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        if item.tensor_data is None:
            raise CkptError(f"save to {path}, rank {rank}: tensor item {item.index.fqn!r} has "
                            "no tensor_data (a custom SavePlanner?); ckptio needs DCP's "
                            "WriteItem.tensor_data")
        dtype_name(item.tensor_data.properties.dtype, item.index.fqn)


def write_item(item: DcpItem, data: Any, path: str,
               content: RawBytes | None = None) -> tuple[WriteItem, torch.Tensor]:
    """The ckptio item for DCP's ``item`` whose data ``planner.resolve_data`` returned, and the
    tensor whose bytes are written (a BYTE_IO item: the torch.save bytes, as uint8; or
    ``content``'s bytes, when inline_value found a bytes or BytesIO value)."""
    key = item_key(item.index)
    if item.type == WriteItemType.BYTE_IO:
        kind, raw = (TORCH_SAVE, data.getvalue() if hasattr(data, "getvalue") else bytes(data)
                     ) if content is None else (content.kind, content.data)
        tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(
            0, dtype=torch.uint8)
        return WriteItem(key, kind, "uint8", (len(raw),), Chunk.whole((len(raw),)),
                         len(raw)), tensor
    if item.tensor_data is None or not isinstance(data, torch.Tensor):
        raise CkptError(f"save to {path}: the planner resolved tensor item {item.index.fqn!r} "
                        f"to a {type(data).__name__}, not a tensor")
    tensor = data.detach()
    chunk = Chunk(tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.chunk.sizes))
    dtype = dtype_name(tensor.dtype, item.index.fqn)
    if tuple(tensor.shape) != chunk.sizes or tensor.dtype != item.tensor_data.properties.dtype:
        raise CkptError(f"save to {path}: key {item.index.fqn!r} resolved to a {dtype} tensor of "
                        f"shape {tuple(tensor.shape)}; its plan says "
                        f"{item.tensor_data.properties.dtype} of shape {chunk.sizes}")
    nbytes = chunk.numel * DTYPE_ITEMSIZE[dtype]
    return WriteItem(key, "tensor", dtype, tuple(item.tensor_data.size), chunk, nbytes), tensor


def written(item: WriteItem, entry: TensorEntry, rank: int, file_nbytes: int) -> Written:
    return Written(item.kind, item.chunk.sizes, entry.file, entry.offset, entry.nbytes,
                   entry.checksum, entry.blocks, rank, file_nbytes)


def manifest_of(metadata: Metadata, results: Sequence[Sequence[WriteResult]], *, save_id: str,
                algorithm: str, block_nbytes: int, meta: dict[str, Json], where: str) -> Manifest:
    """The manifest of a save whose ranks wrote ``results`` (checked by the reader's key
    rules: a manifest that would not load is never committed)."""
    tensors: list[TensorEntry] = []
    files: dict[str, FileInfo] = {}
    objects: list[ObjectEntry] = []
    nodes: dict[str, Json] = {}
    for rank_results in results:
        for result in rank_results:
            w = result.storage_data
            if isinstance(w, InlineValue):
                objects.extend(w.objects)
                nodes[result.index.fqn] = w.node
                continue
            if not isinstance(w, Written):
                raise CkptError(f"save to {where}: a write result of {result.index.fqn!r} was "
                                "not made by ckptio.DcpWriter (every rank must use it)")
            tensors.append(_entry(metadata, result.index, w, where))
            files[w.file] = FileInfo(w.file, w.file_nbytes, w.rank)
    leaves = {**{t.key: {"k": t.key} for t in tensors}, **nodes}
    record = Manifest(
        version=manifest.VERSION, save_id=save_id, checksum_algorithm=algorithm,
        world_size=len(results), files=tuple(files[n] for n in sorted(files)),
        tensors=tuple(tensors), objects=tuple(objects), aliases=(),
        tree=nest(leaves, paths_of(list(leaves), metadata.planner_data), where, CkptError),
        meta=meta,
        block_nbytes=block_nbytes)
    manifest.check_keys(record, where)
    manifest.check_values(record, where)
    return record


def _entry(metadata: Metadata, index: MetadataIndex, w: Written, where: str) -> TensorEntry:
    stored = metadata.state_dict_metadata.get(index.fqn)
    if (w.kind in (TORCH_SAVE, "bytes", "bytearray", "bytesio")
            and isinstance(stored, BytesStorageMetadata)):
        return TensorEntry(index.fqn, w.kind, "uint8", w.sizes, Chunk.whole(w.sizes), w.file,
                           w.offset, w.nbytes, w.checksum, None, w.blocks)
    if w.kind == "tensor" and isinstance(stored, TensorStorageMetadata):
        chunk = Chunk(tuple(index.offset or (0,) * len(w.sizes)), w.sizes)
        return TensorEntry(index.fqn, "tensor", dtype_name(stored.properties.dtype, index.fqn),
                           tuple(stored.size), chunk, w.file, w.offset, w.nbytes, w.checksum,
                           None, w.blocks)
    raise CkptError(f"save to {where}: key {index.fqn!r} was written as {w.kind!r} but the "
                    f"metadata holds {type(stored).__name__}")


def paths_of(keys: Sequence[str], planner_data: Any) -> dict[str, tuple[str | int, ...]]:
    """Each key's path in the saved state from DCP's planner_data (key -> path tuple: a str
    part is a dict key, an int a list index); a key it lacks, or whose path does not spell the
    key, sits at the top level (``nest``)."""
    paths: Mapping[str, Any] = planner_data if isinstance(planner_data, Mapping) else {}
    return {key: _path(key, paths.get(key)) for key in keys}


def _path(key: str, path: Any) -> tuple[str | int, ...]:
    ok = (isinstance(path, (tuple, list)) and path
          and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in path)
          and ".".join(str(p) for p in path) == key)
    return tuple(path) if ok else (key,)
