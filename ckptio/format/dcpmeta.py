"""DCP's ``.metadata`` (a pickle) decoded without torch and without running anything it names.

torch.distributed.checkpoint's FileSystemWriter pickles a ``Metadata`` object into
``.metadata``. This module reads it with an allow-list unpickler: ``find_class`` returns
torch-free stand-ins for exactly the globals a torch 2.13-2.15 ``.metadata`` holds (``_ALLOWED``,
whose comment lists them), refuses any other global (PickleRefusedError naming it and the
file) and every persistent id. The stand-ins are then checked field by field (types, bounds,
chunks tiling their tensor, every chunk stored once, stored items inside no one else's bytes)
into a ``DcpMeta``: plain frozen dataclasses.

Call order: ``decode(raw, where)`` -> a DcpMeta (loading/dcpdir.py makes a Manifest of it).

Owns: that allow-list, the stand-ins and the checks. Pure: bytes in, DcpMeta out; never
imports torch (a test checks it). Does not own: the unpickler and ``DType`` (allowlist.py),
reading the files (loading/dcpdir.py), the items' own zip records (torchzip.py), turning a
DcpMeta into a ckptio Manifest (loading/dcpdir.py).
"""

from __future__ import annotations

import builtins
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError, ManifestError
from ckptio.format.allowlist import PICKLE_ERRORS, AllowListUnpickler, DType
from ckptio.format.check import shared_bytes
from ckptio.format.tiling import tiling_problem
from ckptio.format.types import DTYPE_ITEMSIZE, MAX_TREE_DEPTH, Chunk, show

__all__ = ["DcpItem", "DcpMeta", "DcpTensor", "MAX_METADATA_NBYTES", "METADATA_NAME", "decode",
           "file_rank"]

METADATA_NAME = ".metadata"
MAX_METADATA_NBYTES = 256 << 20  # a .metadata larger than this is refused before it is read
_MAX_INT = 1 << 62
_MAX_NDIM = 128
_DCP_FILE = re.compile(r"__(\d{1,9})_(\d{1,9})\.distcp")
_META = "torch.distributed.checkpoint.metadata"


# ------------------------------------------------------------------------------------------------
# the results


@dataclass(frozen=True)
class DcpItem:
    """One stored item: bytes [offset, offset + length) of data file ``file``, a complete
    torch.save zip of one chunk of tensor ``fqn`` (``offsets``) or of a value (offsets None)."""

    fqn: str
    offsets: tuple[int, ...] | None
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    """A tensor of the checkpoint: its global shape and each chunk with the item storing it."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[Chunk, DcpItem], ...]


@dataclass(frozen=True)
class DcpMeta:
    """What ``.metadata`` says: tensors, values (BYTE_IO items) and each key's path in the
    saved state (``paths``: DCP's planner_data; str for dict keys, int for list indices)."""

    tensors: tuple[DcpTensor, ...]
    values: tuple[DcpItem, ...]
    paths: dict[str, tuple[str | int, ...]]
    version: str | None


def file_rank(name: str) -> int | None:
    """The rank that wrote a FileSystemWriter data file ``__{rank}_{i}.distcp``; None otherwise."""
    match = _DCP_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


# ------------------------------------------------------------------------------------------------
# stand-ins


class _Stand:
    """A record pickle builds with NEWOBJ (no arguments) and BUILD (its state, kept as is)."""

    __slots__ = ("state",)
    name = ""

    def __new__(cls, *args: Any) -> _Stand:
        if args:
            raise TypeError(f"{cls.name} is built without arguments")
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _stand(name: str) -> type[_Stand]:
    return type(name, (_Stand,), {"__slots__": (), "name": name})


_RECORDS = {name: _stand(name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "StorageMeta", "MetadataIndex", "TensorProperties", "_StorageInfo")}


@dataclass(frozen=True)
class _Layout:
    name: str


def _size(*args: Any) -> tuple[Any, ...]:
    if len(args) != 1 or not isinstance(args[0], tuple):
        raise TypeError("torch.Size takes one tuple")
    return args[0]


def _get_layout(*args: Any) -> _Layout:
    if args != ("torch.strided",):
        raise CkptError(f"layout {show(args)} is not torch.strided: ckptio reads only dense "
                        "(strided) tensors from DCP checkpoints")
    return _Layout("strided")


def _mem_format(*args: Any) -> int:
    if len(args) != 1 or type(args[0]) is not int or not 0 <= args[0] <= 2:
        raise TypeError(f"memory format code {show(args)} is unknown")
    return int(args[0])


def _posix_path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise TypeError("PosixPath parts must be strings")
    return posixpath.join(*parts) if parts else "."


# The globals a torch 2.13 to 2.15 ``.metadata`` holds (found by disassembling real checkpoints
# of varied states with pickletools; tests/fixtures/dcp has one of each); anything else is refused:
#     torch.distributed.checkpoint.metadata  Metadata, TensorStorageMetadata,
#                                            BytesStorageMetadata, ChunkStorageMetadata,
#                                            StorageMeta, MetadataIndex, TensorProperties,
#                                            _MEM_FORMAT_ENCODING (called: 0-2)
#     torch.distributed.checkpoint.filesystem  _StorageInfo
#     torch                                  Size (called with a tuple), the dtypes of
#                                            types.DTYPE_ITEMSIZE (by name)
#     torch.serialization                    _get_layout (called with "torch.strided" only)
#     pathlib                                PosixPath (called with str parts -> str)
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(_META, name): record for name, record in _RECORDS.items() if name != "_StorageInfo"},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _RECORDS["_StorageInfo"],
    (_META, "_MEM_FORMAT_ENCODING"): _mem_format,
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("pathlib", "PosixPath"): _posix_path,
    **{("torch", name): DType(name) for name in DTYPE_ITEMSIZE},
}


