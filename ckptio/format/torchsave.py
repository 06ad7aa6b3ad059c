"""A file written by ``torch.save(obj, path)`` (the default zip format), read without torch.

The file is a zip of stored (method 0) records under one folder ``<archive>/``: ``data.pkl``
(the pickled object, tensors as persistent references to storages), ``byteorder``,
``data/<key>`` (each storage's raw bytes) and a few small ones. Records carry flag 0x08 (their
local headers hold zero sizes and CRC), so sizes and CRC-32s come from the central directory:
``directory_span`` finds it from the file's tail (zip64 included), ``parse_directory`` reads its
entries, ``data_offset`` turns a record's local header into the offset of its bytes, and
``decode_pickle`` decodes ``data.pkl`` with an allow-list unpickler, the weights_only set for
training state: dicts (``collections.OrderedDict`` too), lists, tuples, Python scalars and
strings, bytes (``_codecs.encode`` of latin-1 text, as protocol 2 pickles them), ``io.BytesIO``
(from its bytes and position), ``torch.Size``, ``torch.device``, dtypes, and tensors rebuilt by
``torch._utils._rebuild_tensor_v2/v3`` (``_rebuild_parameter`` too) over storage references,
DTensors as one rank saves them (format/dtensorpickle.py's stand-ins).
Any other global raises PickleRefusedError naming it; nothing it names is imported or run.

Owns: that zip and pickle parsing and its checks. Pure, torch-free. Does not own: reading the
bytes, turning the decoded object into a Manifest (loading/torchsave_manifest.py).
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

from ckptio.errors import CkptError, CorruptCheckpointError
from ckptio.format.allowlist import PICKLE_ERRORS, AllowListUnpickler
from ckptio.format.dtensorpickle import GLOBALS as DTENSOR_GLOBALS
from ckptio.format.torchzip import TENSOR_GLOBALS, TensorRef, storage_ref
from ckptio.format.types import show

__all__ = ["Device", "LOCAL_NBYTES", "MAX_PICKLE_NBYTES", "Record", "TAIL_NBYTES", "TorchSize",
           "data_offset", "decode_pickle", "directory_span", "is_legacy", "is_zip",
           "parse_directory"]

TAIL_NBYTES = 1 << 20  # read from the file's end: the end records, and the directory if it fits
LOCAL_NBYTES = 1024  # read at a record's local header: it, its name and extra field (padding)
MAX_PICKLE_NBYTES = 1 << 30  # a data.pkl larger than this is refused before it is read
_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_CENTRAL = 0x02014B50
_LOCAL = 0x04034B50
_FULL32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Record:
    """One central directory entry: a record's name, local header offset, size and CRC-32."""

    name: str
    local_offset: int
    nbytes: int
    crc32: int


class TorchSize(tuple):
    """A ``torch.Size`` decoded from the pickle (loading makes it a real torch.Size)."""


@dataclass(frozen=True)
class Device:
    """A ``torch.device`` decoded from the pickle: its arguments (``"cuda"``, ``0``)."""

    args: tuple[Any, ...]


