"""Turn a version 3 manifest's regular tensors into the TensorEntry rows a load reads, reading
only the index files of the ranks that wrote the chunks it needs.

A regular tensor's chunks follow from its grid, and so does each chunk's writer (format/grid.py):
for each key a load asks for (and the region of it, when only a region is read) format/regular_section.py
finds the chunks that overlap the region without visiting the others, the ranks that wrote
them, and reads those ranks' index files (one read for all; their checksums always checked). A
resume on the layout that saved reads its own rank's index file, and those of the writers of
its replicated tensors; ``expand_all`` reads every one (verify, export; ``ckptio ls`` reads them
without torch: cli/source.py).

Owns: which regions an in-place load wants (``wanted_in_place``); reading index files through
the caller's ``read`` (its pool). Does not own: the chunks, index bytes and rows
(format/regular_section.py), what a load does with the rows (fill.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ckptio.format import regular_section
from ckptio.format.flatten import FlatState
from ckptio.format.overlap import overlapping
from ckptio.format.regular_section import Wants
from ckptio.format.types import Chunk, IndexFile, Manifest, Read, TensorEntry
from ckptio.loading import state_keys
from ckptio.planning.sharding import Held, held

__all__ = ["expand", "expand_all", "held_leaf", "overlapping", "wanted_in_place", "wanted_regions"]

ReadFn = Callable[[list[Read]], int]


def expand_all(record: Manifest, read: ReadFn) -> Manifest:
    """``record`` with every chunk of its regular tensors as a TensorEntry row (a manifest of
    every chunk, as version 2 held it)."""
    return regular_section.expand_all(record, _index_reader(read))


def expand(record: Manifest, wants: Wants, read: ReadFn) -> Manifest:
    """``record`` with a row for each chunk of a regular tensor in ``wants`` that overlaps the
    region wanted; its regular section is kept (the keys a load did not ask for stay known)."""
    return regular_section.expand(record, wants, _index_reader(read))


def wanted_in_place(record: Manifest, flat: FlatState, select: Callable[[str], bool]) -> dict[
        str, Chunk | None]:
    """What an in-place load of ``flat`` reads of each regular key: the region a state leaf
    holds (its DTensor's, its shard's), the whole tensor for a leaf that holds none of it
    (replaced whole) or for a key a Stateful lacks and the load creates (a fresh optimizer's
    state); nothing for keys it leaves out."""
    return wanted_regions({r.key for r in record.regular}, dict(record.aliases), flat, select)


def wanted_regions(stored: set[str], aliases: dict[str, str], flat: FlatState,
                   select: Callable[[str], bool]) -> dict[str, Chunk | None]:
    """wanted_in_place for the keys ``stored`` (aliases: key -> the key it shares a tensor
    with): the region of each an in-place load of ``flat`` reads, None for the whole."""
    regular_keys = stored
    may_create = state_keys.creatable(flat)
    wants: dict[str, Chunk | None] = {}
    for key in flat.leaves:
        target = aliases.get(key, key)
        if target in regular_keys and select(key):
            region = held_leaf(flat, key)
            whole = region is None or region.chunk.flat or target in wants
            wants[target] = None if whole else region.chunk  # type: ignore[union-attr]
    for key in regular_keys - set(flat.leaves) - set(wants):
        if select(key) and may_create(key):
            wants[key] = None
    return wants


def held_leaf(flat: FlatState, key: str) -> Held | None:
    """The region the leaf of ``flat`` at ``key`` holds (sharding.held), worked out once per
    flattened state: a load's region wants and its fill plan ask for every leaf's (a DTensor's
    is torch's box arithmetic and its mesh's grid)."""
    if key not in flat.regions:
        flat.regions[key] = held(flat.leaves[key], key)
    region: Held | None = flat.regions[key]
    return region


def _index_reader(read: ReadFn) -> regular_section.ReadIndexes:
    """Index files read whole through ``read`` (unverified: format/regular_section.py checks them)."""
    def read_indexes(files: list[IndexFile]) -> list[bytes]:
        reads = []
        for f in files:
            entry = TensorEntry(f"(index of rank {f.rank})", "bytes", "uint8", (f.nbytes,),
                                Chunk.whole((f.nbytes,)), f.name, 0, f.nbytes, f.checksum)
            reads.append(Read.of(entry, torch.empty(f.nbytes, dtype=torch.uint8)))
        read(reads)
        return [r.dest.numpy().tobytes() for r in reads]

    return read_indexes
