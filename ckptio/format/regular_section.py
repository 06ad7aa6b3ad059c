"""Version 3's regular section: tensors described once per layout, and the per-rank index files
that hold where each of their chunks lies (the layout: docs/FORMAT.md, "Regular tensors").

Every chunk of a regular tensor follows from its grid (grid.py), and so does its writer: the
replica ``Grid.writer(key)`` names. That rank's index file lists, per chunk it wrote, the file,
offset and checksums, so the manifest is O(tensors + ranks) and a load reads only the index
files of the ranks whose chunks it needs.

Call order: a save builds ``IndexRow``s and ``encode_index`` / ``section_json``; a load's
``parse_section`` (from validate.py) -> ``expand`` (the chunks overlapping the regions a reader
wants, reading only their writers' index files through the ``read`` handed in, checksums always
checked) or ``expand_all`` (every index file: ``ckptio ls`` and diff without torch, verify and
export through ckptio.load's pool) -> ``decode_index`` / ``check_rows`` on each file read.

Owns: those bytes and every check on them (the file's checksum and length, a row's tensor and
file exist, its bytes lie inside its file without overlapping another row's, its block count
fits its length); the index files a region's chunks need and the rows made of them. Pure:
no torch, no file access. Does not own: which chunks overlap a region (overlap.py), which
regions a load wants (loading/resolve_regular.py), reading the files (the caller's ``read``),
the rest of the manifest (manifest.py, validate.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptio.format.check import Check, checksum_of, shape_of
from ckptio.format.checksum import entry_checksum
from ckptio.format.grid import REPLICATE, Grid
from ckptio.format.overlap import overlapping
from ckptio.format.types import (
    DTYPE_ITEMSIZE,
    Chunk,
    FileInfo,
    IndexFile,
    Manifest,
    RegularTensor,
    TensorEntry,
    show,
)

__all__ = ["INDEX_MAGIC", "IndexRow", "ReadIndexes", "Wants", "check_rows", "decode_index",
           "encode_index", "expand", "expand_all", "index_name", "parse_section", "section_json"]

INDEX_MAGIC = "ckptio-index"
INDEX_VERSION = 1

# Each listed index file's content, in order: its first ``nbytes`` bytes (fewer where the file
# ends first), unverified (expand checks them).
ReadIndexes = Callable[[list[IndexFile]], list[bytes]]
Wants = Mapping[str, "Chunk | None"]  # regular key -> the region a reader wants (None: whole)


@dataclass(frozen=True)
class IndexRow:
    """Where the chunk of regular tensor ``key`` a rank wrote lies."""

    key: str
    file: str
    offset: int
    checksum: str
    blocks: tuple[str, ...] = ()


def index_name(save_id: str, rank: int) -> str:
    return f"data-{save_id}-r{rank:05d}-index.bin"


# ------------------------------------------------------------------ the manifest's section

def section_json(m: Manifest) -> dict[str, Any]:
    return {
        "grids": [{"shape": list(g.shape), "ranks": list(g.ranks), "dims": list(g.dims)}
                  for g in m.grids],
        "regular": [{"key": r.key, "dtype": r.dtype, "shape": list(r.shape), "grid": r.grid}
                    for r in m.regular],
        "indexes": [{"rank": i.rank, "name": i.name, "nbytes": i.nbytes, "checksum": i.checksum}
                    for i in m.indexes],
    }


def parse_section(c: Check, raw: Mapping[str, Any], world_size: int,
                  files: Mapping[str, FileInfo]) -> tuple[tuple[Grid, ...],
                                                          tuple[RegularTensor, ...],
                                                          tuple[IndexFile, ...]]:
    grids = tuple(_grid(c, g, world_size) for g in c.list(c.field(raw, "grids", "manifest"),
                                                          "grids"))
    regular = tuple(_regular(c, r, grids) for r in c.list(c.field(raw, "regular", "manifest"),
                                                         "regular"))
    indexes = tuple(_index(c, i, files) for i in c.list(c.field(raw, "indexes", "manifest"),
                                                        "indexes"))
    if len({i.rank for i in indexes}) != len(indexes):
        raise c.fail("two index files of the same rank")
    return grids, regular, indexes


def _grid(c: Check, raw: Any, world_size: int) -> Grid:
    shape = shape_of(c, raw, "grid")
    ranks = tuple(c.int(r, "grid rank") for r in c.list(c.field(raw, "ranks", "grid"), "ranks"))
    dims = c.list(c.field(raw, "dims", "grid"), "grid dims")
    size = 1
    for n in shape:
        size *= n
    if not shape or size != len(ranks) or len(set(ranks)) != len(ranks):
        raise c.fail(f"a grid of shape {shape} has {len(ranks)} ranks, or one twice")
    if any(r >= world_size for r in ranks):
        raise c.fail(f"a grid names a rank not below world_size {world_size}")
    if len(dims) != len(shape) or any(type(d) is not int or d < REPLICATE for d in dims):
        raise c.fail(f"grid dims {show(dims)}: one per mesh dim, a tensor dim or -1")
    return Grid(shape, ranks, tuple(dims))


def _regular(c: Check, raw: Any, grids: tuple[Grid, ...]) -> RegularTensor:
    key = c.str(c.field(raw, "key", "regular tensor"), "regular tensor key")
    what = f"regular tensor {show(key)}"
    dtype = c.str(c.field(raw, "dtype", what), f"{what} dtype")
    if dtype not in DTYPE_ITEMSIZE:
        raise c.fail(f"{what} has unknown dtype {show(dtype)}")
    shape = shape_of(c, raw, what)
    if 0 in shape:
        raise c.fail(f"{what}: shape {shape} has no elements (such a tensor is stored per chunk)")
    grid = c.int(c.field(raw, "grid", what), f"{what} grid")
    if grid >= len(grids) or any(d >= len(shape) for d in grids[grid].dims):
        raise c.fail(f"{what}: grid {grid} does not exist or shards a dim its shape lacks")
    return RegularTensor(key, dtype, shape, grid)


def _index(c: Check, raw: Any, files: Mapping[str, FileInfo]) -> IndexFile:
    name = c.str(c.field(raw, "name", "index file"), "index file name")
    info = files.get(name)
    rank = c.int(c.field(raw, "rank", f"index file {name}"), f"index file {name} rank")
    nbytes = c.int(c.field(raw, "nbytes", f"index file {name}"), f"index file {name} nbytes")
    if info is None or info.rank != rank or info.nbytes < nbytes:
        raise c.fail(f"index file {show(name)} of rank {rank} is not a file of that rank, "
                     f"{nbytes} bytes long at least")
    return IndexFile(rank, name, nbytes, checksum_of(c, raw.get("checksum"), f"index file {name}"))


# ------------------------------------------------------------------ a rank's index file

def encode_index(save_id: str, rank: int, rows: Sequence[IndexRow]) -> bytes:
    files, keys = sorted({r.file for r in rows}), [r.key for r in rows]
    number = {name: i for i, name in enumerate(files)}
    digits = len(rows[0].checksum) if rows else 16
    blocks = [b for r in rows for b in r.blocks]
    header = {"magic": INDEX_MAGIC, "version": INDEX_VERSION, "save_id": save_id, "rank": rank,
              "count": len(rows), "keys": keys, "files": files, "digits": digits,
              "nblocks": len(blocks)}
    columns = (array("I", range(len(rows))), array("I", (number[r.file] for r in rows)),
               array("Q", (r.offset for r in rows)), array("I", (len(r.blocks) for r in rows)))
    body = b"".join(_little(col) for col in columns)
    text = "".join(r.checksum for r in rows) + "".join(blocks)
    return json.dumps(header).encode() + b"\n" + body + text.encode("ascii")


def decode_index(data: bytes, c: Check, save_id: str, rank: int,
                 tensors: Mapping[str, RegularTensor]) -> list[IndexRow]:
    """The rows of rank ``rank``'s index file of save ``save_id``, each of one of the
    manifest's regular ``tensors``, none twice; ``c`` names the file in every ManifestError."""
    newline = data.find(b"\n")
    header = _header(c, data[:newline] if newline > 0 else b"", save_id, rank)
    count, digits, nblocks = (c.int(header.get(f), f"index {f}")
                              for f in ("count", "digits", "nblocks"))
    files = [c.str(f, "index file name") for f in c.list(header.get("files"), "index files")]
    keys = [c.str(k, "index key") for k in c.list(header.get("keys"), "index keys")]
    if len(set(keys)) != len(keys) or not all(k in tensors for k in keys):
        raise c.fail("it lists a key twice, or one that is no regular tensor of the manifest")
    width = 4 + 4 + 8 + 4 + digits
    if digits != 16 or len(data) != newline + 1 + count * width + nblocks * digits:
        raise c.fail(f"its length ({len(data)} bytes) is not that of {count} rows and "
                     f"{nblocks} block checksums of {digits} digits")
    at = newline + 1
    key, file, nblock = array("I"), array("I"), array("I")
    offset = array("Q")
    for col in (key, file, offset, nblock):
        end = at + count * col.itemsize
        col.frombytes(data[at:end])
        _native(col)
        at = end
    text = data[at:].decode("ascii", errors="replace")
    if sum(nblock) != nblocks or (count and max(file) >= len(files)) or (
            count and max(key) >= len(keys)) or len(set(key)) != count:
        raise c.fail("a row names a file or tensor that does not exist, or a tensor another "
                     "row names, or more block checksums than the file holds")
    checksums = [checksum_of(c, text[i * digits:(i + 1) * digits], "index row")
                 for i in range(count)]
    blocks = iter([checksum_of(c, text[i:i + digits], "index block")
                   for i in range(count * digits, len(text), digits)])
    return [IndexRow(keys[key[i]], files[file[i]], offset[i], checksums[i],
                     tuple(next(blocks) for _ in range(nblock[i]))) for i in range(count)]