def is_zip(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04"


def is_legacy(head: bytes) -> bool:
    """Whether ``head`` starts like a legacy (``_use_new_zipfile_serialization=False``) file: a
    pickle (protocol 2+) of torch's magic number."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _fail(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {what}; the torch.save file is truncated or damaged")


def directory_span(tail: bytes, file_size: int, where: str) -> tuple[int, int]:
    """(offset, size) of the central directory, from the file's last ``len(tail)`` bytes."""
    at = tail.rfind(_EOCD, max(0, len(tail) - 22 - 0xFFFF))
    if at < 0 or at + 22 > len(tail):
        raise _fail(where, "no zip end-of-central-directory record at its end")
    _sig, _disk, _cd_disk, _n_here, count, size, offset, _clen = struct.unpack_from(
        "<IHHHHIIH", tail, at)
    if count == 0xFFFF or size == _FULL32 or offset == _FULL32:
        loc = at - 20
        if loc < 0 or tail[loc:loc + 4] != _ZIP64_LOCATOR:
            raise _fail(where, "no zip64 end-of-central-directory locator")
        (eocd64,) = struct.unpack_from("<Q", tail, loc + 8)
        rel = eocd64 - (file_size - len(tail))
        if rel < 0 or rel + 56 > len(tail) or tail[rel:rel + 4] != _ZIP64_EOCD:
            raise _fail(where, "no zip64 end-of-central-directory record where its locator says")
        size, offset = struct.unpack_from("<QQ", tail, rel + 40)
    if offset + size > file_size:
        raise _fail(where, f"its central directory ({size} bytes at {offset}) runs past its "
                           f"{file_size} bytes")
    return int(offset), int(size)


def parse_directory(cd: bytes, where: str) -> dict[str, Record]:
    """The central directory's entries by name; stored records only."""
    out: dict[str, Record] = {}
    pos = 0
    while pos < len(cd):
        if pos + 46 > len(cd):
            raise _fail(where, "its central directory is cut off")
        (sig, _vm, _vn, flags, method, _t, _d, crc, csize, usize, nlen, elen, clen, _disk, _ia,
         _ea, local) = struct.unpack_from("<IHHHHHHIIIHHHHHII", cd, pos)
        if sig != _CENTRAL:
            raise _fail(where, f"no central directory entry at directory byte {pos}")
        name = cd[pos + 46:pos + 46 + nlen].decode("utf-8", "replace")
        extra = cd[pos + 46 + nlen:pos + 46 + nlen + elen]
        pos += 46 + nlen + elen + clen
        if pos > len(cd):
            raise _fail(where, "its central directory is cut off")
        usize, csize, local = _zip64(extra, usize, csize, local, where)
        if method != 0 or flags & 1 or csize != usize:
            raise CkptError(f"{where}: record {name!r} is compressed or encrypted (method "
                            f"{method}), which torch.save never writes and ckptio does not read")
        if name in out:
            raise _fail(where, f"record {name!r} appears twice")
        out[name] = Record(name, local, usize, crc)
    return out


def _zip64(extra: bytes, usize: int, csize: int, local: int, where: str) -> tuple[int, int, int]:
    """Sizes and local offset with the zip64 extra field's values for those that are full."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            field = extra[pos + 4:pos + 4 + n]
            values = [usize, csize, local]
            at = 0
            for i, v in enumerate(values):
                if v == _FULL32:
                    if at + 8 > len(field):
                        raise _fail(where, "a zip64 extra field is cut off")
                    (values[i],) = struct.unpack_from("<Q", field, at)
                    at += 8
            return values[0], values[1], values[2]
        pos += 4 + n
    if _FULL32 in (usize, csize, local):
        raise _fail(where, "an entry needs a zip64 extra field it does not have")
    return usize, csize, local


def data_offset(local: bytes, record: Record, file_size: int, where: str) -> int:
    """Where ``record``'s bytes start, from the first bytes ``local`` of its local header."""
    if len(local) < 30 or struct.unpack_from("<I", local)[0] != _LOCAL:
        raise _fail(where, f"no local header for record {record.name!r} at {record.local_offset}")
    nlen, elen = struct.unpack_from("<HH", local, 26)
    if local[30:30 + nlen].decode("utf-8", "replace") != record.name:
        raise _fail(where, f"the local header at {record.local_offset} is not {record.name!r}'s")
    start = record.local_offset + 30 + nlen + elen
    if start + record.nbytes > file_size:
        raise _fail(where, f"record {record.name!r} ({record.nbytes} bytes from {start}) runs "
                           f"past the file's {file_size} bytes")
    return start


class _ODict(dict):
    """collections.OrderedDict, built empty then filled (its BUILD state, the state_dict's
    ``_metadata``, is dropped)."""

    def __init__(self, *args: Any) -> None:
        if args:
            raise TypeError("OrderedDict is rebuilt without arguments")
        super().__init__()

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise TypeError("OrderedDict state is a dict")


def _encode(*args: Any) -> bytes:
    """``_codecs.encode(text, "latin1")``: how pickle protocol 2 writes a bytes object."""
    if len(args) != 2 or type(args[0]) is not str or args[1] not in ("latin1", "latin-1"):
        raise TypeError("_codecs.encode is rebuilt for (str, 'latin1') only")
    return args[0].encode("latin-1")


def _empty_bytes(*args: Any) -> bytes:
    """``bytes()``: how protocol 2 pickles ``b""``; with arguments (a size) refused."""
    if args:
        raise TypeError("bytes is rebuilt without arguments only")
    return b""


def _bytearray(*args: Any) -> bytes:
    """``bytearray(data)`` as protocol 2 pickles one (``data`` bytes, or nothing); as bytes
    (a bytearray leaf is stored and loaded as bytes, as ckptio.save does)."""
    if not args:
        return b""
    if len(args) != 1 or type(args[0]) is not bytes:
        raise TypeError("bytearray is rebuilt from one bytes object only")
    return args[0]


class _BytesIO(io.BytesIO):
    """io.BytesIO, rebuilt from its state (content, position, no attributes) only."""

    def __setstate__(self, state: Any) -> None:
        if not (type(state) is tuple and len(state) == 3 and type(state[0]) is bytes
                and type(state[1]) is int and state[2] in (None, {})):
            raise TypeError("io.BytesIO state is (bytes, position, None)")
        super().__setstate__((state[0], state[1], None))  # type: ignore[misc]  # not in typeshed


def _size(*args: Any) -> TorchSize:
    if len(args) != 1 or type(args[0]) is not tuple or not all(type(i) is int for i in args[0]):
        raise TypeError("torch.Size takes one tuple of ints")
    return TorchSize(args[0])


def _device(*args: Any) -> Device:
    if not 1 <= len(args) <= 2 or type(args[0]) is not str or (
            len(args) == 2 and type(args[1]) is not int):
        raise TypeError("torch.device takes a str and an optional int")
    return Device(tuple(args))


def _complex(*args: Any) -> complex:
    """complex, rebuilt from its real and imaginary parts only (what pickling one writes)."""
    if len(args) != 2 or not all(type(a) in (int, float) for a in args):
        raise TypeError("complex is rebuilt from two numbers only")
    return complex(*args)


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any, *rest: Any) -> Any:
    if type(data) is not TensorRef:
        raise TypeError("_rebuild_parameter takes a tensor")
    return data


