"""The safetensors file header and the Hugging Face ``model.safetensors.index.json``, torch-free.

A safetensors file is an 8-byte little-endian length ``N``, ``N`` bytes of UTF-8 JSON, then the
data. The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets relative to the data start ``8 + N``) plus an optional ``"__metadata__"`` of string
values. ``encode_header`` writes one padded with spaces so the data starts on an ``align``
boundary (the safetensors loader accepts trailing spaces). ``decode_header`` checks what the
safetensors 0.8 loader checks, and more, before anything is read: the size bound, valid JSON
without duplicate names, known dtypes, non-negative int shapes, each tensor's byte length equal
to its shape's, and the tensors tiling the data exactly (no gap, no overlap, no byte past the
file or after the last tensor). The index is ``{"metadata": {"total_size", ...}, "weight_map":
{name: file}}``; its file names must be plain names in the same directory.

Owns: the byte layout of headers and the index, the dtype name table, their validation.
Does not own: reading or writing bytes (loading/safetensors_manifest.py, ckptio/export.py).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptio.alignment import padding
from ckptio.errors import CorruptCheckpointError
from ckptio.format.types import DTYPE_ITEMSIZE, Json, show

__all__ = ["DTYPES", "FROM_SAFETENSORS", "INDEX_NAME", "MAX_HEADER_NBYTES", "MAX_INDEX_NBYTES",
           "PREFIX_NBYTES", "SINGLE_NAME", "STensor", "decode_header", "decode_index",
           "encode_header", "encode_index", "header_nbytes", "is_shard_name", "shard_name"]

# ckptio dtype name -> safetensors dtype name (complex128 and complex32 have none)
DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8",
    "bool": "BOOL", "complex64": "C64",
}
FROM_SAFETENSORS: dict[str, str] = {v: k for k, v in DTYPES.items()}
PREFIX_NBYTES = 8
MAX_HEADER_NBYTES = 100_000_000  # the safetensors loader's own limit
MAX_INDEX_NBYTES = 64 << 20
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_METADATA = "__metadata__"
_FIELDS = {"dtype", "shape", "data_offsets"}
_MAX_DIMS = 64


@dataclass(frozen=True)
class STensor:
    """One tensor of a safetensors file: ``dtype`` is ckptio's name; ``begin``/``end`` are byte
    offsets relative to the data start."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def shard_name(index: int, count: int) -> str:
    """The Hugging Face name of output file ``index`` (0-based) of ``count``."""
    if count == 1:
        return SINGLE_NAME
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def is_shard_name(name: str) -> bool:
    """Whether ``name`` is one that ``shard_name`` gives (a file of an export, not the user's
    own, such as a PEFT ``adapter_model.safetensors``)."""
    return name == SINGLE_NAME or _SHARD_NAME.fullmatch(name) is not None


_SHARD_NAME = re.compile(r"model-\d{5,}-of-\d{5,}\.safetensors")


def encode_header(tensors: Sequence[STensor], metadata: Mapping[str, str] | None,
                  align: int) -> bytes:
    """Length prefix and JSON header, padded with spaces to a multiple of ``align`` bytes."""
    header: dict[str, Json] = {}
    if metadata:
        header[_METADATA] = dict(metadata)
    for t in tensors:
        header[t.name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [t.begin, t.end]}
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    body += b" " * padding(PREFIX_NBYTES + len(body), align)
    return struct.pack("<Q", len(body)) + body


def header_nbytes(prefix: bytes, file_nbytes: int, where: str) -> int:
    """``N`` from a file's first 8 bytes, checked against the file size and the limit."""
    if len(prefix) < PREFIX_NBYTES or file_nbytes < PREFIX_NBYTES:
        raise CorruptCheckpointError(f"{where}: {file_nbytes} bytes, too short for a safetensors "
                                     "file (an 8-byte header length comes first)")
    (n,) = struct.unpack("<Q", prefix[:PREFIX_NBYTES])
    if n > MAX_HEADER_NBYTES:
        raise CorruptCheckpointError(f"{where}: the safetensors header claims {n} bytes, more "
                                     f"than the {MAX_HEADER_NBYTES} allowed; not a safetensors "
                                     "file, or a damaged one")
    if PREFIX_NBYTES + n > file_nbytes:
        raise CorruptCheckpointError(f"{where}: the safetensors header claims {n} bytes but the "
                                     f"file has only {file_nbytes}; it is truncated or damaged")
    return n


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"name {key!r} appears twice")
        out[key] = value
    return out


