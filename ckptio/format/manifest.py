"""The versioned on-disk manifest: encode, decode, validate. See docs/FORMAT.md.

Owns: the byte format of manifest.json (a header line with the body's length and CRC-32, then
the JSON body) and every check on what it claims, so that a manifest that decodes is one a load
can carry out: the JSON's nesting depth (checked before parsing), every field's type and range,
offsets (inside their file, aligned to their element size, no two entries sharing bytes),
lengths, dtypes and the kinds that can hold them, shapes, chunks (a key's chunks tile its shape
exactly, so a load never allocates more than the data files hold), block checksums, file names,
keys and the tree; a decoded manifest is trusted by every later step. check_values decodes
every inline value (values.decode, which a load runs on each value it returns). Pure: bytes in,
Manifest out; no file access, no pickle. Does not own: whether the data files hold the bytes
the manifest claims (commit.check_files, restore, assemble).
"""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from itertools import accumulate
from typing import Any

from ckptio.format import values
from ckptio.errors import ManifestError
from ckptio.format.gcpause import paused
from ckptio.planning.reshard import FlatRange, flat_boxes
from ckptio.format.types import (DTYPE_ITEMSIZE, KINDS, NUMPY_DTYPES, Chunk, FileInfo, Manifest, ObjectEntry, TensorEntry, show)

MAGIC = "ckptio-manifest"
VERSION = 2  # 2: many ranks (chunks per key, per-rank entries, flat chunks, block checksums)
MANIFEST_NAME = "manifest.json"
_MAX_INT = 1 << 62
MAX_TREE_DEPTH = 256  # flatten.MAX_DEPTH: the deepest state a save writes
MAX_JSON_DEPTH = 3 * MAX_TREE_DEPTH + 32  # a dict level of the tree is 3 brackets deep
MAX_NDIM = 128
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
_CHECKSUM = re.compile(r"[0-9a-f]{16}")


def encode(manifest: Manifest) -> bytes:
    with paused():
        body = json.dumps(_body(manifest), separators=(",", ":"), allow_nan=False).encode()
    header = {"magic": MAGIC, "version": manifest.version, "body_nbytes": len(body),
              "body_crc32": zlib.crc32(body)}
    return json.dumps(header).encode() + b"\n" + body + b"\n"


def _body(m: Manifest) -> dict[str, Any]:
    return {
        "format": "ckptio",
        "version": m.version,
        "save_id": m.save_id,
        "checksum_algorithm": m.checksum_algorithm,
        "world_size": m.world_size,
        "files": [{"name": f.name, "nbytes": f.nbytes, "rank": f.rank} for f in m.files],
        "tensors": [_tensor_json(t) for t in m.tensors],
        "objects": [_object_json(o) for o in m.objects],
        "aliases": [list(pair) for pair in m.aliases],
        "tree": m.tree,
        "meta": m.meta,
        "block_nbytes": m.block_nbytes,
    }


def _tensor_json(t: TensorEntry) -> dict[str, Any]:
    chunk: dict[str, Any] = {"offsets": list(t.chunk.offsets), "sizes": list(t.chunk.sizes)}
    if t.chunk.flat:
        chunk["flat"] = True
    out = {
        "key": t.key, "kind": t.kind, "dtype": t.dtype, "shape": list(t.shape), "chunk": chunk,
        "file": t.file, "offset": t.offset, "nbytes": t.nbytes, "checksum": t.checksum,
    }
    if t.rank is not None:
        out["rank"] = t.rank
    if t.blocks:
        out["blocks"] = list(t.blocks)
    return out


def _object_json(o: ObjectEntry) -> dict[str, Any]:
    out = {"key": o.key, "value": o.value}
    if o.rank is not None:
        out["rank"] = o.rank
    return out


