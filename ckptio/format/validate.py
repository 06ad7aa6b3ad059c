"""Field-by-field validation of a manifest's body: what a decoded manifest claims is what a load
can carry out. See docs/FORMAT.md.

Owns: every check on a parsed manifest body (manifest.decode calls from_body after the framing,
CRC and depth checks): every field's type and range, offsets (inside their file, aligned to their
element size, no two entries sharing bytes), lengths, dtypes and the kinds that can hold them,
shapes, chunks (a key's chunks tile its shape exactly, tiling.py, so a load never allocates more
than the data files hold), block checksums, file names, keys and the tree (version 3's regular
section: regular_section.py). check_keys runs the key rules on a Manifest about to be written
(KeysPassed: the same, skipping a layout its owner saw pass last); check_values decodes every
inline value (values.decode, which a load runs on each value it returns). Pure: no file access,
no pickle, no module-level state (the memo is the KeysPassed its owner holds).
Does not own: the byte framing (manifest.py), whether the data files hold the bytes the manifest
claims (storage/steps.check_files, loading/read.py).
"""

from __future__ import annotations

import marshal
import operator
import re
from collections import Counter
from typing import Any

from ckptio.format import containers, entryform, regular_section, values
from ckptio.format.check import (
    MAX_INT,
    MAX_NDIM,
    Check,
    checksum_of,
    is_checksum,
    shape_of,
    shared_bytes,
)
from ckptio.format.checksum import ALGORITHMS
from ckptio.format.tiling import tiling_problem
from ckptio.format.types import (
    BYTE_KINDS,
    DTYPE_ITEMSIZE,
    KINDS,
    MAX_TREE_DEPTH,
    NUMPY_DTYPES,
    Chunk,
    FileInfo,
    Manifest,
    ObjectEntry,
    TensorEntry,
    show,
)

__all__ = ["FILE_NAME", "MAX_NDIM", "KeysPassed", "check_keys", "check_values", "from_body"]

FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")  # a data file's name: plain, no path


def from_body(raw: Any, where: str, version: int) -> Manifest:
    """The Manifest that the parsed JSON body ``raw`` of a manifest of ``version`` describes,
    every field checked (module docstring); ManifestError naming ``where`` otherwise."""
    c = Check(where)
    if not isinstance(raw, dict) or raw.get("format") != "ckptio" or raw.get("version") != version:
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
    if algorithm not in ALGORITHMS:
        raise c.fail(f"checksum_algorithm {algorithm!r} is unknown; this ckptio knows {ALGORITHMS}")
    block_nbytes = c.int(c.field(raw, "block_nbytes", "manifest"), "block_nbytes")
    if block_nbytes < 1:
        raise c.fail("block_nbytes must be positive")
    tensors = tuple(_plain_tensor(t, sizes, block_nbytes)
                    or _tensor(c, t, sizes, world_size, block_nbytes, version)
                    for t in c.list(c.field(raw, "tensors", "manifest"), "tensors"))
    bases = entryform.check_bases(c, raw, version, tensors)
    _check_shared_bytes(c, tensors)
    objects = tuple(_object(c, o, world_size)
                    for o in c.list(c.field(raw, "objects", "manifest"), "objects"))
    aliases = tuple(_alias(c, a) for a in c.list(c.field(raw, "aliases", "manifest"), "aliases"))
    grids, regulars, indexes = ((), (), ()) if version < 3 else regular_section.parse_section(
        c, raw, world_size, {f.name: f for f in files})
    tree = c.field(raw, "tree", "manifest")
    _check_keys(c, tensors, objects, aliases, tree, tuple(r.key for r in regulars))
    meta = c.field(raw, "meta", "manifest")
    _check_tilings(c, tensors, whole=not _is_piece(c, meta, world_size))
    return Manifest(
        version=version, save_id=c.str(c.field(raw, "save_id", "manifest"), "save_id"),
        checksum_algorithm=algorithm, world_size=world_size, files=files, tensors=tensors,
        objects=objects, aliases=aliases, tree=tree, meta=meta if isinstance(meta, dict) else {},
        block_nbytes=block_nbytes, grids=grids, regular=regulars, indexes=indexes, bases=bases,
    )


def _rank(c: Check, raw: dict[str, Any], world_size: int, what: str) -> int | None:
    rank = raw.get("rank")
    if rank is None:
        return None
    if c.int(rank, f"{what} rank") >= world_size:
        raise c.fail(f"{what}: rank {rank} is not below world_size {world_size}")
    return rank


def _object(c: Check, raw: Any, world_size: int) -> ObjectEntry:
    key = c.str(c.field(raw, "key", "object"), "object key")
    what = f"object {show(key)}"
    return ObjectEntry(key, c.field(raw, "value", what), _rank(c, raw, world_size, what))