def _json_object(raw: bytes, where: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: the {what} is not valid JSON ({exc}); the file "
                                     "is damaged or not what its name says") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: the {what} is {show(value)}, not a JSON object")
    return value


def decode_header(raw: bytes, file_nbytes: int, where: str
                  ) -> tuple[tuple[STensor, ...], dict[str, str]]:
    """The tensors (in data order) and ``__metadata__`` of a header; ``raw`` is the ``N``
    JSON bytes after the prefix, ``file_nbytes`` the whole file's size."""
    header = _json_object(raw, where, "safetensors header")
    metadata = header.pop(_METADATA, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptCheckpointError(f"{where}: __metadata__ must map names to strings; got "
                                     f"{show(metadata)}")
    tensors = sorted((_tensor(name, fields, where) for name, fields in header.items()),
                     key=lambda t: (t.begin, t.end))
    data_nbytes = file_nbytes - PREFIX_NBYTES - len(raw)
    at = 0
    for t in tensors:
        if t.begin != at:
            problem = "overlaps the tensor before it" if t.begin < at else "leaves a gap before it"
            raise CorruptCheckpointError(
                f"{where}: tensor {t.name!r} at data bytes [{t.begin}, {t.end}) {problem} "
                f"(expected to start at {at}); the header is damaged or hostile")
        at = t.end
    if at != data_nbytes:
        raise CorruptCheckpointError(
            f"{where}: the tensors cover {at} data bytes but the file holds {data_nbytes} after "
            "its header; it is truncated or damaged")
    return tuple(tensors), dict(metadata)


def _tensor(name: str, fields: Any, where: str) -> STensor:
    what = f"{where}: tensor {name!r}"
    if not name:
        raise CorruptCheckpointError(f"{where}: a tensor with an empty name")
    if not isinstance(fields, dict) or set(fields) != _FIELDS:
        raise CorruptCheckpointError(f"{what} must have exactly the fields dtype, shape and "
                                     f"data_offsets; got {show(fields)}")
    dtype = FROM_SAFETENSORS.get(fields["dtype"]) if isinstance(fields["dtype"], str) else None
    if dtype is None:
        raise CorruptCheckpointError(f"{what} has dtype {show(fields['dtype'])}, which ckptio "
                                     f"does not read (known: {sorted(FROM_SAFETENSORS)})")
    shape, offsets = fields["shape"], fields["data_offsets"]
    if not _ints(shape) or len(shape) > _MAX_DIMS:
        raise CorruptCheckpointError(f"{what} has shape {show(shape)}: not a list of at most "
                                     f"{_MAX_DIMS} non-negative ints")
    if not _ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CorruptCheckpointError(f"{what} has data_offsets {show(offsets)}: not [begin, end] "
                                     "with begin <= end")
    numel = 1
    for size in shape:
        numel *= size
    if offsets[1] - offsets[0] != numel * DTYPE_ITEMSIZE[dtype]:
        raise CorruptCheckpointError(
            f"{what} spans {offsets[1] - offsets[0]} bytes but {dtype} of shape {tuple(shape)} "
            f"needs {numel * DTYPE_ITEMSIZE[dtype]}; the header is damaged")
    return STensor(name, dtype, tuple(shape), offsets[0], offsets[1])


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def encode_index(weight_map: Mapping[str, str], total_size: int,
                 metadata: Mapping[str, Json] | None = None) -> bytes:
    """``model.safetensors.index.json`` as Hugging Face writes it (names sorted)."""
    meta = {**(metadata or {}), "total_size": total_size}
    doc = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()


def decode_index(raw: bytes, where: str) -> dict[str, str]:
    """The weight map of an index (name -> file), its file names checked to be plain names."""
    doc = _json_object(raw, where, "index")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptCheckpointError(f"{where}: no weight_map object naming the tensors' files")
    for name, file in weight_map.items():
        if (not isinstance(file, str) or not file or "/" in file or "\\" in file
                or file in (".", "..") or file.startswith(".")):
            raise CorruptCheckpointError(
                f"{where}: tensor {name!r} maps to file {show(file)}, not a plain file name in "
                "the index's directory")
    return dict(weight_map)
