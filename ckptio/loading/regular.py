"""Turn a version 3 manifest's regular tensors into the TensorEntry rows a load reads, reading
only the index files of the ranks that wrote the chunks it needs.

A regular tensor's chunks follow from its grid, and so does each chunk's writer (format/grid.py):
for each key a load asks for (and the region of it, when only a region is read) this finds
the chunks that overlap the region without visiting the others, the ranks that wrote them, and
reads those ranks' index files (one read for all; their checksums always checked). A resume
on the layout that saved reads its own rank's index file, and those of the writers of its
replicated tensors; ``expand_all`` reads every one (``ckptio ls``, verify, export).

Owns: which chunks and index files a load needs; the rows made of them. Does not own: the
index bytes (format/regular.py), reading (the ``read`` handed in, through the caller's pool),
what a load does with the rows (fill.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping

import torch

from ckptio.format import regular
from ckptio.format.check import Check
from ckptio.format.checksum import new_hasher
from ckptio.format.flatten import FlatState
from ckptio.format.grid import REPLICATE, Grid, split
from ckptio.format.types import (
    DTYPE_ITEMSIZE,
    Chunk,
    IndexFile,
    Manifest,
    Read,
    RegularTensor,
    TensorEntry,
)
from ckptio.loading import merge
from ckptio.planning.sharding import held

__all__ = ["expand", "expand_all", "wanted_in_place"]

ReadFn = Callable[[list[Read]], int]
Wants = Mapping[str, "Chunk | None"]  # regular key -> the region a load reads (None: whole)


def expand_all(record: Manifest, read: ReadFn) -> Manifest:
    """``record`` with every chunk of its regular tensors as a TensorEntry row (a manifest of
    every chunk, as version 2 held it)."""
    if not record.regular:
        return record
    expanded = expand(record, {r.key: None for r in record.regular}, read)
    return dataclasses.replace(expanded, grids=(), regular=(), indexes=())


def expand(record: Manifest, wants: Wants, read: ReadFn) -> Manifest:
    """``record`` with a row for each chunk of a regular tensor in ``wants`` that overlaps the
    region wanted; its regular section is kept (the keys a load did not ask for stay known)."""
    if not record.regular:
        return record
    by_key = {r.key: r for r in record.regular}
    needed: dict[int, list[tuple[RegularTensor, Chunk]]] = {}
    for key, region in wants.items():
        if key in by_key:
            tensor = by_key[key]
            grid = record.grids[tensor.grid]
            found = list(overlapping(grid, tensor, region))
            if not found:  # an empty region (an uneven split's empty piece): one chunk
                # still says what the key holds (kind, dtype, shape) for the load's checks
                found = list(itertools.islice(overlapping(grid, tensor, None), 1))
            for rank, chunk in found:
                needed.setdefault(rank, []).append((tensor, chunk))
    entries = [TensorEntry(tensor.key, "tensor", tensor.dtype, tensor.shape, chunk, row.file,
                           row.offset, _nbytes(tensor, chunk), row.checksum, None, row.blocks)
               for rank, rows in _rows(record, needed, read).items()
               for (tensor, chunk), row in zip(needed[rank], rows)]
    return dataclasses.replace(record, tensors=(*record.tensors, *entries))


def wanted_in_place(record: Manifest, flat: FlatState, select: Callable[[str], bool]) -> dict[
        str, Chunk | None]:
    """What an in-place load of ``flat`` reads of each regular key: the region a state leaf
    holds (its DTensor's, its shard's), the whole tensor for a leaf that holds none of it
    (replaced whole) or for a key a Stateful lacks and the load creates (a fresh optimizer's
    state); nothing for keys it leaves out."""
    regular_keys = {r.key for r in record.regular}
    aliases = dict(record.aliases)
    may_create = merge.creatable(flat)
    wants: dict[str, Chunk | None] = {}
    for key, leaf in flat.leaves.items():
        target = aliases.get(key, key)
        if target in regular_keys and select(key):
            region = held(leaf.value, key)
            whole = region is None or region.chunk.flat or target in wants
            wants[target] = None if whole else region.chunk  # type: ignore[union-attr]
    for key in regular_keys - set(flat.leaves) - set(wants):
        if select(key) and may_create(key):
            wants[key] = None
    return wants


def overlapping(grid: Grid, tensor: RegularTensor, region: Chunk | None) -> Iterator[
        tuple[int, Chunk]]:
    """(writer rank, chunk) of each non-empty chunk of ``tensor`` that overlaps ``region``
    (None: all): along each mesh dim only the pieces that reach the region are visited, and
    along replicated dims only the writer's coordinate (Grid.writer)."""
    shape = tensor.shape
    if region is not None and (region.flat or not region.fits(shape)):
        region = None
    if region is not None and not region.numel:
        return
    fixed = _writer_digits(grid, tensor.key)
    coordinate = [0] * len(grid.shape)

    def walk(m: int, offsets: list[int], sizes: list[int]) -> Iterator[tuple[int, Chunk]]:
        if m == len(grid.shape):
            if all(sizes):
                yield grid.ranks[_flat(grid, coordinate)], grid.chunk(shape, tuple(coordinate))
            return
        dim, parts = grid.dims[m], grid.shape[m]
        if dim == REPLICATE:
            coordinate[m] = fixed[m]
            yield from walk(m + 1, offsets, sizes)
            return
        for index in _reaching(parts, offsets[dim], sizes[dim], region, dim):
            start, length = split(sizes[dim], parts, index)
            coordinate[m] = index
            yield from walk(m + 1, _set(offsets, dim, offsets[dim] + start),
                            _set(sizes, dim, length))

    yield from walk(0, [0] * len(shape), list(shape))