_ALLOWED: dict[tuple[str, str], Any] = {
    **TENSOR_GLOBALS,
    ("collections", "OrderedDict"): _ODict,
    ("_codecs", "encode"): _encode,
    ("__builtin__", "bytearray"): _bytearray,
    ("builtins", "bytearray"): _bytearray,
    ("__builtin__", "bytes"): _empty_bytes,
    ("builtins", "bytes"): _empty_bytes,
    ("_io", "BytesIO"): _BytesIO,
    ("__builtin__", "complex"): _complex,  # a Python complex value (weights_only reads it)
    ("builtins", "complex"): _complex,
    ("torch", "Size"): _size,
    ("torch", "device"): _device,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **DTENSOR_GLOBALS,
}


class _Unpickler(AllowListUnpickler):
    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(data, where, _ALLOWED, lambda module, name: (
            f"{where}: its data.pkl refers to the Python global {module}.{name}, which is not "
            "one that plain training state holds (ckptio decodes torch.save files with an "
            "allow-list like torch.load(weights_only=True) and runs nothing else); refused, "
            "nothing was loaded. For a file you trust, pass allow_pickle=True (ckptio.load "
            "then returns torch.load(path, weights_only=False))"))

    def persistent_load(self, pid: Any) -> Any:
        return storage_ref(pid)


def decode_pickle(data: bytes, where: str) -> Any:
    """The object ``data.pkl`` holds: containers and scalars as themselves, tensors as
    torchzip.TensorRef, ``torch.Size`` as TorchSize, ``torch.device`` as Device, dtypes as
    allowlist.DType."""
    try:
        return _Unpickler(data, where).load()
    except CkptError:
        raise
    except PICKLE_ERRORS as exc:
        raise _fail(where, f"its data.pkl cannot be decoded ({type(exc).__name__}: "
                           f"{show(str(exc))})") from None
