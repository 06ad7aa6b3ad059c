"""Checksums of stored bytes: one algorithm name -> a streaming hasher.

Owns: the set of algorithms a manifest may name, their hex digests, what an entry's checksum
is under each, and the one CRC-32 function ckptio checks records with. xxh3_64 is the
primitive: the fastest measured, releasing the GIL; a hardware CRC-32C buys nothing over it for
ckptio's own checkpoints (docs/PROBES.md, "Checksum speed and GIL release").
crc32 (8 hex digits) is what torch.save zips record: a DCP checkpoint or torch.save file read
through ckptio (loading/dcpdir.py, loading/torchsave_manifest.py) is checked against it. ``crc32`` is
ISA-L's (the ``isal`` package, ckptio's ``fastcrc`` extra) when it is installed, else zlib's:
the same polynomial and values, ISA-L's much the faster; both release the GIL
(docs/BENCH_INTEROP.md, "CRC-32 by ISA-L"). ``crc32_of_part``: the CRC-32 of the middle of a
record from the record's and its ends' (a tensor that is a view of part of its storage).

An entry of more than one block carries a checksum of every ``block_nbytes`` of its bytes (a
load of part of it checks those) and one of the whole entry:
- ``xxh3_64_tree`` (the default since issue 29): the whole checksum is the xxh3_64 of the block
  checksums' hex digits, concatenated, so every byte is hashed once, on save and on load;
- ``xxh3_64`` (earlier checkpoints, still read): the xxh3_64 of the whole entry's bytes, which
  hashed every byte twice. Files that are not entries (index files) and single frames are hashed
  with the primitive under either name (``new_hasher``).

Does not own: where checksums are stored (manifest.py) or when they are checked (loading/).
"""

from __future__ import annotations

import operator
import zlib
from collections.abc import Callable, Sequence
from itertools import compress, repeat
from typing import Protocol, cast

import xxhash

from ckptio.errors import CkptError

__all__ = ["ALGORITHMS", "NO_CHECKSUM", "TREE", "BlockHasher", "Crc32", "EntryHashers", "Hasher", "crc32",
           "crc32_by", "crc32_of_part", "entry_checksum", "new_hasher", "stored_algorithm", "whole_from_blocks"]

ALGORITHMS = ("xxh3_64_tree", "xxh3_64", "crc32")
TREE = "xxh3_64_tree"  # an entry's whole checksum is derived from its block checksums
NO_CHECKSUM = "none"  # the records of safetensors files: nothing stored to check against


Crc32Function = Callable[[memoryview | bytes, int], int]


def _fastest_crc32() -> tuple[str, Crc32Function]:
    """ISA-L's CRC-32 when the ``isal`` package is installed, else zlib's (same values)."""
    try:
        from isal.isal_zlib import crc32 as isal_crc32
    except ImportError:
        return "zlib", zlib.crc32
    return "isal", isal_crc32


_CRC32: tuple[str, Crc32Function] = _fastest_crc32()  # (its name, the function)


def crc32(data: memoryview | bytes, value: int = 0) -> int:
    """The CRC-32 of ``data`` continuing from ``value``: zlib's values, by ``crc32_by()``."""
    return _CRC32[1](data, value)


_CRC_POLY = 0x104C11DB7  # CRC-32's polynomial, x^32 + ... + 1, its bits as coefficients


def _reflect(value: int) -> int:
    return int(f"{value:032b}"[::-1], 2)


def _mulmod(a: int, b: int) -> int:
    """a * b modulo CRC-32's polynomial, over GF(2)."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        b >>= 1
        a <<= 1
        if a >> 32:
            a ^= _CRC_POLY
    return out


def _x_to(n: int) -> int:
    """x ** n modulo the polynomial."""
    out, base = 1, 2
    while n:
        if n & 1:
            out = _mulmod(out, base)
        base, n = _mulmod(base, base), n >> 1
    return out


def _inverse(a: int) -> int:
    """a's inverse modulo the polynomial (extended Euclid over GF(2)); a is a power of x."""
    r0, r1, s0, s1 = _CRC_POLY, a, 0, 1
    while r1:
        quotient = 0
        while r0.bit_length() >= r1.bit_length():
            shift = r0.bit_length() - r1.bit_length()
            quotient ^= 1 << shift
            r0 ^= r1 << shift
        r0, r1 = r1, r0
        product, q = 0, quotient
        while q:  # s0 - quotient * s1, carry-less
            top = q.bit_length() - 1
            product ^= s1 << top
            q ^= 1 << top
        s0, s1 = s1, s0 ^ product
    return s0  # of degree below the polynomial's, as Bezout's coefficients are