def _reaching(parts: int, base: int, size: int, region: Chunk | None, dim: int) -> range:
    """The pieces (of ``size`` elements from ``base`` cut into ``parts``) that reach the
    region along ``dim``."""
    if region is None or size == 0:
        return range(parts)
    piece = -(-size // parts)
    lo = region.offsets[dim] - base
    hi = lo + region.sizes[dim]
    return range(max(0, lo // piece), min(parts, max(0, -(-hi // piece))))


def _writer_digits(grid: Grid, key: str) -> dict[int, int]:
    """The coordinate, along each replicated mesh dim, of the replica that writes ``key``."""
    writer, digits = grid.writer(key), {}
    for m in reversed(range(len(grid.shape))):
        if grid.dims[m] == REPLICATE:
            writer, digits[m] = divmod(writer, grid.shape[m])
    return digits


def _flat(grid: Grid, coordinate: list[int]) -> int:
    flat = 0
    for size, at in zip(grid.shape, coordinate):
        flat = flat * size + at
    return flat


def _set(values: list[int], at: int, value: int) -> list[int]:
    out = list(values)
    out[at] = value
    return out


def _nbytes(tensor: RegularTensor, chunk: Chunk) -> int:
    return chunk.numel * DTYPE_ITEMSIZE[tensor.dtype]


def _check(record: Manifest, rank: int, index: IndexFile | None = None) -> Check:
    """The errors about rank ``rank``'s index file (``index``, when the manifest lists it)."""
    name = "(none listed)" if index is None else index.name
    return Check(f"index file {name} of rank {rank} (save {record.save_id})")


def _rows(record: Manifest, needed: Mapping[int, list[tuple[RegularTensor, Chunk]]],
          read: ReadFn) -> dict[int, list[regular.IndexRow]]:
    """Rank -> the IndexRow of each of its ``needed`` chunks, in order, from its index file
    (all read in one pass, checksums checked); every row used is checked."""
    files = {i.rank: i for i in record.indexes}
    missing = [r for r in needed if r not in files]
    if missing:
        raise _check(record, missing[0]).fail(
            f"the manifest lists no index file for rank {missing[0]}, whose chunks this load "
            "needs")
    data = _read_files(record, [files[r] for r in sorted(needed)], read)
    by_name = {f.name: f for f in record.files}
    tensors = {r.key: r for r in record.regular}
    out: dict[int, list[regular.IndexRow]] = {}
    for rank, chunks in needed.items():
        c = _check(record, rank, files[rank])
        rows = {row.key: row for row in regular.decode_index(data[rank], c, record.save_id, rank,
                                                              tensors)}
        absent = [(t.key, chunk) for t, chunk in chunks if t.key not in rows]
        if absent:
            key, chunk = absent[0]
            raise c.fail(f"rank {rank} wrote chunk {chunk.offsets}+{chunk.sizes} of {key!r} "
                         "(its grid says so) but its index file does not list it")
        out[rank] = [rows[t.key] for t, _chunk in chunks]
        regular.check_rows(c, ((row, _nbytes(t, chunk), DTYPE_ITEMSIZE[t.dtype])
                               for row, (t, chunk) in zip(out[rank], chunks)),
                           by_name, rank, record.block_nbytes)
    return out


def _read_files(record: Manifest, files: list[IndexFile], read: ReadFn) -> dict[int, bytes]:
    """Each index file's content, by rank, its checksum checked (even where a load's data
    checksums are not: a wrong row would read wrong bytes)."""
    if not files:
        return {}
    reads = []
    for f in files:
        entry = TensorEntry(f"(index of rank {f.rank})", "bytes", "uint8", (f.nbytes,),
                            Chunk.whole((f.nbytes,)), f.name, 0, f.nbytes, f.checksum)
        reads.append(Read.of(entry, torch.empty(f.nbytes, dtype=torch.uint8)))
    read(reads)
    out = {}
    for f, r in zip(files, reads):
        data = r.dest.numpy().tobytes()
        hasher = new_hasher(record.checksum_algorithm)
        hasher.update(data)
        if hasher.hexdigest() != f.checksum:
            raise _check(record, f.rank, f).fail("its bytes do not match its checksum")
        out[f.rank] = data
    return out