def decode(data: bytes, where: str) -> Manifest:
    """Parse and fully validate; ``where`` (the manifest path) goes into every error. Raises
    ManifestError and nothing else, in time and memory linear in ``data``."""
    newline = data.find(b"\n")
    header = _parse(data[:newline], 4) if newline > 0 else None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise ManifestError(f"{where}: not a ckptio manifest (bad header line); the checkpoint "
                            "is damaged: load an earlier one")
    version = header.get("version")
    if version != VERSION:
        fix = ("load it with the ckptio that wrote it and save it again"
               if type(version) is int and version < VERSION else "upgrade ckptio")
        raise ManifestError(f"{where}: manifest version {show(version)}; this ckptio reads "
                            f"version {VERSION}: {fix}")
    body = data[newline + 1:].rstrip(b"\n")
    if len(body) != header.get("body_nbytes") or zlib.crc32(body) != header.get("body_crc32"):
        raise ManifestError(f"{where}: manifest body is truncated or altered (length/CRC-32 "
                            "mismatch); the checkpoint is damaged: load an earlier one")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise ManifestError(f"{where}: manifest body nests deeper than {MAX_JSON_DEPTH} levels, "
                            "more than a ckptio manifest can; the checkpoint is damaged or was "
                            "written by something else: load an earlier one")
    try:
        with paused():
            raw = json.loads(body)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of too many digits
        raise ManifestError(f"{where}: manifest body is not JSON ({exc}); the checkpoint is "
                            "damaged: load an earlier one") from None
    with paused():
        return _validate(raw, where)


def _parse(text: bytes, max_depth: int) -> Any:
    """JSON ``text`` if it is JSON nested at most ``max_depth`` deep, else None."""
    if json_depth(text) > max_depth:
        return None
    try:
        return json.loads(text)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, an int of too many digits
        return None


_NOT_MARK = bytes(b for b in range(256) if b not in b'"[]{}')
_QUOTED = re.compile(rb'"[^"]*"')
_BRACKET_STEP = tuple(1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256))


def json_depth(text: bytes) -> int:
    """How deeply the arrays and objects of JSON ``text`` nest, found without parsing it (so a
    hostile depth never reaches json's recursion). Escaped backslashes, then escaped quotes,
    are dropped, so every quote left opens or closes a string; then all but quotes and
    brackets, then the strings (few are left that are not empty); then a running count of the
    brackets. Linear in ``text``; for text that is not JSON, a number json.loads then refuses."""
    if b"\\" in text:
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = text.translate(None, _NOT_MARK).replace(b'""', b"")
    brackets = _QUOTED.sub(b"", marks)
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