def _shift(crc: int, nbytes: int, inverse: bool = False) -> int:
    """crc32(X) -> the term zlib's crc32_combine adds for X followed by ``nbytes`` more bytes
    (or back, ``inverse``)."""
    factor = _x_to(8 * nbytes)
    return _reflect(_mulmod(_reflect(crc), _inverse(factor) if inverse else factor))


def crc32_of_part(whole: int, head: int, tail: int, part_nbytes: int, tail_nbytes: int) -> int:
    """crc32(A) from crc32(H + A + T) (``whole``), crc32(H), crc32(T) and the lengths of A and
    T: crc32(X + Y) = shift(crc32(X), len(Y)) ^ crc32(Y), and the shift is invertible."""
    head_and_part = _shift(whole ^ tail, tail_nbytes, inverse=True)
    return head_and_part ^ _shift(head, part_nbytes)


def crc32_by() -> str:
    """Which implementation ``crc32`` runs: ``"isal"`` or ``"zlib"``."""
    return _CRC32[0]


class Hasher(Protocol):
    def update(self, data: memoryview | bytes) -> None: ...
    def hexdigest(self) -> str: ...


class Crc32:
    """The CRC-32 of zip records, as a streaming hasher (hexdigest: 8 lower-case hex digits)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview | bytes) -> None:
        self.value = crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def stored_algorithm(algorithm: str) -> str | None:
    """The algorithm to check a record's bytes with: None for NO_CHECKSUM (a safetensors file
    carries none; such records are built by ckptio's reader, never decoded from a manifest)."""
    return None if algorithm == NO_CHECKSUM else algorithm


def new_hasher(algorithm: str) -> Hasher:
    """The primitive hasher of ``algorithm`` (what one block, frame or index file is hashed by)."""
    if algorithm in ("xxh3_64", TREE):
        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return Crc32()
    raise CkptError(f"checksum algorithm {algorithm!r} is unknown; this ckptio knows {ALGORITHMS}")


def whole_from_blocks(algorithm: str, blocks: tuple[str, ...] | list[str]) -> str:
    """Under TREE, the whole checksum of an entry with these (two or more) block checksums."""
    hasher = new_hasher(algorithm)
    hasher.update("".join(blocks).encode("ascii"))
    return hasher.hexdigest()


