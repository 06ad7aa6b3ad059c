"""What the foreign formats ckptio loads share: raw reads of their own metadata, DCP detection,
and turning saved Python values into ckptio's inline values and tree.

* ``raw_read`` / ``read_bytes`` / ``read_small``: unverified reads through the store's backend
  (``read``: the caller's read_regions over the store, so an ``s3://`` location is read the same
  way) of a format's own metadata (a DCP ``.metadata`` and item heads, a torch.save zip's
  records, a safetensors header); the format's parser checks what it reads.
* ``holds_dcp``: whether a location holds a DCP checkpoint ckptio reads (loading/dcpdir.py opens
  it); per-rank ``__{rank}.metadata`` layouts are refused, naming the fix.
* ``decode_value`` / ``torch_load_value``: a DCP value item (BYTE_IO: optimizer
  hyper-parameters, Python numbers and containers) or torch.save value decoded with
  ``torch.load(weights_only=True)`` (``weights_only=False`` only with ``allow_pickle=True``),
  its zip records checked against their CRC-32s first.
* ``expand_value`` / ``nest``: such a value as ckptio's flatten would hold it (a DCP
  ``optim.param_groups.0.betas`` tuple becomes ``...betas.0`` and ``...betas.1``; values that
  decode to something ckptio cannot hold inline, tensors or arrays inside a value, are refused
  with a CkptError naming the key and the fix), and the tree of DCP's planner_data.

Owns: those helpers. Does not own: the DCP Manifest and its items (dcpdir.py), the pickle and
zip parsing (format/), reading bytes (read.py), matching keys (matching.py).
"""

from __future__ import annotations

import io
import pickle
import re
import threading
import zipfile
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ckptio.errors import CkptError, CorruptCheckpointError, PickleRefusedError
from ckptio.format import containers, dcpmeta, values
from ckptio.format.types import (
    MAX_TREE_DEPTH,
    Chunk,
    Json,
    ObjectEntry,
    Read,
    TensorEntry,
)
from ckptio.storage.store_contract import Store

__all__ = ["BLOCK_NBYTES", "TORCH_PICKLE", "NotInline", "ReadFn", "decode_value", "expand_value",
           "holds_dcp", "item_name", "kept_pickled", "nest", "not_a_zip", "raw_read", "read_bytes",
           "read_small", "torch_load_value", "unpicklable", "value_node"]

ReadFn = Callable[[list[Read]], int]  # raw reads through the store's backend, unverified
TORCH_PICKLE = "torch_pickle"  # a value's torch.save bytes, loaded only with allow_pickle
BLOCK_NBYTES = 1 << 61  # DCP items have no block checksums: a partial read widens to the item
_RANK_METADATA = "__0.metadata"
_CANONICAL_INT = re.compile(r"0|[1-9][0-9]{0,17}")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the terminal styling in torch's messages


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


def item_name(store: Store, key: str, file: str) -> str:
    """How messages name a DCP item: its data file and key."""
    return f"{store.path_of(file)} (item of key {key!r})"


def not_a_zip(where: str, offset: int) -> CkptError:
    """The error of a DCP item whose bytes do not begin as a torch.save zip (FileSystemWriter's
    default items): damage where the item begins its data file (a file in DCP's safetensors
    format begins with its header, never an item), else damage or another format."""
    if offset == 0:
        return CorruptCheckpointError(
            f"{where} does not begin as a torch.save zip, and it begins its data file (where "
            "another DCP format keeps its header, not an item): the data file is damaged; load "
            "an earlier checkpoint")
    return CkptError(f"{where} is not a torch.save zip: its data file is damaged (load an "
                     "earlier checkpoint), or was written in DCP's serialization_format="
                     "SAFETENSORS or by another writer, which ckptio does not read (load it "
                     "with torch.distributed.checkpoint.load)")


def decode_value(store: Store, item: dcpmeta.DcpItem, raw: bytes, allow_pickle: bool) -> Any:
    """A value item's ``raw`` bytes (a torch.save zip) decoded, its records checked against
    their CRC-32s first."""
    where = item_name(store, item.fqn, item.file)
    if raw[:4] != b"PK\x03\x04":
        raise not_a_zip(where, item.offset)
    try:  # the records' CRC-32s first: a value item has no checksum a read checks
        bad = zipfile.ZipFile(io.BytesIO(raw)).testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
        raise CorruptCheckpointError(f"{where} is not a readable zip ({exc}); the DCP data "
                                     "file is damaged: load an earlier checkpoint") from None
    if bad is not None:
        raise CorruptCheckpointError(f"{where}: record {bad!r} fails its CRC-32; the DCP data "
                                     "file is damaged: load an earlier checkpoint")
    return torch_load_value(raw, where, allow_pickle)


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
            f"({_ANSI.sub('', str(exc).splitlines()[0])[:200]}); unpickling runs arbitrary code, so it needs "
            f"load(..., allow_pickle=True) for a checkpoint you trust{note}") from None
    except (ImportError, AttributeError) as exc:  # a class the unpickler cannot find
        raise unpicklable(where, exc) from None
    except (RuntimeError, EOFError, ValueError, KeyError) as exc:
        raise CorruptCheckpointError(f"{where} is not a readable torch.save value: "
                                     f"{type(exc).__name__}: {exc}") from None


def unpicklable(where: str, exc: ImportError | AttributeError) -> CkptError:
    """The error for a pickled value whose class this process cannot import."""
    return CkptError(
        f"{where}: its pickled value names a class this process cannot find "
        f"({type(exc).__name__}: {exc}); import the module that defines it before loading "
        "(the training code's), or leave the key out with keys=...")


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


def value_node(decoded: Callable[[], Any], key: str, objects: list[ObjectEntry],
               allow_pickle: bool) -> Json | None:
    """The tree node of the value ``decoded()`` returns, its inline entries added to
    ``objects``; None where it loads only by unpickling (weights_only refuses it; with
    ``allow_pickle``, also one that holds an object ckptio cannot hold inline): the caller
    keeps its bytes as a ``torch_pickle`` entry, which a load asking for the key refuses
    without allow_pickle, naming it, and the other keys load."""
    mine: list[ObjectEntry] = []
    try:
        node = expand_value(decoded(), key, mine, 0)
    except PickleRefusedError:
        return None
    except NotInline:
        if not allow_pickle:
            raise
        return None
    objects.extend(mine)
    return node


def kept_pickled(key: str, file: str, offset: int, raw: bytes) -> TensorEntry:
    """The ``torch_pickle`` entry of a DCP value item (``raw``: its bytes) that value_node
    left to the load, checked by its CRC-32 as it is read."""
    return TensorEntry(key=key, kind=TORCH_PICKLE, dtype="uint8", shape=(len(raw),),
                       chunk=Chunk.whole((len(raw),)), file=file, offset=offset,
                       nbytes=len(raw), checksum=f"{zlib.crc32(raw):08x}")


class NotInline(CkptError):
    """A decoded value holds an object ckptio cannot hold as an inline value."""


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
        raise NotInline(
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
    str, and optimizer state is keyed by int. A level whose indices are exactly 0..n-1 (n >= 1)
    is a list (an empty level, the top of a state DCP flattened to nothing, is a dict); one
    with gaps (DCP saves nothing for an empty dict in a list) keeps its indices as dict keys,
    so every key still names its own value. ``error`` (naming ``where``) for paths
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
    if level and {part for part in level} == {("l", i) for i in range(len(level))}:
        return {"l": [_node(level[("l", i)]) for i in range(len(level))]}
    return {"d": [[key, _node(child)] for (_kind, key), child in level.items()]}