def _header(c: Check, line: bytes, save_id: str, rank: int) -> dict[str, Any]:
    try:
        header = json.loads(line) if line else None
    except (ValueError, RecursionError):  # not JSON, or nested deeper than json recurses
        header = None
    if not isinstance(header, dict) or header.get("magic") != INDEX_MAGIC:
        raise c.fail("it is not a ckptio index file (bad header line)")
    if header.get("version") != INDEX_VERSION:
        raise c.fail(f"index version {show(header.get('version'))}; this ckptio reads "
                     f"{INDEX_VERSION}: upgrade ckptio")
    if header.get("save_id") != save_id or header.get("rank") != rank:
        raise c.fail(f"it belongs to save {show(header.get('save_id'))} rank "
                     f"{show(header.get('rank'))}, not to this manifest's save {save_id} rank "
                     f"{rank}")
    return header


def check_rows(c: Check, rows: Iterable[tuple[IndexRow, int, int]],
               files: Mapping[str, FileInfo], rank: int, block_nbytes: int) -> None:
    """Each (row, its chunk's nbytes, its element size): its file is one of ``rank``'s, its
    bytes lie inside it, aligned to its elements, overlapping no other row's, and its block
    checksums fit its length."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for row, nbytes, itemsize in rows:
        info = files.get(row.file)
        if (info is None or info.rank != rank or row.offset + nbytes > info.nbytes
                or row.offset % itemsize):
            raise c.fail(f"the row of {show(row.key)} claims bytes [{row.offset}, "
                         f"{row.offset + nbytes}) of {show(row.file)}, not inside a data file "
                         f"of rank {rank} or not aligned to its {itemsize}-byte elements")
        if len(row.blocks) != (-(-nbytes // block_nbytes) if nbytes > block_nbytes else 0):
            raise c.fail(f"the row of {show(row.key)} has {len(row.blocks)} block "
                         f"checksums for {nbytes} bytes in blocks of {block_nbytes}")
        if nbytes:
            spans.setdefault(row.file, []).append((row.offset, row.offset + nbytes))
    for file, of_file in spans.items():
        of_file.sort()
        if any(b[0] < a[1] for a, b in zip(of_file, of_file[1:])):
            raise c.fail(f"two rows claim the same bytes of data file {file}")


# ------------------------------------------------------------------ the chunks a reader wants

def expand_all(record: Manifest, read: ReadIndexes) -> Manifest:
    """``record`` with every chunk of its regular tensors as a TensorEntry row (a manifest of
    every chunk, as version 2 held it), every index file read."""
    if not record.regular:
        return record
    expanded = expand(record, {r.key: None for r in record.regular}, read)
    return dataclasses.replace(expanded, grids=(), regular=(), indexes=())


def expand(record: Manifest, wants: Wants, read: ReadIndexes) -> Manifest:
    """``record`` with a row for each chunk of a regular tensor in ``wants`` that overlaps the
    region wanted; its regular section is kept (the keys a reader did not ask for stay known).
    Reads the index files of those chunks' writers only."""
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