def _refusal(where: str) -> Callable[[str, str], str]:
    return lambda module, name: (
        f"{where} refers to the Python global {module}.{name}, which is not one that DCP "
        "metadata holds (ckptio decodes it with an allow-list and runs nothing else); the file "
        "is damaged or not DCP metadata of a torch version ckptio knows: load it with "
        "torch.distributed.checkpoint.load if you trust it")


# ------------------------------------------------------------------------------------------------
# decoding and checks


class _Check:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str) -> ManifestError:
        return ManifestError(f"{self.where}: {what}; the DCP metadata is damaged or was "
                             "written by something ckptio does not know")

    def int(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value < _MAX_INT:
            raise self.fail(f"{what} must be an integer in [0, 2^62), got {show(value)}")
        return value

    def str(self, value: Any, what: builtins.str) -> builtins.str:
        if type(value) is not str:
            raise self.fail(f"{what} must be a string, got {show(value)}")
        return value

    def ints(self, value: Any, what: builtins.str) -> tuple[builtins.int, ...]:
        if type(value) is not tuple or len(value) > _MAX_NDIM:
            raise self.fail(f"{what} must be a tuple of at most {_MAX_NDIM} integers, got "
                            f"{show(value)}")
        return tuple(self.int(v, what) for v in value)

    def fields(self, obj: Any, name: builtins.str, required: tuple[builtins.str, ...],
               optional: tuple[builtins.str, ...] = ()) -> dict[builtins.str, Any]:
        """The state of stand-in ``obj`` of record ``name``: a dict of exactly these fields."""
        if type(obj) is not _RECORDS[name]:
            raise self.fail(f"expected a {name}, got {_describe(obj)}")
        state = getattr(obj, "state", None)
        if state is None and not required:
            return {}
        if type(state) is not dict or not all(type(k) is str for k in state):
            raise self.fail(f"a {name} has no field dict (got {_describe(state)})")
        missing = [k for k in required if k not in state]
        extra = [k for k in state if k not in required and k not in optional]
        if missing or extra:
            raise self.fail(f"a {name} lacks fields {missing} or has unknown ones {extra[:5]}")
        return state


def _describe(value: Any) -> str:
    if isinstance(value, _Stand):
        return f"a {value.name}"
    return f"{type(value).__name__} {show(value)}" if not isinstance(value, (dict, list, tuple)) \
        else f"a {type(value).__name__} of {len(value)}"


def decode(data: bytes, where: str) -> DcpMeta:
    """The DcpMeta of ``.metadata`` bytes ``data`` (``where``: the file, for messages).
    PickleRefusedError for a global or persistent id off the allow-list, ManifestError for
    anything malformed, CkptError for what ckptio does not read (stream transforms)."""
    c = _Check(where)
    if len(data) > MAX_METADATA_NBYTES:
        raise c.fail(f"it is {len(data)} bytes, more than the {MAX_METADATA_NBYTES} ckptio reads")
    try:
        root = AllowListUnpickler(data, where, _ALLOWED, _refusal(where)).load()
    except CkptError:
        raise
    except PICKLE_ERRORS as exc:
        raise c.fail(f"it is not a readable pickle ({type(exc).__name__}: {exc})") from None
    top = c.fields(root, "Metadata", ("state_dict_metadata",),
                   ("planner_data", "storage_data", "storage_meta", "version"))
    version = top.get("version")
    if version is not None:
        c.str(version, "version")
    items = _storage(c, top.get("storage_data"))
    by_index = {(i.fqn, i.offsets): i for i in items}
    if len(by_index) != len(items):
        raise c.fail("storage_data names one item twice")
    described = top["state_dict_metadata"]
    if type(described) is not dict:
        raise c.fail(f"state_dict_metadata must be a dict, got {_describe(described)}")
    tensors: list[DcpTensor] = []
    values: list[DcpItem] = []
    for fqn, record in described.items():
        c.str(fqn, "a key")
        if type(record) is _RECORDS["BytesStorageMetadata"]:
            c.fields(record, "BytesStorageMetadata", ())
            values.append(_item(c, by_index, fqn, None))
        else:
            tensors.append(_tensor(c, fqn, record, by_index))
    used = len(values) + sum(len(t.chunks) for t in tensors)
    if used != len(items):
        raise c.fail(f"storage_data holds {len(items)} items, the keys use {used}")
    _check_overlaps(c, items)
    paths = _paths(c, top.get("planner_data"), described)
    return DcpMeta(tuple(tensors), tuple(values), paths, version)


def _storage(c: _Check, raw: Any) -> list[DcpItem]:
    if type(raw) is not dict:
        raise c.fail(f"storage_data must be a dict, got {_describe(raw)}")
    out = []
    for index, info in raw.items():
        key = c.fields(index, "MetadataIndex", ("fqn",), ("offset", "index"))
        fqn = c.str(key["fqn"], "MetadataIndex.fqn")
        offsets = key.get("offset")
        offsets = None if offsets is None else c.ints(offsets, f"key {fqn!r}: offset")
        hint = key.get("index")
        if hint is not None:
            c.int(hint, f"key {fqn!r}: index")
        stored = c.fields(info, "_StorageInfo", ("relative_path", "offset", "length"),
                          ("transform_descriptors",))
        transforms = stored.get("transform_descriptors")
        if transforms:
            raise CkptError(
                f"{c.where}: key {fqn!r} was written through DCP stream transforms "
                f"({show(transforms)}, e.g. compression via _extensions), which ckptio does not "
                "read; load it with torch.distributed.checkpoint.load")
        if transforms is not None and type(transforms) is not list:
            raise c.fail(f"key {fqn!r}: transform_descriptors must be a list")
        name = c.str(stored["relative_path"], f"key {fqn!r}: relative_path")
        if file_rank(name) is None:
            raise c.fail(f"key {fqn!r}: data file {show(name)} is not a FileSystemWriter file "
                         "name __<rank>_<i>.distcp in the checkpoint directory")
        out.append(DcpItem(fqn, offsets, name, c.int(stored["offset"], f"key {fqn!r}: offset"),
                           c.int(stored["length"], f"key {fqn!r}: length")))
    return out


def _item(c: _Check, by_index: dict[tuple[str, tuple[int, ...] | None], DcpItem], fqn: str,
          offsets: tuple[int, ...] | None) -> DcpItem:
    item = by_index.get((fqn, offsets))
    if item is None:
        where = "" if offsets is None else f" chunk at {offsets}"
        raise c.fail(f"key {fqn!r}{where} has no stored item in storage_data")
    return item


def _tensor(c: _Check, fqn: str, record: Any,
            by_index: dict[tuple[str, tuple[int, ...] | None], DcpItem]) -> DcpTensor:
    raw = c.fields(record, "TensorStorageMetadata", ("properties", "size", "chunks"))
    what = f"key {fqn!r}"
    dtype = _properties(c, raw["properties"], what)
    shape = c.ints(raw["size"], f"{what}: size")
    numel = 1
    for d in shape:
        numel *= max(d, 1)
        if numel >= _MAX_INT:
            raise c.fail(f"{what}: shape {shape} holds 2^62 elements or more")
    chunks_raw = raw["chunks"]
    if type(chunks_raw) is not list:
        raise c.fail(f"{what}: chunks must be a list, got {_describe(chunks_raw)}")
    chunks = []
    for one in chunks_raw:
        box = c.fields(one, "ChunkStorageMetadata", ("offsets", "sizes"))
        chunk = Chunk(c.ints(box["offsets"], f"{what}: chunk offsets"),
                      c.ints(box["sizes"], f"{what}: chunk sizes"))
        if not chunk.fits(shape):
            raise c.fail(f"{what}: chunk {chunk.offsets}+{chunk.sizes} does not fit shape {shape}")
        chunks.append((chunk, _item(c, by_index, fqn, chunk.offsets)))
    problem = tiling_problem([chunk for chunk, _item_ in chunks], shape)
    if problem is not None:
        raise c.fail(f"{what}: its chunks do not tile shape {shape}: {problem}")
    return DcpTensor(fqn, dtype.name, shape, tuple(chunks))


def _properties(c: _Check, props: Any, what: str) -> DType:
    """The dtype of a TensorProperties, its other fields checked: torch up to 2.14 pickles
    (dtype, layout, requires_grad, memory_format, pin_memory), torch 2.15 adds ``strides`` (the
    saved tensor's ``stride()``, a tuple of ints, or None)."""
    if type(props) is not _RECORDS["TensorProperties"]:
        raise c.fail(f"{what}: properties must be a TensorProperties, got {_describe(props)}")
    state = getattr(props, "state", None)
    if type(state) is not tuple or len(state) not in (5, 6):
        raise c.fail(f"{what}: TensorProperties must hold (dtype, layout, requires_grad, "
                     f"memory_format, pin_memory[, strides]), got {_describe(state)}")
    dtype, layout = state[0], state[1]
    if type(dtype) is not DType:
        raise c.fail(f"{what}: dtype must be a torch dtype ckptio knows, got {_describe(dtype)}")
    if layout != _Layout("strided"):
        raise c.fail(f"{what}: layout must be torch.strided, got {_describe(layout)}")
    if type(state[2]) is not bool or type(state[3]) is not int or type(state[4]) is not bool:
        raise c.fail(f"{what}: requires_grad, memory_format or pin_memory has the wrong type")
    if len(state) == 6 and state[5] is not None:
        c.ints(state[5], f"{what}: TensorProperties.strides")
    return dtype


def _check_overlaps(c: _Check, items: list[DcpItem]) -> None:
    pair = shared_bytes((i.file, i.offset, i.length, i.fqn) for i in items)
    if pair is not None:
        (file, _o, _n, a), (_f, start, _size, b) = pair
        raise c.fail(f"keys {a!r} and {b!r} claim the same bytes from {start} of {file}")


def _paths(c: _Check, raw: Any, described: dict[str, Any]) -> dict[str, tuple[str | int, ...]]:
    """planner_data: key -> its path in the saved state (str dict keys, int list indices)."""
    if raw is None:
        return {}
    if type(raw) is not dict:
        raise c.fail(f"planner_data must be a dict, got {_describe(raw)}")
    out: dict[str, tuple[str | int, ...]] = {}
    for key, path in raw.items():
        if type(key) is not str or key not in described:
            continue  # planner data of keys that were not saved is of no use to a load
        if (type(path) is not tuple or not 0 < len(path) <= MAX_TREE_DEPTH
                or not all(type(p) is str or (type(p) is int and 0 <= p < _MAX_INT)
                           for p in path)):
            raise c.fail(f"key {key!r}: planner_data path must be a tuple of str and int, got "
                         f"{_describe(path)}")
        if ".".join(str(p) for p in path) != key:
            raise c.fail(f"key {key!r}: planner_data path {show(path)} does not spell the key")
        out[key] = path
    return out
