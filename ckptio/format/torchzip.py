"""The torch.save zip of one DCP item, read from its first bytes without torch.

FileSystemWriter stores each tensor chunk as a complete torch.save zip: stored (method 0)
records ``<p>/data.pkl``, ``.format_version``, ``.storage_alignment``, ``byteorder``, then
``<p>/data/0`` (the storage's raw bytes, 64-aligned within the item), ``version``,
``.data/serialization_id`` and the central directory. Records carry flag 0x08: their local
headers hold zero sizes and CRC, and a data descriptor (``PK\\x07\\x08 crc32 csize usize``, sizes
of 8 bytes in zip64) follows each record's data. ``parse_head`` walks the local headers in the
item's first HEAD_NBYTES (each small record found with its descriptor, whose CRC-32 must match)
up to ``data/0`` and decodes ``data.pkl`` with an allow-list unpickler (a tensor rebuilt by
``torch._utils._rebuild_tensor_v2/v3`` from one storage, nothing else), so the data's offset,
dtype, storage size, storage offset, size and stride are known; ``parse_descriptor`` reads the
descriptor after the data (its CRC-32 is what a whole read of the data is checked against).

Owns: that zip and pickle parsing and its checks. Pure, torch-free. Does not own: reading the
bytes (loading/foreign_common.py), what a load does with the result.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError, CorruptCheckpointError
from ckptio.format.checksum import crc32
from ckptio.format.allowlist import PICKLE_ERRORS, AllowListUnpickler, DType
from ckptio.format.types import DTYPE_ITEMSIZE, show

__all__ = ["DESCRIPTOR_NBYTES", "HEAD_NBYTES", "TAIL_NBYTES", "TENSOR_GLOBALS", "TensorRecord", "TensorRef",
           "dense_order", "parse_descriptor", "parse_head", "row_major", "storage_ref"]

HEAD_NBYTES = 4096  # the records before data/0 fit here (data/0 starts at 704 in torch 2.13)
DESCRIPTOR_NBYTES = 24  # the largest data descriptor (zip64)
# An item's last bytes read with its head: data/0's descriptor, the records after it and the
# central directory (869-873 bytes after the data in torch 2.13's items) fit: no second round
TAIL_NBYTES = 4096
_LOCAL = 0x04034B50
_DESCRIPTOR = b"PK\x07\x08"
_STORAGES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}


@dataclass(frozen=True)
class TensorRecord:
    """What an item's head says about its tensor: ``data_offset`` (of data/0's bytes, from the
    item's start), the storage's dtype and size in bytes, and the tensor's view of it.
    ``crc32``: the data's CRC-32 when the local header holds it (no descriptor follows)."""

    data_offset: int
    dtype: str
    storage_nbytes: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    crc32: int | None