class EntryHashers:
    """The checksums of a save's entries (by index), their bytes arriving in order. An entry
    whose bytes come in one piece of at most one block is hashed at once and only its digest is
    kept (what its BlockHasher would give): a save of thousands of small entries keeps no
    hasher per entry alive while it writes, for the collector to promote and walk."""

    def __init__(self, algorithm: str, block_nbytes: int, sizes: Sequence[int]) -> None:
        self.algorithm, self.block_nbytes, self._sizes = algorithm, block_nbytes, sizes
        self._hashers: dict[int, BlockHasher] = {}
        self._whole: dict[int, str] = {}  # index -> the digest of an entry hashed at once

    def update(self, index: int, data: memoryview) -> None:
        """Entry ``index``'s next bytes."""
        hasher = self._hashers.get(index)
        if hasher is None:
            if len(data) == self._sizes[index] <= self.block_nbytes and index not in self._whole:
                one = new_hasher(self.algorithm)
                one.update(data)
                self._whole[index] = one.hexdigest()
                return
            hasher = self._hashers[index] = BlockHasher(self.algorithm, self.block_nbytes)
        hasher.update(data)

    def update_pieces(self, view: memoryview, pieces: Sequence[tuple[int, int, int]]) -> None:
        """update() of each piece (entry index, start in ``view``, nbytes), in order. The pieces
        that are a whole entry of at most one block are hashed by one ``map`` over them where
        the algorithm has a one-shot digest (xxh3_64): no Python per entry."""
        one = xxhash.xxh3_64_hexdigest if self.algorithm in _ONE_SHOT else None
        rest: Sequence[tuple[int, int, int]] | compress[tuple[int, int, int]] = pieces
        if one is not None and pieces:
            indices = list(map(_FIRST, pieces))
            starts = list(map(_SECOND, pieces))
            sizes = list(map(_THIRD, pieces))
            whole = list(map(operator.and_, map(operator.eq, sizes,
                                                map(self._sizes.__getitem__, indices)),
                             map(operator.le, sizes, repeat(self.block_nbytes))))
            if True in whole:
                views = map(view.__getitem__, map(slice, compress(starts, whole),
                                                  map(operator.add, compress(starts, whole),
                                                      compress(sizes, whole))))
                self._whole.update(zip(compress(indices, whole), map(one, views)))
                rest = compress(pieces, map(operator.not_, whole))
        for index, start, n in rest:
            self.update(index, view[start:start + n])

    def all_digests(self, count: int) -> list[tuple[str, tuple[str, ...]]]:
        """digests() of entries 0 to ``count`` - 1, those hashed at once by one ``map``."""
        wholes = list(map(self._whole.get, range(count)))
        out = cast("list[tuple[str, tuple[str, ...]]]", list(zip(wholes, repeat(()))))
        if None in wholes:  # entries hashed by a BlockHasher, or given no bytes
            for index in compress(range(count), map(operator.is_, wholes, repeat(None))):
                out[index] = self.digests(index)
        return out

    def digests(self, index: int) -> tuple[str, tuple[str, ...]]:
        """BlockHasher.digests() of entry ``index`` (an entry given no bytes: the empty one's)."""
        whole = self._whole.get(index)
        if whole is not None:
            return whole, ()
        hasher = self._hashers.get(index) or BlockHasher(self.algorithm, self.block_nbytes)
        return hasher.digests()


# the algorithms whose digest of one buffer at once needs no Python per call (xxh3_64's)
_ONE_SHOT = frozenset({"xxh3_64", TREE})
_FIRST, _SECOND, _THIRD = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)


def entry_checksum(algorithm: str, block_nbytes: int, data: memoryview | bytes) -> str:
    """The whole checksum an entry of exactly these bytes records (an index file's too)."""
    hasher = BlockHasher(algorithm, block_nbytes)
    hasher.update(memoryview(data))
    return hasher.digests()[0]


class BlockHasher:
    """One stored entry's checksums: of all its bytes, and of each ``block_nbytes`` of them (so a
    load that needs only part of an entry can verify the blocks it reads). Bytes arrive in order.
    Under TREE each byte is hashed once (the whole checksum comes from the blocks')."""

    def __init__(self, algorithm: str, block_nbytes: int) -> None:
        self.algorithm, self.block_nbytes = algorithm, block_nbytes
        self.whole = None if algorithm == TREE else new_hasher(algorithm)
        self.block = new_hasher(algorithm)
        self.in_block = 0
        self.blocks: list[str] = []

    def update(self, data: memoryview) -> None:
        if self.whole is not None:
            self.whole.update(data)
        while len(data):
            n = min(len(data), self.block_nbytes - self.in_block)
            self.block.update(data[:n])
            self.in_block += n
            data = data[n:]
            if self.in_block == self.block_nbytes:
                self.blocks.append(self.block.hexdigest())
                self.block, self.in_block = new_hasher(self.algorithm), 0

    def digests(self) -> tuple[str, tuple[str, ...]]:
        """(checksum of the whole entry, block checksums: empty when it is one block or less)."""
        tail = [self.block.hexdigest()] if self.in_block or not self.blocks else []
        blocks = (*self.blocks, *tail)
        if len(blocks) == 1:  # one block (or none: the empty entry's digest)
            return (blocks[0] if self.whole is None else self.whole.hexdigest()), ()
        if self.whole is None:
            return whole_from_blocks(self.algorithm, blocks), blocks
        return self.whole.hexdigest(), blocks
