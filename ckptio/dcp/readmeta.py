"""A ckptio Manifest as torch.distributed.checkpoint (DCP) sees it: DCP's keys, their
planner_data paths, and the stored bytes behind each.

DCP flattens a state dict by its own rules (torch 2.13, ``_traverse.traverse_state_dict``): a
dict is always descended into, its keys becoming ``str(k)``; a list is descended into (its
indices staying ints) only when it holds a tensor, a mapping or a list that is itself descended
into; a tuple, and every other value, is one leaf. A tensor leaf is a TENSOR item, any other
leaf one BYTE_IO item (``torch.save`` of the whole value). This module walks the manifest's tree
by those rules (a Stateful's ``{"s": ...}`` node is its state dict), so a state saved with
``ckptio.save`` and the same state saved with ``dcp.save`` have the same keys and paths:
``optim.param_groups.0.betas`` is one BYTE_IO key here although ckptio stores ``...betas.0``
and ``...betas.1``.

Tensor keys become boxes (DCP chunks): a box chunk as it is, a flat chunk (FlatShard, FSDP1)
as the at most ``2*ndim-1`` boxes it is made of (format/geometry.py), each backed by the entry.
A per-rank key is the value of the saved rank ``per_rank_from`` picks for this rank (loading/
stored.Sources); one this rank cannot take is a BYTE_IO key whose load raises, naming the fix.
An alias key is backed by its target's entries.

Owns: the key walk and what backs each key. Does not own: DCP's own types (reader.py builds
them), reading bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError, StateMismatchError
from ckptio.format.geometry import FlatRange, flat_boxes
from ckptio.format.types import Chunk, Json, Manifest, ObjectEntry, TensorEntry
from ckptio.loading.stored import RankPolicy, Sources, TensorSource

__all__ = ["Box", "DcpView", "Path", "TensorKey", "ValueKey", "dcp_view", "refuse", "region"]

Path = tuple[str | int, ...]  # DCP's planner_data: str for dict keys, int for list indices


@dataclass(frozen=True)
class Box:
    """A DCP chunk of a tensor key: the box at ``offsets`` of size ``sizes`` of the global
    tensor, held by ``entry`` (whose chunk is this box, or a flat range containing it)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    entry: TensorEntry


@dataclass(frozen=True)
class TensorKey:
    fqn: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]


@dataclass(frozen=True)
class ValueKey:
    """A BYTE_IO key: the value of tree ``node`` (a leaf or a container), rebuilt from the
    inline ``objects`` and the data entries ``tensors`` (ckptio key -> the entries holding its
    whole value) under it. ``refused``: why this rank cannot load it (raised when asked)."""

    fqn: str
    path: Path
    node: Json
    objects: tuple[ObjectEntry, ...] = ()
    tensors: tuple[tuple[str, tuple[TensorEntry, ...]], ...] = ()
    refused: str | None = None


@dataclass(frozen=True)
class DcpView:
    keys: tuple[TensorKey | ValueKey, ...]  # in the tree's order


def dcp_view(record: Manifest, *, rank: int, world_size: int, per_rank_from: RankPolicy,
             where: str) -> DcpView:
    """The DCP keys of ``record`` on this rank (``where`` names the checkpoint in errors)."""
    root = _inner(record.tree)
    if "d" not in root:
        raise CkptError(f"{where}: the saved state is a list or tuple at the top; a DCP state "
                        "dict is a dict, so dcp.load cannot take it: load it with ckptio.load")
    walk = _Walk(record, Sources(record, rank, world_size, per_rank_from), where)
    walk.mapping(root, ())
    return DcpView(tuple(walk.keys))


def _inner(node: Json) -> Json:
    """A node without its Stateful wrappers (DCP sees the state dict) and defaultdict types
    (DCP walks any mapping); a namedtuple keeps its type: DCP saves a tuple as one value."""
    while "s" in node or ("c" in node and "d" in node["c"][1]):
        node = node["s"] if "s" in node else node["c"][1]
    return node


def _tensor_keys(record: Manifest) -> set[str]:
    """Keys whose leaf is a tensor (on any saved rank), aliases included."""
    keys = {t.key for t in record.tensors if t.kind == "tensor"}
    return keys | {alias for alias, target in record.aliases if target in keys}