def row_major(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view of ``size`` with ``stride`` lays its elements out in row-major order."""
    if len(size) != len(stride):
        return False
    expected = 1
    for d, s in zip(reversed(size), reversed(stride)):
        if d > 1 and s != expected:
            return False
        expected *= d
    return True


def dense_order(size: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """The order of dims in which a view of ``size`` with ``stride`` lays out its elements
    densely (no gaps, no overlaps: a transposed or channels-last tensor over all of its
    storage): () when row-major, None when not dense."""
    if len(size) != len(stride):
        return None
    if row_major(size, stride):
        return ()
    order = tuple(sorted(range(len(size)), key=lambda d: -stride[d]))
    if not row_major(tuple(size[d] for d in order), tuple(stride[d] for d in order)):
        return None
    return order


@dataclass(frozen=True)
class _StorageType:
    dtype: str | None  # None: UntypedStorage (sizes in bytes, dtype given to _rebuild_tensor_v3)


@dataclass(frozen=True)
class _Storage:
    kind: _StorageType
    key: str
    numel: int


@dataclass(frozen=True)
class _Tensor:
    storage: _Storage
    offset: Any
    size: Any
    stride: Any
    dtype: str


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    if type(storage) is not _Storage or storage.kind.dtype is None or not 2 <= len(rest) <= 3:
        raise TypeError("_rebuild_tensor_v2 takes a typed storage and 6 or 7 arguments")
    return _Tensor(storage, offset, size, stride, storage.kind.dtype)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _Tensor:
    if (type(storage) is not _Storage or storage.kind.dtype is not None
            or not 3 <= len(rest) <= 4 or type(rest[2]) is not DType):
        raise TypeError("_rebuild_tensor_v3 takes an untyped storage, a dtype and 7 or 8 "
                        "arguments")
    return _Tensor(storage, offset, size, stride, rest[2].name)


def _ordered_dict(*args: Any) -> dict[Any, Any]:
    if args:
        raise TypeError("an item's OrderedDict (backward hooks) is empty")
    return {}


# The globals a pickled tensor refers to, as torch-free stand-ins (shared with torchsave.py).
TENSOR_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    **{("torch", name): _StorageType(dtype) for name, dtype in _STORAGES.items()},
    **{("torch", name): DType(name) for name in DTYPE_ITEMSIZE},
}
TensorRef = _Tensor  # a tensor data.pkl rebuilds: its storage (kind, key, numel) and its view
_ALLOWED: dict[tuple[str, str], Any] = {**TENSOR_GLOBALS, ("collections", "OrderedDict"): _ordered_dict}


def storage_ref(pid: Any) -> Any:
    """The storage a persistent id ``("storage", type, key, location, numel)`` names; TypeError
    when it is malformed."""
    if (type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage"
            or type(pid[1]) is not _StorageType or type(pid[2]) is not str
            or type(pid[3]) is not str or type(pid[4]) is not int or pid[4] < 0):
        raise TypeError(f"storage reference {show(pid)} is malformed")
    return _Storage(pid[1], pid[2], pid[4])


class _Unpickler(AllowListUnpickler):
    """data.pkl of one DCP tensor item: the tensor rebuild functions over storage references."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(data, where, _ALLOWED, lambda module, name: (
            f"{where}: its data.pkl refers to {module}.{name}, which a DCP tensor item never "
            "does (ckptio decodes it with an allow-list); load the checkpoint with "
            "torch.distributed.checkpoint.load if you trust it"))

    def persistent_load(self, pid: Any) -> Any:
        return storage_ref(pid)


def _fail(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the DCP data file is damaged or was not "
                                  "written by torch.distributed.checkpoint's FileSystemWriter")


def parse_head(head: bytes, item_length: int, where: str) -> TensorRecord:
    """The tensor an item holds, from the item's first bytes ``head`` (HEAD_NBYTES, or the
    whole item if shorter). ``where`` names the item (file and key) in messages."""
    pos, prefix, pickled = 0, None, None
    while True:
        if pos + 30 > len(head):
            raise _fail(where, f"no data/0 record within its first {len(head)} bytes")
        (sig, _version, flags, method, _time, _date, crc, csize, usize, nlen,
         elen) = struct.unpack_from("<IHHHHHIIIHH", head, pos)
        if sig != _LOCAL:
            raise _fail(where, f"no zip local header at item byte {pos}")
        if method != 0 or flags & 1:
            raise CkptError(f"{where}: the item's zip record is compressed or encrypted (method "
                            f"{method}), which torch.save never writes and ckptio does not read; "
                            "load it with torch.distributed.checkpoint.load")
        name = head[pos + 30:pos + 30 + nlen].decode("utf-8", "replace")
        start = pos + 30 + nlen + elen
        record_prefix, _, rest = name.partition("/")
        if prefix is None:
            prefix = record_prefix
        if record_prefix != prefix or not rest:
            raise _fail(where, f"record {name!r} is not under the archive's folder {prefix!r}")
        if rest.startswith("data/"):
            if rest != "data/0" or pickled is None:
                raise _fail(where, f"record {name!r} is not the one storage data/0 after data.pkl")
            tensor = _tensor(pickled, where)
            end = start + tensor.storage_nbytes + (0 if flags & 8 == 0 else 16)
            if end > item_length:
                raise _fail(where, f"data/0 ({tensor.storage_nbytes} bytes from item byte "
                                   f"{start}) runs past the item's {item_length} bytes")
            if flags & 8 == 0 and not csize == usize == tensor.storage_nbytes:
                raise _fail(where, f"data/0 holds {usize} bytes, its tensor needs "
                                   f"{tensor.storage_nbytes}")
            return TensorRecord(start, tensor.dtype, tensor.storage_nbytes,
                                tensor.storage_offset, tensor.size, tensor.stride,
                                None if flags & 8 else crc)
        data, pos = _small_record(head, start, flags, crc, csize, name, where)
        if rest == "data.pkl":
            pickled = data
        elif rest == "byteorder" and data != b"little":
            raise CkptError(f"{where}: the item was saved {data!r}-endian; ckptio reads "
                            "little-endian data only")


