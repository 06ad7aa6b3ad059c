"""The lossless codecs the compression study measures, each one frame at a time on one core.

Owns: the codec table (zstandard at levels 1 and 3, the same after byte-plane grouping, blosc2
with its shuffle / bitshuffle / bytedelta filters and zstd or lz4, zipnn, numcodecs), each as an
``encode(frame, itemsize) -> bytes`` and ``decode(blob, itemsize, nbytes) -> bytes`` pair
running single-threaded; ``available()`` (the codecs whose library imports here) and the
byte-plane helpers. Does not own: what is measured with them (compress_study.py) or ckptio's own
codecs (the engine, ckptio's format package).

Byte-plane grouping ("bg"): a frame of little-endian ``itemsize``-byte elements is split into
``itemsize`` planes (plane i = byte i of every element: for bf16 plane 1 holds the sign and 7
exponent bits, plane 0 the last exponent bit and the 7 mantissa bits); each plane is compressed
alone and kept raw when that does not shrink it (ZipNN's layout); "bgcat" compresses the planes
one after the other as one zstd frame (ckptio's ``bytegroupN+zstd``).
"""

from __future__ import annotations

import importlib.util
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["CODECS", "Codec", "available", "group_planes", "ungroup_planes"]

Encode = Callable[[memoryview, int], bytes]
Decode = Callable[[bytes, int, int], bytes]


@dataclass(frozen=True)
class Codec:
    name: str
    library: str  # the import that must succeed
    encode: Encode
    decode: Decode


def group_planes(frame: memoryview, itemsize: int) -> np.ndarray:
    """``itemsize`` rows, row i = byte i of each element (a contiguous copy)."""
    a = np.frombuffer(frame, dtype=np.uint8)
    return np.ascontiguousarray(a.reshape(-1, itemsize).T)


def ungroup_planes(planes: np.ndarray) -> bytes:
    return np.ascontiguousarray(planes.T).tobytes()


# ------------------------------------------------------------------------------ zstandard


class _Zstd(threading.local):
    """A compressor and a decompressor per thread (zstandard's contexts are not thread-safe)."""

    def __init__(self, level: int) -> None:
        import zstandard

        self.c = zstandard.ZstdCompressor(level=level)
        self.d = zstandard.ZstdDecompressor()


def _zstd(level: int) -> tuple[Encode, Decode]:
    z = _Zstd(level)
    return (lambda f, _size: z.c.compress(f),
            lambda b, _size, n: z.d.decompress(b, max_output_size=n))


def _grouped_zstd(level: int) -> tuple[Encode, Decode]:
    """Planes compressed one by one; a header of (stored length, raw flag) per plane."""
    z = _Zstd(level)

    def encode(frame: memoryview, itemsize: int) -> bytes:
        if len(frame) % itemsize:
            return b"\x00" + z.c.compress(frame)
        parts = []
        for plane in group_planes(frame, itemsize):
            packed = z.c.compress(plane)
            parts.append((packed, 0) if len(packed) < plane.size else (plane.tobytes(), 1))
        head = b"".join(struct.pack("<IB", len(p), raw) for p, raw in parts)
        return b"\x01" + head + b"".join(p for p, _ in parts)

    def decode(blob: bytes, itemsize: int, nbytes: int) -> bytes:
        if blob[0] == 0:
            return z.d.decompress(blob[1:], max_output_size=nbytes)
        plane_n, pos = nbytes // itemsize, 1 + 5 * itemsize
        planes = np.empty((itemsize, plane_n), dtype=np.uint8)
        for i in range(itemsize):
            length, raw = struct.unpack_from("<IB", blob, 1 + 5 * i)
            part = blob[pos:pos + length]
            data = part if raw else z.d.decompress(part, max_output_size=plane_n)
            planes[i] = np.frombuffer(data, dtype=np.uint8)
            pos += length
        return ungroup_planes(planes)

    return encode, decode


def _concat_grouped_zstd(level: int) -> tuple[Encode, Decode]:
    """The planes one after the other in one zstd frame (ckptio's ``bytegroupN+zstd``)."""
    z = _Zstd(level)

    def decode(blob: bytes, itemsize: int, nbytes: int) -> bytes:
        flat = np.frombuffer(z.d.decompress(blob, max_output_size=nbytes), dtype=np.uint8)
        return ungroup_planes(flat.reshape(itemsize, -1))

    return lambda f, size: z.c.compress(group_planes(f, size)), decode


def _grouping_only() -> tuple[Encode, Decode]:
    """No compression: the cost of splitting into planes and merging them back."""
    return (lambda f, size: group_planes(f, size).tobytes(),
            lambda b, size, _n: ungroup_planes(np.frombuffer(b, np.uint8).reshape(size, -1)))


