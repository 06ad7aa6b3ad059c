"""Read once, send to the others: which rank of an in-place load reads each stored entry that
several ranks want whole, and how its bytes go from that rank to the others.

A unit is one stored entry of one checkpoint (its file, offset, size and checksum: ``unit_name``)
that a rank reads whole into a tensor. Given every rank's units, the coordinator makes each unit
that two or more ranks want the charge of one of them, its owner (``assign``: largest first, to
the wanting rank with the fewest bytes to read so far, counting what it reads alone; a unit
below SMALL_NBYTES to the wanting rank that reads the most of its data file, whose reads of its
neighbours take it in, rather than a request of its own among another rank's reads); the owner
reads it from storage and sends it to the others. Between one owner and one receiver the units
go in name order (both sides sort alike, nothing more is said), as ``messages``: a unit of at
least SMALL_NBYTES in messages of its own of at most MESSAGE_NBYTES, smaller ones packed
together up to that size.

A resharded load's unit is a checksum block (``shared_blocks``): a block that a rank's pieces
want only part of (a cut between two ranks' regions inside it) is wanted whole, since only the
whole block can be checked; as a unit (``block_entry``: the block as a one-block entry whose
checksum is the block's) one rank reads it and the others receive it, so the block is read from
storage once, not once per rank that shares it.

Owns: these decisions. Does not own: the exchange and its failures (distributed/readshare.py,
distributed/sendreads.py), which reads a load makes (loading/fill_plan.py), the pieces
(reshard.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from ckptio.alignment import merged
from ckptio.format.types import DTYPE_ITEMSIZE, Chunk, Read, TensorEntry
from ckptio.planning.reshard import plan_reads, region_of, stored_from_entry

__all__ = ["MESSAGE_NBYTES", "SMALL_NBYTES", "Piece", "Share", "Want", "assign", "block_entry",
           "messages", "shared_blocks", "unit_name"]

SMALL_NBYTES = 1 << 20  # units below this are packed together into messages
MESSAGE_NBYTES = 32 << 20  # the most bytes of one message

Piece = tuple[int, int, int]  # (a unit's index in the pair's list, first byte, end byte)


@dataclass(frozen=True)
class Want:
    """A unit a rank wants: its name, its bytes and the data file holding them."""

    name: str
    nbytes: int
    file: str = ""


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


def assign(wants: Sequence[Sequence[Want]], alone_nbytes: Sequence[int],
           alone_files: Sequence[Mapping[str, int]] = ()) -> list[Share]:
    """Every rank's Share, given each rank's units (in its order) and the bytes it reads that
    are no unit (resharded regions; ``alone_files``: the same by data file). A unit one rank
    wants is its own (owner -1: no exchange). Units largest first: one of SMALL_NBYTES or more
    to the wanting rank with the fewest bytes so far; a smaller one to the wanting rank that
    reads the most bytes of its file (then the fewest bytes so far): its reads around the unit
    take it in, where another rank would read it alone, a request among the first's."""
    ranks_of: dict[str, list[int]] = {}
    unit_of: dict[str, Want] = {}
    for rank, units in enumerate(wants):
        for want in units:
            holders = ranks_of.setdefault(want.name, [])
            if not holders or holders[-1] != rank:
                holders.append(rank)
            unit_of[want.name] = want
    load = list(alone_nbytes)
    in_file = [dict(f) for f in alone_files] or [{} for _ in wants]

    def take(rank: int, want: Want) -> None:
        load[rank] += want.nbytes
        in_file[rank][want.file] = in_file[rank].get(want.file, 0) + want.nbytes

    for name, holders in ranks_of.items():
        if len(holders) == 1:
            take(holders[0], unit_of[name])
    owner_of: dict[str, int] = {}
    for name in sorted((n for n, h in ranks_of.items() if len(h) > 1),
                       key=lambda n: (-unit_of[n].nbytes, n)):
        want = unit_of[name]
        if want.nbytes < SMALL_NBYTES and want.file:
            chosen = min(ranks_of[name],
                         key=lambda r: (-in_file[r].get(want.file, 0), load[r], r))
        else:
            chosen = min(ranks_of[name], key=lambda r: (load[r], r))
        owner_of[name] = chosen
        take(chosen, want)
    return [_share(rank, units, owner_of, ranks_of) for rank, units in enumerate(wants)]


def _share(rank: int, units: Sequence[Want], owner_of: Mapping[str, int],
           ranks_of: Mapping[str, list[int]]) -> Share:
    owners, to = [], {}
    for i, want in enumerate(units):
        owner = owner_of.get(want.name, -1)
        owners.append(-1 if owner in (-1, rank) else owner)
        if owner == rank:
            to[i] = tuple(r for r in ranks_of[want.name] if r != rank)
    return Share(tuple(owners), to)


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


def shared_blocks(reads: Sequence[Read], block_nbytes: int) -> list[TensorEntry]:
    """The checksum blocks that the resharded ``reads`` of one rank want part of, each once and
    as ``block_entry``: the blocks at the edges of the byte ranges its pieces cover in each
    stored entry (all ``reads`` of an entry together). Entries read otherwise than as their
    plain bytes (coded, permuted) have none."""
    covered: dict[int, tuple[TensorEntry, list[tuple[int, int]]]] = {}
    for read in reads:
        if read.whole is not None or any(e.coded or e.order for e in read.entries):
            continue
        head = read.entries[0]
        try:
            pieces = plan_reads([stored_from_entry(e) for e in read.entries],
                                region_of(read.region), head.shape, DTYPE_ITEMSIZE[head.dtype],
                                1 << 62)
        except ValueError:  # the load's own planning names it (loading/read.py)
            continue
        for piece in pieces:
            entry = read.entries[piece.source]
            covered.setdefault(id(entry), (entry, []))[1].append(
                (piece.offset - entry.offset, piece.offset - entry.offset + piece.nbytes))
    out: list[TensorEntry] = []
    for entry, ranges in covered.values():
        joined = merged(sorted(ranges))
        edges = sorted({lo // block_nbytes for lo, _ in joined}
                       | {(hi - 1) // block_nbytes for _, hi in joined})
        for index in edges:
            lo = index * block_nbytes
            hi = min(lo + block_nbytes, entry.nbytes)
            if 0 < sum(max(0, min(hi, b) - max(lo, a)) for a, b in joined) < hi - lo:
                out.append(block_entry(entry, index, block_nbytes))
    return out


def block_entry(entry: TensorEntry, index: int, block_nbytes: int) -> TensorEntry:
    """Block ``index`` of ``entry`` as an entry of its own: its bytes as a 1-D tensor of the
    entry's dtype, its checksum the block's (the entry's own when it is one block)."""
    lo = index * block_nbytes
    nbytes = min(block_nbytes, entry.nbytes - lo)
    numel = nbytes // DTYPE_ITEMSIZE[entry.dtype]
    checksum = entry.blocks[index] if entry.blocks else entry.checksum
    return dataclasses.replace(entry, shape=(numel,), chunk=Chunk.whole((numel,)),
                               offset=entry.offset + lo, nbytes=nbytes, checksum=checksum,
                               blocks=())