def check_values(manifest: Manifest, where: str) -> None:
    """Decode every inline value as a load would (values.decode), so a malformed one is found
    without loading: ManifestError naming the key."""
    c = Check(where)
    for o in manifest.objects:
        try:
            values.decode(o.value)
        except ValueError as exc:
            raise c.fail(f"object {show(o.key)}: its stored value is malformed ({exc})") from None


def _file(c: Check, raw: Any, world_size: int) -> FileInfo:
    name = c.str(c.field(raw, "name", "file"), "file name")
    if not FILE_NAME.fullmatch(name) or name in (".", ".."):
        raise c.fail(f"data file name {show(name)} is not a plain file name")
    rank = c.int(c.field(raw, "rank", "file"), f"file {name} rank")
    if rank >= world_size:
        raise c.fail(f"file {name}: rank {rank} is not below world_size {world_size}")
    return FileInfo(name, c.int(c.field(raw, "nbytes", "file"), f"file {name} nbytes"), rank)


def _tensor(c: Check, raw: Any, sizes: dict[str, int], world_size: int,
            block_nbytes: int, version: int) -> TensorEntry:
    key = c.str(c.field(raw, "key", "tensor"), "tensor key")
    what = f"tensor {show(key)}"
    kind = c.str(c.field(raw, "kind", what), f"{what} kind")
    dtype = c.str(c.field(raw, "dtype", what), f"{what} dtype")
    if kind not in KINDS or dtype not in DTYPE_ITEMSIZE:
        raise c.fail(f"{what} has unknown kind {show(kind)} or dtype {show(dtype)}")
    shape = shape_of(c, raw, what)
    chunk = _chunk(c, raw, shape, what)
    _check_kind(c, kind, dtype, shape, chunk, what)
    file = c.str(c.field(raw, "file", what), f"{what} file")
    offset = c.int(c.field(raw, "offset", what), f"{what} offset")
    nbytes = c.int(c.field(raw, "nbytes", what), f"{what} nbytes")
    if nbytes != chunk.numel * DTYPE_ITEMSIZE[dtype]:
        raise c.fail(f"{what}: nbytes {nbytes} != {chunk.numel} elements of {dtype}")
    stored, delta = entryform.parse_entry(c, raw, what, version=version, dtype=dtype,
                                          nbytes=nbytes, block_nbytes=block_nbytes)
    extent = stored.nbytes if stored is not None else nbytes
    if delta is not None and delta.kind == "ref":  # its file is the base's, checked there
        if not FILE_NAME.fullmatch(file) or file in (".", ".."):
            raise c.fail(f"{what}: data file name {show(file)} is not a plain file name")
    elif file not in sizes or offset + extent > sizes[file]:
        raise c.fail(f"{what}: bytes [{offset}, {offset + extent}) lie outside data file "
                     f"{show(file)}")
    if offset % DTYPE_ITEMSIZE[dtype]:
        raise c.fail(f"{what}: offset {offset} in {file} is not a multiple of the "
                     f"{DTYPE_ITEMSIZE[dtype]}-byte elements of {dtype}")
    checksum = checksum_of(c, c.field(raw, "checksum", what), what)
    blocks = tuple(checksum_of(c, b, what) for b in c.list(raw.get("blocks", []), f"{what} blocks"))
    if len(blocks) != (-(-nbytes // block_nbytes) if nbytes > block_nbytes else 0):
        raise c.fail(f"{what}: {len(blocks)} block checksums for {nbytes} bytes in blocks of "
                     f"{block_nbytes}")
    rank = _rank(c, raw, world_size, what)
    if rank is not None and (chunk.flat or chunk != Chunk.whole(shape)):
        raise c.fail(f"{what}: an entry of rank {rank}'s own value must hold the whole tensor")
    return TensorEntry(key, kind, dtype, shape, chunk, file, offset, nbytes, checksum, rank, blocks,
                       stored=stored, delta=delta)


def _plain_tensor(raw: Any, sizes: dict[str, int], block_nbytes: int) -> TensorEntry | None:
    """The common entry (kind "tensor", one global box chunk, neither compressed nor a delta)
    accepted without building a message: the checks _tensor makes, on exact JSON types, in
    a fraction of the time (docs/BENCH_LIMIT.md, "the cold small load").
    None for anything else or anything wrong, which _tensor then checks field by field and
    refuses, naming the field. It accepts only what _tensor accepts and returns the entry
    _tensor returns (tests/test_manifest.py checks both on valid and mutated entries)."""
    if (type(raw) is not dict or raw.get("kind") != "tensor" or raw.get("rank") is not None
            or "stored" in raw or "ref" in raw or "xor" in raw):
        return None
    key, dtype, file, chunk = raw.get("key"), raw.get("dtype"), raw.get("file"), raw.get("chunk")
    if (type(key) is not str or type(dtype) is not str or type(file) is not str
            or type(chunk) is not dict or chunk.get("flat", False) is not False):
        return None
    itemsize, shape = DTYPE_ITEMSIZE.get(dtype), _plain_ints(raw.get("shape"), None)
    if itemsize is None or shape is None:
        return None
    offsets = _plain_ints(chunk.get("offsets"), len(shape))
    chunk_sizes = _plain_ints(chunk.get("sizes"), len(shape))
    if offsets is None or chunk_sizes is None:
        return None
    product, numel = 1, 1
    for d, o, n in zip(shape, offsets, chunk_sizes):
        product, numel = product * max(d, 1), numel * n
        if o + n > d:
            return None
    offset, nbytes, checksum = raw.get("offset"), raw.get("nbytes"), raw.get("checksum")
    if (product >= MAX_INT or type(offset) is not int or type(nbytes) is not int
            or not 0 <= offset < MAX_INT or not 0 <= nbytes < MAX_INT
            or nbytes != numel * itemsize or offset % itemsize
            or offset + nbytes > sizes.get(file, -1) or not is_checksum(checksum)):
        return None
    blocks = raw.get("blocks", [])
    if (type(blocks) is not list
            or len(blocks) != (-(-nbytes // block_nbytes) if nbytes > block_nbytes else 0)
            or not all(map(is_checksum, blocks))):
        return None
    return TensorEntry(key, "tensor", dtype, shape, Chunk(offsets, chunk_sizes), file, offset,
                       nbytes, str(checksum), None, tuple(blocks))


def _plain_ints(raw: Any, count: int | None) -> tuple[int, ...] | None:
    """``raw`` as a tuple of integers in [0, 2^62) (``count`` of them; None: MAX_NDIM at most),
    or None."""
    if type(raw) is not list or len(raw) > MAX_NDIM or count not in (None, len(raw)):
        return None
    for d in raw:
        if type(d) is not int or not 0 <= d < MAX_INT:
            return None
    return tuple(raw)


def _chunk(c: Check, raw: dict[str, Any], shape: tuple[int, ...], what: str) -> Chunk:
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


def _check_kind(c: Check, kind: str, dtype: str, shape: tuple[int, ...], chunk: Chunk,
                what: str) -> None:
    """What a load turns the bytes into must be able to hold them (types.KINDS)."""
    if kind in ("numpy", "numpy_scalar") and dtype not in NUMPY_DTYPES:
        raise c.fail(f"{what}: kind {kind!r} cannot hold dtype {dtype} (numpy has no {dtype})")
    if kind in BYTE_KINDS and (dtype != "uint8" or len(shape) != 1):
        raise c.fail(f"{what}: kind {kind!r} is stored as 1-D uint8, not {dtype} of shape {shape}")
    if kind == "numpy_scalar" and shape != ():
        raise c.fail(f"{what}: kind 'numpy_scalar' is stored with shape (), not {shape}")
    if kind != "tensor" and (chunk.flat or chunk != Chunk.whole(shape)):
        raise c.fail(f"{what}: a {kind!r} value is stored whole, not as chunk "
                     f"{chunk.offsets}+{chunk.sizes}")


def _alias(c: Check, raw: Any) -> tuple[str, str]:
    pair = c.list(raw, "alias")
    if len(pair) != 2:
        raise c.fail("an alias must be [key, target]")
    return c.str(pair[0], "alias key"), c.str(pair[1], "alias target")


def _check_shared_bytes(c: Check, tensors: tuple[TensorEntry, ...]) -> None:
    """No two entries claim the same bytes of a file (check.shared_bytes)."""
    pair = shared_bytes((t.file, t.offset, t.extent_nbytes, t.key) for t in tensors
                        if t.delta is None or t.delta.kind != "ref")
    if pair is not None:
        (file, _offset, _nbytes, a), (_file, start, size, b) = pair
        end = min(pair[0][1] + pair[0][2], start + size)
        raise c.fail(f"tensors {show(a)} and {show(b)} claim the same bytes [{start}, {end}) "
                     f"of data file {file}")


def _is_piece(c: Check, meta: object, world_size: int) -> bool:
    """Whether the manifest is one rank's piece of a job's state (``meta.piece``: {"rank",
    "world_size"} of the job; a one-rank save of the memory tier with redundancy)."""
    piece = meta.get("piece") if isinstance(meta, dict) else None
    if piece is None:
        return False
    if not isinstance(piece, dict) or world_size != 1:
        raise c.fail("meta.piece must be {\"rank\": r, \"world_size\": w} in a one-rank manifest")
    rank = c.int(c.field(piece, "rank", "meta.piece"), "meta.piece rank")
    if not 0 <= rank < c.int(c.field(piece, "world_size", "meta.piece"), "meta.piece world_size"):
        raise c.fail(f"meta.piece: rank {rank} is not below its world_size")
    return True


def _check_tilings(c: Check, tensors: tuple[TensorEntry, ...], whole: bool) -> None:
    """Each key's global chunks tile its shape: every element in exactly one chunk (a load
    fills the whole tensor; a shape larger than its chunks is refused before any allocation).
    A piece (not ``whole``) holds some of each tensor: its chunks hold no more elements than
    the shape (a load of a region they miss is refused, loading/read.py)."""
    chunks: dict[str, list[Chunk]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for t in tensors:
        if t.rank is None:
            chunks.setdefault(t.key, []).append(t.chunk)
            shapes[t.key] = t.shape
    for key, of_key in chunks.items():
        if not whole:
            held, total = sum(ch.numel for ch in of_key), 1
            for d in shapes[key]:
                total *= d
            if held > total:
                raise c.fail(f"tensor {show(key)}: its chunks hold {held} of the {total} "
                             "elements of its shape (chunks overlap)")
            continue
        problem = tiling_problem(of_key, shapes[key])
        if problem is not None:
            raise c.fail(f"tensor {show(key)}: {problem}")


def check_keys(manifest: Manifest, where: str) -> None:
    """The key rules a reader enforces (keys unique across tensors, objects and aliases; global
    or per-rank entries, no chunk twice; aliases to tensors; tree = keys), on a Manifest about
    to be written: a save must not commit what its own reader would refuse."""
    _check_keys(Check(where), manifest.tensors, manifest.objects, manifest.aliases, manifest.tree,
                tuple(r.key for r in manifest.regular))


_KEY_FIELDS = operator.attrgetter("key", "rank", "chunk", "kind", "dtype", "shape")
_OBJECT_KEY_FIELDS = operator.attrgetter("key", "rank")


class KeysPassed:
    """check_keys with a memory of one: the key inputs of the last manifest that passed, owned
    by whoever saves a run of manifests (a save group's plan memory, collective.Memory). Keys
    laid out as in that one (a save whose plan was reused) are not walked again."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: tuple[Any, ...] | None = None  # _key_inputs of the last manifest passed

    def check(self, manifest: Manifest, where: str) -> None:
        """check_keys(manifest, where), unless its key inputs equal the last ones passed."""
        inputs = _key_inputs(manifest)
        if inputs is not None and inputs == self._last:
            return
        check_keys(manifest, where)
        self._last = inputs


def _key_inputs(m: Manifest) -> tuple[Any, ...] | None:
    """All that _check_keys reads of ``m``, the tree as marshal's bytes (a copy no caller can
    change later; format 0 shares no objects, so equal trees give equal bytes whatever their
    reference counts); None for a tree marshal refuses (then it is checked every time)."""
    try:
        tree = marshal.dumps(m.tree, 0)
    except ValueError:
        return None
    return (tuple(map(_KEY_FIELDS, m.tensors)), tuple(map(_OBJECT_KEY_FIELDS, m.objects)),
            m.aliases, tree, tuple(r.key for r in m.regular))


def _check_keys(c: Check, tensors: tuple[TensorEntry, ...], objects: tuple[ObjectEntry, ...],
                aliases: tuple[tuple[str, str], ...], tree: Any,
                regular_keys: tuple[str, ...] = ()) -> None:
    tensor_keys = [*_check_groups(c, tensors, "tensor"), *regular_keys]
    object_keys = _check_groups(c, objects, "object")
    alias_keys = [a for a, _ in aliases]
    all_keys = [*tensor_keys, *object_keys, *alias_keys]
    if len(set(all_keys)) != len(all_keys):
        raise c.fail("a key appears twice (as a tensor, object or alias)")
    if not {target for _, target in aliases} <= set(tensor_keys):
        raise c.fail("an alias points at a key that holds no tensor")
    if Counter(tree_keys(tree, c)) != Counter(all_keys):
        raise c.fail("the tree and the entries name different keys")


def _check_groups(c: Check, entries: tuple[Any, ...], what: str) -> dict[str, Any]:
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


def tree_keys(tree: Any, c: Check) -> list[str]:
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
        elif tag == "c" and isinstance(body, list) and len(body) == 2:
            why = containers.problem(body[0], body[1])
            if why is not None:
                raise c.fail(f"tree node {show(node)}: {why}")
            stack.append((body[1], depth))  # a container's type: not a level of nesting
        elif tag in ("l", "t") and isinstance(body, list):
            stack.extend((child, depth + 1) for child in reversed(body))
        elif tag == "d" and isinstance(body, list):
            stack.extend((child, depth + 1) for child in reversed(_dict_children(c, body)))
        else:
            raise c.fail(f"tree node with tag {show(tag)} and body {show(body)} has an unknown "
                         "tag or a malformed body")
    return out


def _dict_children(c: Check, items: list[Any]) -> list[Any]:
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