# ------------------------------------------------------------------------------ blosc2


def _blosc2(codec: str, filters: tuple[str, ...], level: int) -> tuple[Encode, Decode]:
    import blosc2

    def encode(frame: memoryview, itemsize: int) -> bytes:
        return blosc2.compress2(frame, typesize=itemsize, clevel=level, nthreads=1,
                                codec=getattr(blosc2.Codec, codec),
                                filters=[getattr(blosc2.Filter, f) for f in filters],
                                filters_meta=[0] * len(filters))

    def decode(blob: bytes, _itemsize: int, _nbytes: int) -> bytes:
        return blosc2.decompress2(blob, nthreads=1)

    return encode, decode


# ------------------------------------------------------------------------------ zipnn, numcodecs


def _zipnn(method: str) -> tuple[Encode, Decode]:
    from zipnn import ZipNN

    made: dict[int, ZipNN] = {}

    def codec(itemsize: int) -> ZipNN:
        if itemsize not in made:
            made[itemsize] = ZipNN(method=method, input_format="byte", threads=1,
                                   bytearray_dtype="bfloat16" if itemsize == 2 else "float32")
        return made[itemsize]

    return (lambda f, size: bytes(codec(size).compress(bytes(f))),
            lambda b, size, _n: bytes(codec(size).decompress(b)))


def _numcodecs(kind: str) -> tuple[Encode, Decode]:
    import numcodecs
    from numcodecs import blosc

    blosc.set_nthreads(1)
    if kind == "zstd1":
        c = numcodecs.Zstd(level=1)
        return (lambda f, _s: bytes(c.encode(f)), lambda b, _s, _n: bytes(c.decode(b)))
    shuffle = numcodecs.Blosc.SHUFFLE if kind == "blosc-shuffle-zstd1" else numcodecs.Blosc.BITSHUFFLE

    def encode(frame: memoryview, itemsize: int) -> bytes:
        arr = np.frombuffer(frame, dtype=np.uint16 if itemsize == 2 else np.uint32)
        return bytes(numcodecs.Blosc(cname="zstd", clevel=1, shuffle=shuffle).encode(arr))

    return encode, lambda b, _s, _n: bytes(numcodecs.Blosc().decode(b))


# ------------------------------------------------------------------------------ the table

_SPECS: list[tuple[str, str, Callable[[], tuple[Encode, Decode]]]] = [
    ("zstd-1", "zstandard", lambda: _zstd(1)),
    ("zstd-3", "zstandard", lambda: _zstd(3)),
    ("bg+zstd-1", "zstandard", lambda: _grouped_zstd(1)),
    ("bg+zstd-3", "zstandard", lambda: _grouped_zstd(3)),
    ("bgcat+zstd-1", "zstandard", lambda: _concat_grouped_zstd(1)),
    ("grouping only", "numpy", _grouping_only),
    ("blosc2 shuffle+zstd-1", "blosc2", lambda: _blosc2("ZSTD", ("SHUFFLE",), 1)),
    ("blosc2 shuffle+zstd-3", "blosc2", lambda: _blosc2("ZSTD", ("SHUFFLE",), 3)),
    ("blosc2 bitshuffle+zstd-1", "blosc2", lambda: _blosc2("ZSTD", ("BITSHUFFLE",), 1)),
    ("blosc2 shuffle+bytedelta+zstd-1", "blosc2",
     lambda: _blosc2("ZSTD", ("SHUFFLE", "BYTEDELTA"), 1)),
    ("blosc2 shuffle+lz4", "blosc2", lambda: _blosc2("LZ4", ("SHUFFLE",), 5)),
    ("blosc2 bitshuffle+lz4", "blosc2", lambda: _blosc2("LZ4", ("BITSHUFFLE",), 5)),
    ("zipnn huffman", "zipnn", lambda: _zipnn("HUFFMAN")),
    ("zipnn zstd", "zipnn", lambda: _zipnn("ZSTD")),
    ("numcodecs zstd-1", "numcodecs", lambda: _numcodecs("zstd1")),
    ("numcodecs blosc shuffle+zstd-1", "numcodecs", lambda: _numcodecs("blosc-shuffle-zstd1")),
]

CODECS = {name: lib for name, lib, _ in _SPECS}


def available(names: list[str] | None = None) -> list[Codec]:
    """The codecs (all, or ``names``) whose library imports here, made ready to run."""
    out = []
    for name, lib, make in _SPECS:
        if (names is None or name in names) and importlib.util.find_spec(lib) is not None:
            out.append(Codec(name, lib, *make()))
    return out
