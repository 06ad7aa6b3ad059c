"""The two-parity erasure code of ``Parity(k, m=2)``: P (XOR) and Q (Reed-Solomon over GF(2^8))
pieces, and the decoding of one or two lost pieces of a stripe. Pure: tensors in, tensors out.

A stripe holds one piece ``d_h`` of each of its data members (h: the member's position in its
parity group) and two parity pieces, ``P = XOR d_h`` and ``Q = sum g^h d_h`` in GF(2^8) with
the polynomial 0x11d and generator g = 2 (RAID-6's code, as Linux md computes it), so any two of
a stripe's pieces can be lost: ``solve``. Placement of the stripes: redundancy/topology.py.

Written by hand (why): the libraries for Reed-Solomon in Python are GPL (zfec) or need a C
library and its headers (pyeclib), and neither works on torch tensors; the code needs only
multiplication of bytes by a constant: a lookup in that constant's 256-byte table
(``torch.index_select``, a chunk at a time), and XOR. The field tables are built once.

Call order: ``Horner`` to encode Q (redundancy/protect.py); ``solve`` to
rebuild a lost piece (redundancy/rebuild.py). Owns: the field arithmetic. Does not own: placement,
transfers, lengths (pieces are padded to 8 bytes by redundancy/peers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ckptio.errors import CkptError
from ckptio.redundancy.topology import Topology

__all__ = ["Horner", "inverse", "member", "mul", "mul_into", "power", "scale", "solve"]

_POLY = 0x1D  # x^8 + x^4 + x^3 + x^2 + 1, without x^8
_CHUNK = 1 << 22  # bytes multiplied at a time (and their int32 indices)
_TABLES: dict[int, torch.Tensor] = {}


def _tables() -> tuple[list[int], list[int]]:
    exp, log, x = [0] * 510, [0] * 256, 1
    for i in range(255):
        exp[i] = exp[i + 255] = x
        log[x] = i
        x = ((x << 1) ^ _POLY) & 0xFF if x & 0x80 else x << 1
    return exp, log


_EXP, _LOG = _tables()


def mul(a: int, b: int) -> int:
    """a * b in GF(2^8)."""
    return 0 if a == 0 or b == 0 else _EXP[_LOG[a] + _LOG[b]]


def power(h: int) -> int:
    """g^h, the Q coefficient of the member at position h."""
    return _EXP[h % 255]


def inverse(a: int) -> int:
    """1 / a in GF(2^8); CkptError for 0."""
    if a == 0:
        raise CkptError("internal: no inverse of 0 in GF(2^8)")
    return _EXP[255 - _LOG[a]]


def _table(c: int) -> torch.Tensor:
    """c * a for every byte a (256 bytes, cached)."""
    found = _TABLES.get(c)
    if found is None:
        found = _TABLES[c] = torch.tensor([mul(a, c) for a in range(256)], dtype=torch.uint8)
    return found


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + _CHUNK)) for lo in range(0, n, _CHUNK)]


def scale(block: torch.Tensor, c: int) -> None:
    """block *= c in GF(2^8), in place (uint8): a table lookup, a chunk at a time."""
    if c == 0:
        block.zero_()
    if c in (0, 1):
        return
    table, index = _table(c), torch.empty(min(block.numel(), _CHUNK), dtype=torch.int32)
    for lo, hi in _chunks(block.numel()):
        idx = index[:hi - lo]
        idx.copy_(block[lo:hi])
        torch.index_select(table, 0, idx, out=block[lo:hi])


def mul_into(acc: torch.Tensor, data: torch.Tensor, c: int) -> None:
    """acc[:len(data)] ^= c * data in GF(2^8) (uint8)."""
    n = data.numel()
    if c == 1 and n % 8 == 0 and acc.storage_offset() % 8 == 0 \
            and data.storage_offset() % 8 == 0:
        acc[:n].view(torch.int64).bitwise_xor_(data.view(torch.int64))
        return
    if c == 1:
        acc[:n].bitwise_xor_(data)
        return
    table, index = _table(c), torch.empty(min(n, _CHUNK), dtype=torch.int32)
    product = torch.empty(min(n, _CHUNK), dtype=torch.uint8)
    for lo, hi in _chunks(n):
        idx, out = index[:hi - lo], product[:hi - lo]
        idx.copy_(data[lo:hi])
        torch.index_select(table, 0, idx, out=out)
        acc[lo:hi].bitwise_xor_(out)


def solve(size: int, p: torch.Tensor | None, q: torch.Tensor | None,
          present: Mapping[int, torch.Tensor], lost: list[int], want: int) -> torch.Tensor:
    """The piece of the member at position ``want`` in a stripe whose members at ``lost``
    (``want`` among them, at most 2) are gone: from P and/or Q (None: lost too) and the
    ``present`` members' pieces (position -> bytes, shorter than ``size`` where a shard ends;
    the rest is zeros). -> ``size`` bytes. CkptError if the stripe cannot be solved."""
    if want not in lost or len(lost) > 2 or (len(lost) == 2 and (p is None or q is None)) \
            or (p is None and q is None):
        raise CkptError(f"a stripe with lost members {lost} and P {'lost' if p is None else 'kept'}"
                        f", Q {'lost' if q is None else 'kept'} cannot be rebuilt")
    if len(lost) == 1 and p is not None:
        return _syndrome(size, p, present, lambda _h: 1)
    if len(lost) == 1:
        assert q is not None  # internal: checked above
        out = _syndrome(size, q, present, power)
        scale(out, inverse(power(want)))
        return out
    assert p is not None and q is not None  # internal: checked above
    other = next(h for h in lost if h != want)
    pxy = _syndrome(size, p, present, lambda _h: 1)  # d_want ^ d_other
    qxy = _syndrome(size, q, present, power)  # g^want d_want ^ g^other d_other
    mul_into(qxy, pxy, power(other))  # (g^want ^ g^other) d_want
    scale(qxy, inverse(power(want) ^ power(other)))
    return qxy


def _syndrome(size: int, parity: torch.Tensor, present: Mapping[int, torch.Tensor],
              coefficient: Callable[[int], int]) -> torch.Tensor:
    """parity ^ sum coefficient(h) * d_h over the present members (size bytes)."""
    out = torch.zeros(size, dtype=torch.uint8)
    out[:parity.numel()] = parity
    for h, data in present.items():
        mul_into(out, data, coefficient(h))
    return out


class Horner:
    """Q = sum g^h d_h into ``acc``, the pieces given highest position h first: acc = acc *
    g^(previous h - h) ^ d_h, then g^(last h) once (one doubling per position in all)."""

    def __init__(self, acc: torch.Tensor) -> None:
        self.acc, self.last = acc, -1

    def add(self, h: int, data: torch.Tensor) -> None:
        if self.last >= 0:
            scale(self.acc, power(self.last - h))
        mul_into(self.acc, data, 1)
        self.last = h

    def finish(self) -> None:
        if self.last > 0:
            scale(self.acc, power(self.last))


def member(n: int, m: int, p: int, me: int, lost: list[int], blocks: Mapping[int, torch.Tensor],
           shards: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The n - m pieces of p bytes of the member at position ``me`` of a parity group of n
    (topology.py's stripes), rebuilt from the ``blocks`` (position -> m * p bytes: P of its
    stripe, then Q of the one before) and ``shards`` (position -> its bytes) of the members
    not ``lost``. Piece i lies in stripe j = (me + 1 + i) mod n."""
    data = torch.empty(p * (n - m), dtype=torch.uint8)
    for i in range(n - m):
        j = Topology.holder_of(i, me, n)
        data_at = Topology.stripe_data(j, n, m)
        held = [blocks[h][t * p:(t + 1) * p] if h in blocks else None
                for t, h in enumerate(Topology.stripe_parity(j, n, m))]
        present = {h: shards[h][min(c * p, shards[h].numel()):min((c + 1) * p,
                                                                  shards[h].numel())]
                   for h, c in data_at if h in shards}
        data[i * p:(i + 1) * p] = solve(p, held[0], held[1] if m == 2 else None, present,
                                        [h for h, _c in data_at if h in lost], me)
    return data
