"""Lossless codecs of one frame (format version 4): encode and decode a frame's bytes, by name.

A compressed entry is a sequence of independent frames (docs/FORMAT.md); a frame is stored
compressed only when that is shorter, else raw (``encode_frame``).

Names, as the manifest spells them (``stored.codec``):

* ``"zstd"``: zstd (level 1) of the frame's bytes;
* ``"bytegroupN+zstd"`` (N in 2, 4, 8, 16, the entry's element size): the frame's bytes as N
  byte planes (byte 0 of every element, then byte 1, ...), then zstd. The exponent planes of
  floats compress, the mantissa planes barely (docs/PROBES.md, "Lossless codecs on training
  tensors").

A save names a codec by its family (``"zstd"``, ``"bytegroup+zstd"``); ``stored_name`` gives the
manifest's name for an element size. Both need the ``zstandard`` package (and numpy), the
``ckptio[compress]`` extra (``check_available``).

Owns: the names, their parsing, encoding and decoding a frame, XOR of two byte buffers.
Does not own: where frames lie (the entry's ``stored`` field, manifest.py) or which entries are
compressed (saving/). Pure and torch-free; zstandard and numpy are imported on first use.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from ckptio.errors import CkptError
from ckptio.options import CODECS

__all__ = ["CODECS", "INSTALL", "check_available", "decode_frame", "encode_frame", "group_of",
           "is_stored_name", "stored_name", "xor_into"]

INSTALL = "pip install zstandard (the compress extra: pip install -e '.[compress]' in a checkout)"
LEVEL = 1  # zstd level: level 3 compressed no better on training tensors (docs/PROBES.md)
MAX_GROUP = 16  # complex128
_NAME = re.compile(r"^(?:zstd|bytegroup(2|4|8|16)\+zstd)$")
_local = threading.local()  # a zstd compressor / decompressor per thread (not thread-safe)


def is_stored_name(name: object) -> bool:
    """Whether ``name`` is a codec name a manifest may hold."""
    return isinstance(name, str) and _NAME.match(name) is not None


def group_of(name: str) -> int:
    """The byte planes a stored codec name groups into (1: none)."""
    match = _NAME.match(name)
    if match is None:
        raise ValueError(f"unknown codec {name!r}")
    return int(match.group(1) or 1)


def stored_name(codec: str, itemsize: int) -> str:
    """The manifest's name of save-time codec ``codec`` for elements of ``itemsize`` bytes."""
    if codec == "bytegroup+zstd" and itemsize > 1:
        return f"bytegroup{itemsize}+zstd"
    if codec in CODECS:
        return "zstd"
    raise ValueError(f"unknown codec {codec!r}")


def check_available(codec: str) -> None:
    """CkptError unless ``codec`` (a save-time name) can run here."""
    if codec not in CODECS:
        raise CkptError(f"compression={codec!r} is not a codec ckptio knows: use 'off', 'auto' "
                        f"or one of {', '.join(map(repr, CODECS))}")
    _modules(f"compression={codec!r}")


def _modules(what: str = "reading a compressed or delta checkpoint") -> tuple[Any, Any]:
    """zstandard and numpy; CkptError naming the extra that installs them if one is missing."""
    try:
        import numpy
        import zstandard
    except ImportError as exc:
        raise CkptError(f"{what} needs the zstandard and numpy packages ({exc.name} is not "
                        f"installed): {INSTALL}") from None
    return zstandard, numpy


def _compressor() -> Any:
    c = getattr(_local, "c", None)
    if c is None:
        zstandard, _np = _modules()
        c = _local.c = zstandard.ZstdCompressor(level=LEVEL)
    return c


def _decompressor() -> Any:
    d = getattr(_local, "d", None)
    if d is None:
        zstandard, _np = _modules()
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def encode_frame(name: str, frame: memoryview | bytes | bytearray) -> bytes | bytearray | memoryview:
    """The stored bytes of one frame: compressed when shorter, else the frame itself (raw).

    Frame i of an entry holds its logical bytes ``[i * block_nbytes, min((i + 1) *
    block_nbytes, nbytes))``; a frame whose stored length equals its logical length is raw, so
    a stored entry never exceeds its logical size and an incompressible frame costs nothing to
    decode."""
    group = group_of(name)
    data: Any = frame
    if group > 1 and len(frame) % group == 0 and len(frame):
        _zstd, np = _modules()
        data = np.ascontiguousarray(np.frombuffer(frame, np.uint8).reshape(-1, group).T)
    packed = _compressor().compress(data)
    return packed if len(packed) < len(frame) else frame


def decode_frame(name: str, stored: memoryview | bytes, into: memoryview) -> None:
    """Decode one stored frame into ``into`` (its logical length). ValueError if the frame
    does not decode to exactly that many bytes."""
    nbytes = len(into)
    if len(stored) == nbytes:
        into[:] = stored
        return
    if len(stored) > nbytes:
        raise ValueError(f"a frame of {len(stored)} stored bytes for {nbytes} logical bytes")
    group = group_of(name)
    zstandard, np = _modules()
    try:
        raw = _decompressor().decompress(stored, max_output_size=nbytes)
    except zstandard.ZstdError as exc:
        raise ValueError(f"the frame does not decode ({exc})") from None
    if len(raw) != nbytes:
        raise ValueError(f"the frame decodes to {len(raw)} bytes, not {nbytes}")
    # column stores: faster than a transposed copy (docs/PROBES.md, "Codecs and XOR deltas")
    if group > 1 and nbytes % group == 0:
        out = np.frombuffer(into, np.uint8).reshape(-1, group)
        planes = np.frombuffer(raw, np.uint8).reshape(group, -1)
        for i in range(group):
            out[:, i] = planes[i]
    else:
        into[:] = raw


def xor_into(target: memoryview, other: memoryview | bytes | bytearray) -> None:
    """``target ^= other`` byte by byte (equal lengths)."""
    _zstd, np = _modules()
    a = np.frombuffer(target, np.uint8)
    np.bitwise_xor(a, np.frombuffer(other, np.uint8), out=a)
