"""Read once, send to the others: which rank of an in-place load reads each stored entry that
several ranks want whole, and how its bytes go from that rank to the others.

A unit is one stored entry of one checkpoint (its file, offset, size and checksum: ``unit_name``)
that a rank reads whole into a tensor. Given every rank's units, the coordinator makes each unit
that two or more ranks want the charge of one of them, its owner (``assign``: largest first, to
the wanting rank with the fewest bytes to read so far, counting what it reads alone); the owner
reads it from storage and sends it to the others. Between one owner and one receiver the units
go in name order (both sides sort alike, nothing more is said), as ``messages``: a unit of at
least SMALL_NBYTES in messages of its own of at most MESSAGE_NBYTES, smaller ones packed
together up to that size.

Owns: these decisions. Does not own: the exchange and its failures (distributed/readshare.py,
distributed/sendreads.py), which reads a load makes (loading/fill.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from ckptio.format.types import TensorEntry

__all__ = ["MESSAGE_NBYTES", "SMALL_NBYTES", "Piece", "Share", "Want", "assign", "messages",
           "unit_name"]

SMALL_NBYTES = 1 << 20  # units below this are packed together into messages
MESSAGE_NBYTES = 32 << 20  # the most bytes of one message

Piece = tuple[int, int, int]  # (a unit's index in the pair's list, first byte, end byte)


@dataclass(frozen=True)
class Want:
    """A unit a rank wants: its name and its bytes."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class Share:
    """One rank's part of the decision: ``owner[i]`` reads this rank's i-th unit (this rank
    itself: it reads it from storage); ``to[i]``: the ranks this rank sends its i-th unit to
    (units it owns that others want)."""

    owner: tuple[int, ...]
    to: dict[int, tuple[int, ...]]

    @property
    def sends_or_receives(self) -> bool:
        return bool(self.to) or any(o != -1 for o in self.owner)


def unit_name(location: str, entry: TensorEntry) -> str:
    """A name equal on every rank that reads the same stored bytes of the checkpoint at
    ``location`` (and different for any other bytes)."""
    ident = f"{location}\0{entry.file}\0{entry.offset}\0{entry.nbytes}\0{entry.checksum}"
    return xxhash.xxh3_128_hexdigest(ident.encode())


def assign(wants: Sequence[Sequence[Want]], alone_nbytes: Sequence[int]) -> list[Share]:
    """Every rank's Share, given each rank's units (in its order) and the bytes it reads that
    are no unit (resharded regions). A unit one rank wants is its own (owner -1: no exchange)."""
    ranks_of: dict[str, list[int]] = {}
    size_of: dict[str, int] = {}
    for rank, units in enumerate(wants):
        for want in units:
            holders = ranks_of.setdefault(want.name, [])
            if not holders or holders[-1] != rank:
                holders.append(rank)
            size_of[want.name] = want.nbytes
    load = list(alone_nbytes)
    for name, holders in ranks_of.items():
        if len(holders) == 1:
            load[holders[0]] += size_of[name]
    owner_of: dict[str, int] = {}
    for name in sorted((n for n, h in ranks_of.items() if len(h) > 1),
                       key=lambda n: (-size_of[n], n)):
        chosen = min(ranks_of[name], key=lambda r: (load[r], r))
        owner_of[name] = chosen
        load[chosen] += size_of[name]
    shares = []
    for rank, units in enumerate(wants):
        owners, to = [], {}
        for i, want in enumerate(units):
            owner = owner_of.get(want.name, -1)
            owners.append(-1 if owner in (-1, rank) else owner)
            if owner == rank:
                to[i] = tuple(r for r in ranks_of[want.name] if r != rank)
        shares.append(Share(tuple(owners), to))
    return shares


def messages(nbytes: Sequence[int], limit: int = MESSAGE_NBYTES,
             small: int = SMALL_NBYTES) -> list[list[Piece]]:
    """The messages of a pair's units (their sizes, in the pair's order): each a list of
    pieces. A unit of ``small`` bytes or more is sent alone, in pieces of ``limit`` bytes at
    most; smaller ones share messages of up to ``limit`` bytes. Empty units are sent nowhere."""
    out: list[list[Piece]] = []
    batch: list[Piece] = []
    batch_nbytes = 0
    for i, n in enumerate(nbytes):
        if n == 0:
            continue
        if n >= small:
            out.extend([(i, lo, min(n, lo + limit))] for lo in range(0, n, limit))
            continue
        if batch and batch_nbytes + n > limit:
            out.append(batch)
            batch, batch_nbytes = [], 0
        batch.append((i, 0, n))
        batch_nbytes += n
    if batch:
        out.append(batch)
    return out