def _nbytes(tensor: RegularTensor, chunk: Chunk) -> int:
    return chunk.numel * DTYPE_ITEMSIZE[tensor.dtype]


def _check(record: Manifest, rank: int, index: IndexFile | None = None) -> Check:
    """The errors about rank ``rank``'s index file (``index``, when the manifest lists it)."""
    name = "(none listed)" if index is None else index.name
    return Check(f"index file {name} of rank {rank} (save {record.save_id})")


def _rows(record: Manifest, needed: Mapping[int, list[tuple[RegularTensor, Chunk]]],
          read: ReadIndexes) -> dict[int, list[IndexRow]]:
    """Rank -> the IndexRow of each of its ``needed`` chunks, in order, from its index file
    (all read in one pass, checksums checked); every row used is checked."""
    files = {i.rank: i for i in record.indexes}
    missing = [r for r in needed if r not in files]
    if missing:
        raise _check(record, missing[0]).fail(
            f"the manifest lists no index file for rank {missing[0]}, whose chunks this load "
            "needs")
    data = _contents(record, [files[r] for r in sorted(needed)], read)
    by_name = {f.name: f for f in record.files}
    tensors = {r.key: r for r in record.regular}
    out: dict[int, list[IndexRow]] = {}
    for rank, chunks in needed.items():
        c = _check(record, rank, files[rank])
        rows = {row.key: row for row in decode_index(data[rank], c, record.save_id, rank,
                                                     tensors)}
        absent = [(t.key, chunk) for t, chunk in chunks if t.key not in rows]
        if absent:
            key, chunk = absent[0]
            raise c.fail(f"rank {rank} wrote chunk {chunk.offsets}+{chunk.sizes} of {key!r} "
                         "(its grid says so) but its index file does not list it")
        out[rank] = [rows[t.key] for t, _chunk in chunks]
        check_rows(c, ((row, _nbytes(t, chunk), DTYPE_ITEMSIZE[t.dtype])
                       for row, (t, chunk) in zip(out[rank], chunks)),
                   by_name, rank, record.block_nbytes)
    return out


def _contents(record: Manifest, files: list[IndexFile], read: ReadIndexes) -> dict[int, bytes]:
    """Each index file's content, by rank, its length and checksum checked (even where a
    load's data checksums are not: a wrong row would read wrong bytes)."""
    if not files:
        return {}
    contents = read(files)
    if len(contents) != len(files):
        raise ValueError(f"read gave {len(contents)} index files for {len(files)} asked")
    out = {}
    for f, data in zip(files, contents):
        if len(data) != f.nbytes:
            raise _check(record, f.rank, f).fail(
                f"it holds {len(data)} bytes where the manifest lists {f.nbytes}")
        if entry_checksum(record.checksum_algorithm, record.block_nbytes, data) != f.checksum:
            raise _check(record, f.rank, f).fail("its bytes do not match its checksum")
        out[f.rank] = data
    return out


def _little(col: array[int]) -> bytes:
    """The column's bytes, little-endian whatever the machine."""
    _native(col)
    data = col.tobytes()
    _native(col)
    return data


def _native(col: array[int]) -> None:
    """Swap ``col`` between little-endian and this machine's order (nothing on most)."""
    if sys.byteorder == "big":
        col.byteswap()