class _Check:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str) -> ManifestError:
        return ManifestError(f"{self.where}: {what}; the checkpoint is damaged or was written "
                             "by something else: load an earlier one")

    def int(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value < _MAX_INT:
            raise self.fail(f"{what} must be an integer in [0, 2^62), got {show(value)}")
        return value

    def str(self, value: Any, what: str) -> str:
        if not isinstance(value, str):
            raise self.fail(f"{what} must be a string, got {show(value)}")
        return value

    def list(self, value: Any, what: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(f"{what} must be a list, got {show(value)}")
        return value

    def field(self, obj: Any, name: str, what: str) -> Any:
        if not isinstance(obj, dict) or name not in obj:
            raise self.fail(f"{what} lacks field {name!r}")
        return obj[name]


def _validate(raw: Any, where: str) -> Manifest:
    c = _Check(where)
    if not isinstance(raw, dict) or raw.get("format") != "ckptio" or raw.get("version") != VERSION:
        raise c.fail("the body is not a ckptio object of this version (format/version fields)")
    world_size = c.int(c.field(raw, "world_size", "manifest"), "world_size")
    if world_size < 1:
        raise c.fail("world_size must be at least 1")
    files = tuple(_file(c, f, world_size)
                  for f in c.list(c.field(raw, "files", "manifest"), "files"))
    sizes = {f.name: f.nbytes for f in files}
    if len(sizes) != len(files):
        raise c.fail("a data file is listed twice")
    algorithm = c.str(c.field(raw, "checksum_algorithm", "manifest"), "checksum_algorithm")
    block_nbytes = c.int(c.field(raw, "block_nbytes", "manifest"), "block_nbytes")
    if block_nbytes < 1:
        raise c.fail("block_nbytes must be positive")
    tensors = tuple(_tensor(c, t, sizes, world_size, block_nbytes)
                    for t in c.list(c.field(raw, "tensors", "manifest"), "tensors"))
    _check_shared_bytes(c, tensors)
    objects = tuple(_object(c, o, world_size)
                    for o in c.list(c.field(raw, "objects", "manifest"), "objects"))
    aliases = tuple(_alias(c, a) for a in c.list(c.field(raw, "aliases", "manifest"), "aliases"))
    tree = c.field(raw, "tree", "manifest")
    _check_keys(c, tensors, objects, aliases, tree)
    _check_tilings(c, tensors)
    meta = c.field(raw, "meta", "manifest")
    return Manifest(
        version=VERSION, save_id=c.str(c.field(raw, "save_id", "manifest"), "save_id"),
        checksum_algorithm=algorithm, world_size=world_size, files=files, tensors=tensors,
        objects=objects, aliases=aliases, tree=tree, meta=meta if isinstance(meta, dict) else {},
        block_nbytes=block_nbytes,
    )


def _rank(c: _Check, raw: dict[str, Any], world_size: int, what: str) -> int | None:
    rank = raw.get("rank")
    if rank is None:
        return None
    if c.int(rank, f"{what} rank") >= world_size:
        raise c.fail(f"{what}: rank {rank} is not below world_size {world_size}")
    return rank


def _object(c: _Check, raw: Any, world_size: int) -> ObjectEntry:
    key = c.str(c.field(raw, "key", "object"), "object key")
    what = f"object {show(key)}"
    return ObjectEntry(key, c.field(raw, "value", what), _rank(c, raw, world_size, what))


def check_values(manifest: Manifest, where: str) -> None:
    """Decode every inline value as a load would (values.decode), so a malformed one is found
    without loading: ManifestError naming the key."""
    c = _Check(where)
    for o in manifest.objects:
        try:
            values.decode(o.value)
        except ValueError as exc:
            raise c.fail(f"object {show(o.key)}: its stored value is malformed ({exc})") from None


def _file(c: _Check, raw: Any, world_size: int) -> FileInfo:
    name = c.str(c.field(raw, "name", "file"), "file name")
    if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
        raise c.fail(f"data file name {show(name)} is not a plain file name")
    rank = c.int(c.field(raw, "rank", "file"), f"file {name} rank")
    if rank >= world_size:
        raise c.fail(f"file {name}: rank {rank} is not below world_size {world_size}")
    return FileInfo(name, c.int(c.field(raw, "nbytes", "file"), f"file {name} nbytes"), rank)


def _tensor(c: _Check, raw: Any, sizes: dict[str, int], world_size: int, block_nbytes: int) -> TensorEntry:
    key = c.str(c.field(raw, "key", "tensor"), "tensor key")
    what = f"tensor {show(key)}"
    kind = c.str(c.field(raw, "kind", what), f"{what} kind")
    dtype = c.str(c.field(raw, "dtype", what), f"{what} dtype")
    if kind not in KINDS or dtype not in DTYPE_ITEMSIZE:
        raise c.fail(f"{what} has unknown kind {show(kind)} or dtype {show(dtype)}")
    shape = _shape(c, raw, what)
    chunk = _chunk(c, raw, shape, what)
    _check_kind(c, kind, dtype, shape, chunk, what)
    file = c.str(c.field(raw, "file", what), f"{what} file")
    offset = c.int(c.field(raw, "offset", what), f"{what} offset")
    nbytes = c.int(c.field(raw, "nbytes", what), f"{what} nbytes")
    if nbytes != chunk.numel * DTYPE_ITEMSIZE[dtype]:
        raise c.fail(f"{what}: nbytes {nbytes} != {chunk.numel} elements of {dtype}")
    if file not in sizes or offset + nbytes > sizes[file]:
        raise c.fail(f"{what}: bytes [{offset}, {offset + nbytes}) lie outside data file "
                     f"{show(file)}")
    if offset % DTYPE_ITEMSIZE[dtype]:
        raise c.fail(f"{what}: offset {offset} in {file} is not a multiple of the "
                     f"{DTYPE_ITEMSIZE[dtype]}-byte elements of {dtype}")
    checksum = _checksum(c, c.field(raw, "checksum", what), what)
    blocks = tuple(_checksum(c, b, what) for b in c.list(raw.get("blocks", []), f"{what} blocks"))
    if len(blocks) != (-(-nbytes // block_nbytes) if nbytes > block_nbytes else 0):
        raise c.fail(f"{what}: {len(blocks)} block checksums for {nbytes} bytes in blocks of "
                     f"{block_nbytes}")
    rank = _rank(c, raw, world_size, what)
    if rank is not None and (chunk.flat or chunk != Chunk.whole(shape)):
        raise c.fail(f"{what}: an entry of rank {rank}'s own value must hold the whole tensor")
    return TensorEntry(key, kind, dtype, shape, chunk, file, offset, nbytes, checksum, rank, blocks)


def _shape(c: _Check, raw: dict[str, Any], what: str) -> tuple[int, ...]:
    """At most MAX_NDIM dims, each in [0, 2^62), whose product (zero dims counted as 1, as
    torch's strides do) stays below 2^62: a shape torch can allocate without overflow."""
    dims = c.list(c.field(raw, "shape", what), f"{what} shape")
    if len(dims) > MAX_NDIM:
        raise c.fail(f"{what}: shape has {len(dims)} dimensions, more than {MAX_NDIM}")
    shape = tuple(c.int(d, f"{what} shape") for d in dims)
    product = 1
    for d in shape:
        product *= max(d, 1)
        if product >= _MAX_INT:
            raise c.fail(f"{what}: shape {shape} is too large (2^62 elements or more)")
    return shape


def _chunk(c: _Check, raw: dict[str, Any], shape: tuple[int, ...], what: str) -> Chunk:
    chunk_raw = c.field(raw, "chunk", what)
    if not isinstance(chunk_raw, dict):
        raise c.fail(f"{what}: chunk must be an object")
    flat = chunk_raw.get("flat", False)
    if flat is not False and flat is not True:
        raise c.fail(f"{what}: chunk flag 'flat' must be true or false")
    ndim = 1 if flat else len(shape)
    offsets, chunk_sizes = (c.list(c.field(chunk_raw, name, what), f"{what} chunk {name}")
                            for name in ("offsets", "sizes"))
    if len(offsets) != ndim or len(chunk_sizes) != ndim:
        raise c.fail(f"{what}: a {'flat ' if flat else ''}chunk of a tensor of shape {shape} has "
                     f"{ndim} offset(s) and size(s), not {len(offsets)} and {len(chunk_sizes)}")
    chunk = Chunk(tuple(c.int(d, f"{what} chunk offsets") for d in offsets),
                  tuple(c.int(d, f"{what} chunk sizes") for d in chunk_sizes), flat)
    if not chunk.fits(shape):
        raise c.fail(f"{what}: {'flat ' if flat else ''}chunk {chunk.offsets}+{chunk.sizes} does "
                     f"not fit shape {shape}")
    return chunk


def _check_kind(c: _Check, kind: str, dtype: str, shape: tuple[int, ...], chunk: Chunk,
                what: str) -> None:
    """What a load turns the bytes into must be able to hold them (types.KINDS)."""
    if kind in ("numpy", "numpy_scalar") and dtype not in NUMPY_DTYPES:
        raise c.fail(f"{what}: kind {kind!r} cannot hold dtype {dtype} (numpy has no {dtype})")
    if kind in ("bytes", "pickle") and (dtype != "uint8" or len(shape) != 1):
        raise c.fail(f"{what}: kind {kind!r} is stored as 1-D uint8, not {dtype} of shape {shape}")
    if kind == "numpy_scalar" and shape != ():
        raise c.fail(f"{what}: kind 'numpy_scalar' is stored with shape (), not {shape}")
    if kind != "tensor" and (chunk.flat or chunk != Chunk.whole(shape)):
        raise c.fail(f"{what}: a {kind!r} value is stored whole, not as chunk "
                     f"{chunk.offsets}+{chunk.sizes}")


def _checksum(c: _Check, value: Any, what: str) -> str:
    checksum = c.str(value, f"{what} checksum")
    if not _CHECKSUM.fullmatch(checksum):
        raise c.fail(f"{what}: checksum {show(checksum)} is not 16 hex digits")
    return checksum


def _alias(c: _Check, raw: Any) -> tuple[str, str]:
    pair = c.list(raw, "alias")
    if len(pair) != 2:
        raise c.fail("an alias must be [key, target]")
    return c.str(pair[0], "alias key"), c.str(pair[1], "alias target")


def _check_shared_bytes(c: _Check, tensors: tuple[TensorEntry, ...]) -> None:
    """No two entries claim the same bytes of a file (a save gives each its own), so what a
    load allocates is bounded by the size of the data files."""
    by_file: dict[str, list[TensorEntry]] = {}
    for t in tensors:
        if t.nbytes:
            by_file.setdefault(t.file, []).append(t)
    for file, entries in by_file.items():
        entries.sort(key=lambda e: e.offset)
        for a, b in zip(entries, entries[1:]):
            if b.offset < a.offset + a.nbytes:
                raise c.fail(f"tensors {show(a.key)} and {show(b.key)} claim the same bytes "
                             f"[{b.offset}, {min(a.offset + a.nbytes, b.offset + b.nbytes)}) "
                             f"of data file {file}")


def _check_tilings(c: _Check, tensors: tuple[TensorEntry, ...]) -> None:
    """Each key's global chunks tile its shape: every element in exactly one chunk (a load
    fills the whole tensor; a shape larger than its chunks is refused before any allocation)."""
    chunks: dict[str, list[Chunk]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for t in tensors:
        if t.rank is None:
            chunks.setdefault(t.key, []).append(t.chunk)
            shapes[t.key] = t.shape
    for key, of_key in chunks.items():
        problem = tiling_problem(of_key, shapes[key])
        if problem is not None:
            raise c.fail(f"tensor {show(key)}: {problem}")


_Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, end) in every dimension
_TILING_WORK = 64  # per chunk and dimension: the most work tiling_problem spends on a key


def tiling_problem(chunks: list[Chunk], shape: tuple[int, ...]) -> str | None:
    """Why ``chunks`` (each inside ``shape``) do not tile a tensor of ``shape``, or None.

    Exact, and in time proportional to the number of chunks for the layouts saves produce (row,
    column, grid or flat shards): the volumes must add up, flat ranges must follow each other,
    and boxes are swept one dimension at a time (see _sweep)."""
    total = _numel(shape)
    held = sum(chunk.numel for chunk in chunks)
    if held != total:
        return (f"its {len(chunks)} chunk(s) hold {held} of the {total} elements of shape "
                f"{shape} ({'a chunk is missing' if held < total else 'chunks overlap'})")
    if total == 0 or len(chunks) == 1:  # one chunk inside the shape, as large as it: the whole
        return None
    if all(chunk.flat for chunk in chunks):
        return _flat_gap(chunks)
    boxes: list[_Box] = []
    for chunk in chunks:
        parts = ([box for _first, box in
                  flat_boxes(FlatRange(chunk.offsets[0], chunk.sizes[0]), shape)]
                 if chunk.flat else [chunk])
        boxes.extend((box.offsets, tuple(o + s for o, s in zip(box.offsets, box.sizes)))
                     for box in parts if box.numel)
    return _sweep(boxes, shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _flat_gap(chunks: list[Chunk]) -> str | None:
    """Flat ranges (volumes already adding up) tile the tensor iff, in order, each starts where
    the one before ends."""
    end = 0
    for start, size in sorted((ch.offsets[0], ch.sizes[0]) for ch in chunks if ch.sizes[0]):
        if start != end:
            return (f"its flat chunks {'overlap' if start < end else 'leave a gap'} at element "
                    f"{min(start, end)}")
        end = start + size
    return None


def _sweep(boxes: list[_Box], shape: tuple[int, ...]) -> str | None:
    """Boxes inside ``shape`` tile it iff, along one dimension, the boxes crossing each slab
    between consecutive box boundaries tile the slab's cross-section (the other dimensions),
    down to single boxes. Each step sweeps the dimension the fewest box-slab crossings cost;
    a layout that would take more than _TILING_WORK steps per box and dimension is refused."""
    budget = _TILING_WORK * len(boxes) * (len(shape) + 1)
    stack: list[tuple[list[_Box], tuple[int, ...]]] = [(boxes, tuple(range(len(shape))))]
    while stack:
        group, dims = stack.pop()
        dims = tuple(d for d in dims if any(b[0][d] or b[1][d] != shape[d] for b in group))
        if len(dims) <= 1:  # along one dimension (or none), the boxes are intervals
            problem = _interval_gap(group, dims[0] if dims else None, shape)
            if problem is not None:
                return problem
            continue
        costs = {d: _crossings(group, d) for d in dims}
        dim = min(dims, key=costs.__getitem__)
        budget -= len(group) * len(dims) + costs[dim]
        if budget < 0:  # checked before the sweep builds its slabs
            return (f"its {len(boxes)} chunks are laid out too irregularly for this reader to "
                    "check that they tile the tensor")
        rest = tuple(d for d in dims if d != dim)
        for at, crossing in _slabs(group, dim, shape[dim]):
            if not crossing:
                return f"no chunk holds index {at} of dimension {dim} (in part of the tensor)"
            stack.append((crossing, rest))
    return None


def _interval_gap(group: list[_Box], dim: int | None, shape: tuple[int, ...]) -> str | None:
    """Boxes spanning the whole region but along ``dim`` tile it iff their intervals along
    ``dim``, in order, each start where the one before ends, from 0 to the end."""
    if dim is None:
        return None if len(group) == 1 else f"{len(group)} of its chunks overlap"
    end = 0
    for start, stop in sorted((b[0][dim], b[1][dim]) for b in group):
        if start != end:
            break
        end = stop
    else:
        if end == shape[dim]:
            return None
        start = shape[dim]
    return (f"its chunks {'overlap' if start < end else 'leave a gap'} at index "
            f"{min(start, end)} of dimension {dim} (in part of the tensor)")


def _cuts(group: list[_Box], dim: int, extent: int) -> list[int]:
    return sorted({0, extent, *(b[0][dim] for b in group), *(b[1][dim] for b in group)})


def _crossings(group: list[_Box], dim: int) -> int:
    """How many (box, slab) pairs sweeping ``dim`` visits: the cost of choosing it."""
    index = {cut: i for i, cut in enumerate(sorted({*(b[0][dim] for b in group),
                                                     *(b[1][dim] for b in group)}))}
    return sum(index[b[1][dim]] - index[b[0][dim]] for b in group)


def _slabs(group: list[_Box], dim: int, extent: int) -> list[tuple[int, list[_Box]]]:
    """(start, the boxes crossing it) for each slab of ``dim`` between box boundaries."""
    starts: dict[int, list[int]] = {}
    ends: dict[int, list[int]] = {}
    for i, box in enumerate(group):
        starts.setdefault(box[0][dim], []).append(i)
        ends.setdefault(box[1][dim], []).append(i)
    active: dict[int, _Box] = {}
    out: list[tuple[int, list[_Box]]] = []
    for at in _cuts(group, dim, extent)[:-1]:
        for i in ends.get(at, ()):
            del active[i]
        for i in starts.get(at, ()):
            active[i] = group[i]
        out.append((at, list(active.values())))
    return out


def check_keys(manifest: Manifest, where: str) -> None:
    """The key rules a reader enforces (keys unique across tensors, objects and aliases; global
    or per-rank entries, no chunk twice; aliases to tensors; tree = keys), on a Manifest about
    to be written: a save must not commit what its own reader would refuse."""
    _check_keys(_Check(where), manifest.tensors, manifest.objects, manifest.aliases, manifest.tree)


def _check_keys(c: _Check, tensors: tuple[TensorEntry, ...], objects: tuple[ObjectEntry, ...],
                aliases: tuple[tuple[str, str], ...], tree: Any) -> None:
    tensor_keys = _check_groups(c, tensors, "tensor")
    object_keys = _check_groups(c, objects, "object")
    alias_keys = [a for a, _ in aliases]
    all_keys = [*tensor_keys, *object_keys, *alias_keys]
    if len(set(all_keys)) != len(all_keys):
        raise c.fail("a key appears twice (as a tensor, object or alias)")
    if any(target not in tensor_keys for _, target in aliases):
        raise c.fail("an alias points at a key that holds no tensor")
    if Counter(tree_keys(tree, c)) != Counter(all_keys):
        raise c.fail("the tree and the entries name different keys")


def _check_groups(c: _Check, entries: tuple[Any, ...], what: str) -> dict[str, Any]:
    """A key's entries are either global (rank None: one object, or chunks of one tensor with
    one kind, dtype and shape) or each rank's own (at most one per rank). -> key: first entry."""
    first: dict[str, Any] = {}
    ranks: set[tuple[str, int]] = set()
    chunks: set[tuple[str, Chunk]] = set()
    for e in entries:
        head = first.setdefault(e.key, e)
        if what == "tensor" and e.rank is None:
            if (e.key, e.chunk) in chunks:
                raise c.fail(f"tensor {show(e.key)} stores the same chunk twice")
            chunks.add((e.key, e.chunk))
        if (head.rank is None) != (e.rank is None):
            raise c.fail(f"{what} {show(e.key)} has both global and per-rank entries")
        if e.rank is not None:
            if (e.key, e.rank) in ranks:
                raise c.fail(f"{what} {show(e.key)} has two entries of rank {e.rank}")
            ranks.add((e.key, e.rank))
        elif e is not head and (what == "object" or (e.kind, e.dtype, e.shape) !=
                                (head.kind, head.dtype, head.shape)):
            raise c.fail(f"{what} {show(e.key)} has global entries that disagree (a global object "
                         "is stored once; a tensor's chunks share kind, dtype and shape)")
    return first


def tree_keys(tree: Any, c: _Check) -> list[str]:
    """Every leaf key of a tree, checking each node's shape and that no dict node holds a key
    twice (iteratively: hostile depth is an error, not a RecursionError)."""
    out: list[str] = []
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise c.fail(f"the tree nests deeper than {MAX_TREE_DEPTH} levels")
        if not isinstance(node, dict) or len(node) != 1:
            raise c.fail(f"tree node {show(node)} is not a one-field object")
        (tag, body), = node.items()
        if tag == "k" and isinstance(body, str):
            out.append(body)
        elif tag == "s":
            stack.append((body, depth + 1))
        elif tag in ("l", "t") and isinstance(body, list):
            stack.extend((child, depth + 1) for child in reversed(body))
        elif tag == "d" and isinstance(body, list):
            stack.extend((child, depth + 1) for child in reversed(_dict_children(c, body)))
        else:
            raise c.fail(f"tree node with tag {show(tag)} and body {show(body)} has an unknown "
                         "tag or a malformed body")
    return out


def _dict_children(c: _Check, items: list[Any]) -> list[Any]:
    seen: set[str | int] = set()
    for pair in items:
        if not (isinstance(pair, list) and len(pair) == 2 and _dict_key(pair[0])):
            raise c.fail(f"tree dict item {show(pair)} is not [str or int key, node]")
        if pair[0] in seen:
            raise c.fail(f"a dict of the tree holds key {show(pair[0])} twice")
        seen.add(pair[0])
    return [pair[1] for pair in items]


def _dict_key(key: Any) -> bool:
    return isinstance(key, str) or (type(key) is int)