class _Walk:
    def __init__(self, record: Manifest, sources: Sources, where: str) -> None:
        self.sources, self.where = sources, where
        self.tensor_keys = _tensor_keys(record)
        self.keys: list[TensorKey | ValueKey] = []

    def mapping(self, node: Json, path: Path) -> None:
        for key, child in node["d"]:
            self.visit(_inner(child), (*path, str(key)))

    def visit(self, node: Json, path: Path) -> None:
        if "d" in node:
            self.mapping(node, path)
        elif "l" in node and self.descends(node):
            for i, child in enumerate(node["l"]):
                self.visit(_inner(child), (*path, i))
        elif "k" in node and node["k"] in self.tensor_keys:
            self.tensor(node["k"], path)
        else:
            self.keys.append(self.value(node, path))

    def descends(self, node: Json) -> bool:
        """Whether DCP walks into this list (``_traverse._is_terminal`` is False)."""
        for child in node["l"]:
            child = _inner(child)
            if "d" in child or ("l" in child and self.descends(child)):
                return True
            if "k" in child and child["k"] in self.tensor_keys:
                return True
        return False

    def tensor(self, key: str, path: Path) -> None:
        fqn = ".".join(map(str, path))
        source = self.sources.get(key)
        if not isinstance(source, TensorSource):
            self.keys.append(ValueKey(fqn, path, {"k": key}, refused=self.refusal(key)))
            return
        head = source.head
        boxes = tuple(box for entry in source.entries for box in _boxes(entry))
        self.keys.append(TensorKey(fqn, path, head.dtype, head.shape, boxes))

    def value(self, node: Json, path: Path) -> ValueKey:
        fqn = ".".join(map(str, path))
        objects: list[ObjectEntry] = []
        tensors: list[tuple[str, tuple[TensorEntry, ...]]] = []
        for key in _leaves(node):
            source = self.sources.get(key)
            if source is None:
                return ValueKey(fqn, path, node, refused=self.refusal(key))
            if isinstance(source, ObjectEntry):
                objects.append(source)
            else:
                tensors.append((key, source.entries))
        return ValueKey(fqn, path, node, tuple(objects), tuple(tensors))

    def refusal(self, key: str) -> str:
        """Why this rank has no value for per-rank ``key`` (Sources.get returned None)."""
        if key in self.sources.refused:
            return (f"{self.where}: key {key!r} holds each saved rank's own value (e.g. RNG "
                    f"state), saved by {self.sources.saved_world} ranks; this load runs on a "
                    "different number of ranks, so which rank's value to take is not known: "
                    "pass DcpReader(path, per_rank_from=0) (or a mapping or function new rank "
                    "-> saved rank), or leave the key out of the state")
        return (f"{self.where}: key {key!r} holds each saved rank's own value, and saved rank "
                f"{self.sources.source_rank} did not save it: choose another rank with "
                "DcpReader(path, per_rank_from=...), or leave the key out of the state")


def _leaves(node: Json) -> list[str]:
    """The ckptio keys under ``node``, in tree order."""
    (tag, body), = node.items()
    if tag == "k":
        return [body]
    if tag == "s":
        return _leaves(body)
    if tag == "c":
        return _leaves(body[1])
    children = [child for _key, child in body] if tag == "d" else body
    return [key for child in children for key in _leaves(child)]


def _boxes(entry: TensorEntry) -> list[Box]:
    """The entry's chunk as DCP boxes (a flat range as the boxes it is made of); empty chunks
    hold nothing and are left out."""
    chunk = entry.chunk
    if chunk.flat:
        pieces = flat_boxes(FlatRange(chunk.offsets[0], chunk.sizes[0]), entry.shape)
        return [Box(box.offsets, box.sizes, entry) for _start, box in pieces]
    if chunk.numel == 0:
        return []
    return [Box(chunk.offsets, chunk.sizes, entry)]


def refuse(value: ValueKey) -> None:
    """Raise the reason ``value`` cannot be loaded on this rank, if any."""
    if value.refused is not None:
        raise StateMismatchError(value.refused)


def region(box: Box, offsets: Any, lengths: Any) -> Chunk:
    """The global region of a DCP read of ``lengths`` at ``offsets`` inside ``box``."""
    return Chunk(tuple(o + int(s) for o, s in zip(box.offsets, offsets)),
                 tuple(int(n) for n in lengths))
