"""``ckptio.DcpReader``: a torch.distributed.checkpoint StorageReader over ckptio's read path.

    dcp.load(state, storage_reader=ckptio.DcpReader("ckpts/step-100"))

Reads a checkpoint written by ``ckptio.save`` (any number of ranks, any layout: DTensor,
TensorShard, FlatShard, per-rank values, inline values, aliases) or a stock DCP directory
(through the Manifest loading/dcpdir.py makes of it), with DCP's planners doing the resharding.

Call order (DCP's): ``read_metadata`` (the manifest as DCP's ``Metadata``; keys by readmeta.py)
-> ``set_up_storage_reader`` -> ``prepare_local_plan`` / ``prepare_global_plan`` ->
``read_data`` (one ``loading/read.read_regions`` pass through the shared Checkpointer's pool and
backend, then the commits). Errors are CkptError subclasses naming the key, file and fix; how
DCP wraps them is on ``read_data`` and ``read_metadata``.

Owns: the StorageReader protocol and the translation of DCP items into ckptio reads. Does not
own: the key walk (readmeta.py), I/O and checksums (loading/read.py via api.Checkpointer),
opening foreign checkpoints (loading/dcpdir.py).
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptio.api import Checkpointer
from ckptio.dcp import readmeta
from ckptio.errors import CkptError, CorruptCheckpointError, PickleRefusedError
from ckptio.format import values
from ckptio.format.flatten import unflatten
from ckptio.format.types import PICKLED_KINDS, Chunk, Manifest, Read
from ckptio.io.buffers import torch_dtype
from ckptio.loading.stored import RankPolicy, stored_value
from ckptio.loading.foreign_common import torch_load_value
from ckptio.options import Options
from ckptio.shared import checkpointer
from ckptio.storage.select import checkpoint_path, is_checkpoint_id

__all__ = ["DcpReader"]


class DcpReader(StorageReader):
    """Read a ckptio (or stock DCP) checkpoint with ``torch.distributed.checkpoint.load``.

    path: the checkpoint directory or ``s3://`` prefix. options: ckptio Options for the reads
    (default: the environment's, shared with ckptio.load). verify: check checksums (default
    Options.verify). allow_pickle: load values saved pickled (trusted files only).
    per_rank_from: which saved rank's per-rank values (RNG state) this rank takes when loading
    on another number of ranks (as in ckptio.load). Holds no open resource until DCP calls it,
    and pickles as its arguments only.
    """

    def __init__(self, path: str | os.PathLike[str], *, options: Options | None = None,
                 verify: bool | None = None, allow_pickle: bool = False,
                 per_rank_from: RankPolicy = None) -> None:
        super().__init__()
        self.path = checkpoint_path(path)
        self.options, self.verify = options, verify
        self.allow_pickle, self.per_rank_from = allow_pickle, per_rank_from
        self._record: Manifest | None = None
        self._metadata: Metadata | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "options": self.options, "verify": self.verify,
                "allow_pickle": self.allow_pickle, "per_rank_from": self.per_rank_from}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._record, self._metadata = None, None

    @property
    def checkpoint_id(self) -> str:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = checkpoint_path(checkpoint_id)
        self._record, self._metadata = None, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """True for a local path and an ``s3://`` URL (another URL scheme is not ckptio's)."""
        return is_checkpoint_id(checkpoint_id)

    # ---------------------------------------------------------------------------- metadata

    def _checkpointer(self) -> Checkpointer:
        return checkpointer(self.options)

    def read_metadata(self) -> Metadata:
        """DCP's Metadata of the checkpoint, as this rank sees it (per-rank values: the saved
        rank ``per_rank_from`` picks for it). A stock DCP directory has every item opened here
        (opening only the items a rank's plan reads was slower: docs/BENCH_INTEROP.md, "each
        rank opens only the items it needs"). An error raised here reaches the caller as the
        text of an AssertionError in DCP's CheckpointException (DCP's fallback to rank-local
        metadata swallows the exception object)."""
        record = self._checkpointer().manifest(self.path, allow_pickle=self.allow_pickle)
        rank, world_size = _rank()
        view = readmeta.dcp_view(record, rank=rank, world_size=world_size,
                                 per_rank_from=self.per_rank_from, where=self.path)
        self._record = record
        self._metadata = _metadata(view, self.path)
        return self._metadata

    def _opened(self) -> tuple[Manifest, Metadata]:
        """The manifest and metadata of this load (read now if DCP has not asked yet)."""
        if self._record is None or self._metadata is None:
            self.read_metadata()
        if self._record is None or self._metadata is None:
            raise CkptError(f"{self.path}: the checkpoint's metadata could not be read")
        return self._record, self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # ---------------------------------------------------------------------------- data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every item of ``plan`` in one read pass, then committed to the planner; -> a
        completed Future. Tensor items become ckptio Reads filled by one
        ``loading/read.read_regions`` pass (coalesced aligned reads, checksums, block checks for
        partial reads); BYTE_IO items are rebuilt from the inline values and data entries under
        their key and handed to the planner as ``torch.save`` bytes. DCP wraps an error raised
        here in its CheckpointException, ``failures[rank]`` holding the CkptError itself."""
        record, metadata = self._opened()
        batch = _Batch(metadata.storage_data, self.path, self.allow_pickle)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                batch.value(item)
            else:
                batch.tensor(item, planner)
        batch.refuse_pickles()
        self._checkpointer().read(self.path, record, batch.reads, verify=self.verify)
        batch.finish(planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _metadata(view: readmeta.DcpView, path: str) -> Metadata:
    """DCP's Metadata: every key's storage metadata, planner_data (key -> path) and
    storage_data (MetadataIndex -> the readmeta Box or ValueKey behind it)."""
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    paths: dict[str, readmeta.Path] = {}
    storage: dict[MetadataIndex, readmeta.Box | readmeta.ValueKey] = {}
    for key in view.keys:
        paths[key.fqn] = key.path
        if isinstance(key, readmeta.ValueKey):
            state[key.fqn] = BytesStorageMetadata()
            storage[MetadataIndex(key.fqn)] = key
            continue
        state[key.fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch_dtype(key.dtype)),
            size=torch.Size(key.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.sizes))
                    for b in key.boxes])
        for box in key.boxes:
            storage[MetadataIndex(key.fqn, box.offsets)] = box
    return Metadata(state_dict_metadata=state, planner_data=paths, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=path), version="1.0.0")


class _Batch:
    """The reads of one plan: tensor items into the planner's tensors (through a staged tensor
    when the dtype differs), and the data entries BYTE_IO values need, read whole."""

    def __init__(self, table: Any, path: str, allow_pickle: bool) -> None:
        self.table, self.path, self.allow_pickle = table, path, allow_pickle
        self.reads: list[Read] = []
        self.tensors: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None]] = []
        self.values: list[tuple[ReadItem, readmeta.ValueKey, dict[str, torch.Tensor]]] = []

    def lookup(self, item: ReadItem) -> Any:
        try:
            return self.table[item.storage_index]
        except (KeyError, TypeError):
            raise CkptError(
                f"{self.path}: dcp.load asked for {item.storage_index.fqn!r} at offsets "
                f"{tuple(item.storage_index.offset or ())}, which this checkpoint's metadata "
                "does not hold; pass the metadata DcpReader.read_metadata returned (do not mix "
                "readers)") from None

    def tensor(self, item: ReadItem, planner: LoadPlanner) -> None:
        box = self.lookup(item)
        dest = planner.resolve_tensor(item).detach()
        stored = torch_dtype(box.entry.dtype)
        target = dest if dest.dtype == stored else torch.empty(tuple(item.lengths), dtype=stored)
        region = readmeta.region(box, item.storage_offsets, item.lengths)
        if tuple(target.shape) != region.sizes:
            raise CkptError(f"{self.path}: key {item.dest_index.fqn!r}: the planner resolved a "
                            f"tensor of shape {tuple(dest.shape)} for a read of {region.sizes}")
        self.reads.append(Read(item.storage_index.fqn, (box.entry,), region, target))
        self.tensors.append((item, dest, None if target is dest else target))

    def value(self, item: ReadItem) -> None:
        value = self.lookup(item)
        readmeta.refuse(value)
        made: dict[str, torch.Tensor] = {}
        for key, entries in value.tensors:
            head = entries[0]
            made[key] = torch.empty(head.shape, dtype=torch_dtype(head.dtype))
            self.reads.append(Read(key, entries, Chunk.whole(head.shape), made[key]))
        self.values.append((item, value, made))

    def refuse_pickles(self) -> None:
        pickled = sorted(k for _i, v, _m in self.values for k, es in v.tensors
                         if es[0].kind in PICKLED_KINDS)
        if pickled and not self.allow_pickle:
            raise PickleRefusedError(
                f"{self.path}: keys {pickled[:10]} were saved pickled; unpickling runs "
                "arbitrary code, so it needs DcpReader(path, allow_pickle=True) for a "
                "checkpoint you trust (or leave them out of the state)")

    def finish(self, planner: LoadPlanner) -> None:
        """After the reads: dtype conversions, commits, and the BYTE_IO values."""
        with torch.no_grad():
            for item, dest, staged in self.tensors:
                if staged is not None:
                    dest.copy_(staged)
                planner.commit_tensor(item, dest)
        for item, value, made in self.values:
            planner.load_bytes(item, _torch_saved(value, made, self.path, self.allow_pickle))


def _torch_saved(value: readmeta.ValueKey, made: dict[str, torch.Tensor], path: str,
                 allow_pickle: bool) -> io.BytesIO:
    """The value of a BYTE_IO key as ``torch.save`` bytes (a ``torch_save`` entry: its bytes
    as stored, which are exactly that). DCP's planner decodes them with
    ``torch.load(weights_only=False)``: without ``allow_pickle`` they must first decode with
    ``weights_only=True``, so nothing outside torch's allow-list is unpickled."""
    heads = {key: entries[0] for key, entries in value.tensors}
    if "k" in value.node and value.node["k"] in heads and heads[value.node["k"]].kind == "torch_save":
        raw = made[value.node["k"]].numpy().tobytes()
        if not allow_pickle:
            torch_load_value(raw, f"{path}: key {value.node['k']!r}", False,
                             " (DcpReader(path, allow_pickle=True))")
        return io.BytesIO(raw)
    leaves: dict[str, Any] = {}
    for entry in value.objects:
        try:
            leaves[entry.key] = values.decode(entry.value)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{path}: key {entry.key!r}: stored value is "
                                         f"malformed: {exc}") from None
    for key, tensor in made.items():
        leaves[key] = stored_value(heads[key], tensor)
    buffer = io.BytesIO()
    torch.save(unflatten(value.node, leaves), buffer)
    buffer.seek(0)
    return buffer