def _small_record(head: bytes, start: int, flags: int, crc: int, csize: int, name: str,
                  where: str) -> tuple[bytes, int]:
    """A record before data/0: (its bytes, where the next local header starts)."""
    if flags & 8 == 0:
        end = start + csize
        if end > len(head) or crc32(head[start:end]) != crc:
            raise _fail(where, f"record {name!r} is cut off or fails its CRC-32")
        return head[start:end], end
    at = head.find(_DESCRIPTOR, start)
    while at >= 0 and at + 16 <= len(head):
        got_crc, got_c, got_u = struct.unpack_from("<III", head, at + 4)
        if got_c == got_u == at - start and crc32(head[start:at]) == got_crc:
            return head[start:at], at + 16
        at = head.find(_DESCRIPTOR, at + 1)
    raise _fail(where, f"record {name!r} has no data descriptor matching its bytes")


@dataclass(frozen=True)
class _Parsed:
    dtype: str
    storage_nbytes: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _tensor(pickled: bytes, where: str) -> _Parsed:
    try:
        tensor = _Unpickler(pickled, where).load()
    except CkptError:
        raise
    except PICKLE_ERRORS as exc:
        raise _fail(where, f"its data.pkl is not a tensor ckptio can read ({type(exc).__name__}: "
                           f"{exc})") from None
    if type(tensor) is not _Tensor or tensor.storage.key != "0":
        raise _fail(where, "its data.pkl does not hold one tensor over storage '0'")
    ints = (tensor.size, tensor.stride)
    if (type(tensor.offset) is not int or tensor.offset < 0
            or not all(type(v) is tuple and len(v) <= 128
                       and all(type(i) is int and 0 <= i < 1 << 62 for i in v) for v in ints)
            or len(tensor.size) != len(tensor.stride)):
        raise _fail(where, "its data.pkl gives a malformed storage offset, size or stride")
    untyped = tensor.storage.kind.dtype is None
    nbytes = tensor.storage.numel * (1 if untyped else DTYPE_ITEMSIZE[tensor.dtype])
    return _Parsed(tensor.dtype, nbytes, tensor.offset, tensor.size, tensor.stride)


def parse_descriptor(raw: bytes, nbytes: int, where: str) -> int:
    """The CRC-32 in the data descriptor ``raw`` that follows data/0's ``nbytes`` bytes."""
    if len(raw) >= 16 and raw[:4] == _DESCRIPTOR:
        crc, csize, usize = struct.unpack_from("<III", raw, 4)
        if csize == usize == nbytes:
            return int(crc)
        if len(raw) >= 24:
            crc, csize, usize = struct.unpack_from("<IQQ", raw, 4)
            if csize == usize == nbytes:
                return int(crc)
    raise _fail(where, f"no data descriptor for data/0's {nbytes} bytes follows them")
