"""The versioned on-disk manifest: encode, decode, validate. See docs/FORMAT.md.

Owns: the byte format of manifest.json (a header line with the body's length and CRC-32, then
the JSON body) and every check on what it claims: offsets, lengths, dtypes, file names, keys,
with bounds on every number. Pure: bytes in, Manifest out; no file access, no torch, no pickle.
"""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from typing import Any

from .errors import ManifestError
from .gcpause import paused
from .types import DTYPE_ITEMSIZE, KINDS, Chunk, FileInfo, Manifest, ObjectEntry, TensorEntry

MAGIC = "ckptio-manifest"
VERSION = 2  # 2: many ranks (chunks per key, per-rank entries, flat chunks, block checksums)
MANIFEST_NAME = "manifest.json"
_MAX_INT = 1 << 62
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
    """Parse and fully validate; ``where`` (the manifest path) goes into every error."""
    newline = data.find(b"\n")
    try:
        header = json.loads(data[:newline]) if newline > 0 else None
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        raise ManifestError(f"{where}: not a ckptio manifest (bad header line); the checkpoint "
                            "is damaged: load an earlier one")
    version = header.get("version")
    if version != VERSION:
        fix = ("load it with the ckptio that wrote it and save it again"
               if type(version) is int and version < VERSION else "upgrade ckptio")
        raise ManifestError(f"{where}: manifest version {version!r}; this ckptio reads version "
                            f"{VERSION}: {fix}")
    body = data[newline + 1:].rstrip(b"\n")
    if len(body) != header.get("body_nbytes") or zlib.crc32(body) != header.get("body_crc32"):
        raise ManifestError(f"{where}: manifest body is truncated or altered (length/CRC-32 "
                            "mismatch); the checkpoint is damaged: load an earlier one")
    try:
        with paused():
            raw = json.loads(body)
    except RecursionError:
        raise ManifestError(f"{where}: manifest body nests too deeply to be a ckptio manifest") from None
    except ValueError as exc:
        raise ManifestError(f"{where}: manifest body is not JSON ({exc})") from None
    with paused():
        return _validate(raw, where)


class _Check:
    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, what: str) -> ManifestError:
        return ManifestError(f"{self.where}: {what}; the checkpoint is damaged or was written "
                             "by something else: load an earlier one")

    def int(self, value: Any, what: str) -> int:
        if type(value) is not int or not 0 <= value < _MAX_INT:
            raise self.fail(f"{what} must be an integer in [0, 2^62), got {value!r:.60}")
        return value

    def str(self, value: Any, what: str) -> str:
        if not isinstance(value, str):
            raise self.fail(f"{what} must be a string, got {value!r:.60}")
        return value

    def list(self, value: Any, what: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(f"{what} must be a list")
        return value

    def field(self, obj: Any, name: str, what: str) -> Any:
        if not isinstance(obj, dict) or name not in obj:
            raise self.fail(f"{what} lacks field {name!r}")
        return obj[name]


def _validate(raw: Any, where: str) -> Manifest:
    c = _Check(where)
    if c.field(raw, "format", "manifest") != "ckptio" or c.field(raw, "version", "manifest") != VERSION:
        raise c.fail("format/version fields are wrong")
    files = tuple(_file(c, f) for f in c.list(c.field(raw, "files", "manifest"), "files"))
    sizes = {f.name: f.nbytes for f in files}
    if len(sizes) != len(files):
        raise c.fail("a data file is listed twice")
    world_size = c.int(c.field(raw, "world_size", "manifest"), "world_size")
    block_nbytes = c.int(c.field(raw, "block_nbytes", "manifest"), "block_nbytes")
    if block_nbytes < 1:
        raise c.fail("block_nbytes must be positive")
    tensors = tuple(_tensor(c, t, sizes, world_size, block_nbytes)
                    for t in c.list(c.field(raw, "tensors", "manifest"), "tensors"))
    objects = tuple(_object(c, o, world_size)
                    for o in c.list(c.field(raw, "objects", "manifest"), "objects"))
    aliases = tuple(_alias(c, a) for a in c.list(c.field(raw, "aliases", "manifest"), "aliases"))
    tree = c.field(raw, "tree", "manifest")
    _check_keys(c, tensors, objects, aliases, tree)
    meta = c.field(raw, "meta", "manifest")
    return Manifest(
        version=VERSION,
        save_id=c.str(c.field(raw, "save_id", "manifest"), "save_id"),
        checksum_algorithm=c.str(c.field(raw, "checksum_algorithm", "manifest"), "checksum_algorithm"),
        world_size=world_size, files=files, tensors=tensors, objects=objects, aliases=aliases,
        tree=tree, meta=meta if isinstance(meta, dict) else {}, block_nbytes=block_nbytes,
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
    return ObjectEntry(key, c.field(raw, "value", "object"),
                       _rank(c, raw, world_size, f"object {key!r}"))


def _file(c: _Check, raw: Any) -> FileInfo:
    name = c.str(c.field(raw, "name", "file"), "file name")
    if not _FILE_NAME.fullmatch(name) or name in (".", ".."):
        raise c.fail(f"data file name {name!r:.60} is not a plain file name")
    return FileInfo(name, c.int(c.field(raw, "nbytes", "file"), f"file {name} nbytes"),
                    c.int(c.field(raw, "rank", "file"), f"file {name} rank"))


def _tensor(c: _Check, raw: Any, sizes: dict[str, int], world_size: int, block_nbytes: int) -> TensorEntry:
    key = c.str(c.field(raw, "key", "tensor"), "tensor key")
    what = f"tensor {key!r}"
    kind, dtype = c.field(raw, "kind", what), c.field(raw, "dtype", what)
    if kind not in KINDS or dtype not in DTYPE_ITEMSIZE:
        raise c.fail(f"{what} has unknown kind {kind!r:.30} or dtype {dtype!r:.30}")
    shape = tuple(c.int(d, f"{what} shape") for d in c.list(c.field(raw, "shape", what), f"{what} shape"))
    chunk_raw = c.field(raw, "chunk", what)
    if not isinstance(chunk_raw, dict):
        raise c.fail(f"{what}: chunk must be an object")
    offsets = tuple(c.int(d, f"{what} chunk") for d in c.list(c.field(chunk_raw, "offsets", what), what))
    chunk_sizes = tuple(c.int(d, f"{what} chunk") for d in c.list(c.field(chunk_raw, "sizes", what), what))
    flat = chunk_raw.get("flat", False)
    if flat is not False and flat is not True:
        raise c.fail(f"{what}: chunk flag 'flat' must be true or false")
    chunk = Chunk(offsets, chunk_sizes, flat)
    if not chunk.fits(shape):
        raise c.fail(f"{what}: {'flat ' if flat else ''}chunk {offsets}+{chunk_sizes} does not "
                     f"fit shape {shape}")
    file = c.str(c.field(raw, "file", what), f"{what} file")
    offset = c.int(c.field(raw, "offset", what), f"{what} offset")
    nbytes = c.int(c.field(raw, "nbytes", what), f"{what} nbytes")
    if nbytes != chunk.numel * DTYPE_ITEMSIZE[dtype]:
        raise c.fail(f"{what}: nbytes {nbytes} != {chunk.numel} elements of {dtype}")
    if file not in sizes or offset + nbytes > sizes[file]:
        raise c.fail(f"{what}: bytes [{offset}, {offset + nbytes}) lie outside data file {file!r:.60}")
    checksum = _checksum(c, c.field(raw, "checksum", what), what)
    blocks = tuple(_checksum(c, b, what) for b in c.list(raw.get("blocks", []), f"{what} blocks"))
    if len(blocks) != (-(-nbytes // block_nbytes) if nbytes > block_nbytes else 0):
        raise c.fail(f"{what}: {len(blocks)} block checksums for {nbytes} bytes in blocks of "
                     f"{block_nbytes}")
    rank = _rank(c, raw, world_size, what)
    if rank is not None and (flat or chunk != Chunk.whole(shape)):
        raise c.fail(f"{what}: an entry of rank {rank}'s own value must hold the whole tensor")
    return TensorEntry(key, kind, dtype, shape, chunk, file, offset, nbytes, checksum, rank, blocks)


def _checksum(c: _Check, value: Any, what: str) -> str:
    checksum = c.str(value, f"{what} checksum")
    if not _CHECKSUM.fullmatch(checksum):
        raise c.fail(f"{what}: checksum {checksum!r:.40} is not 16 hex digits")
    return checksum


def _alias(c: _Check, raw: Any) -> tuple[str, str]:
    pair = c.list(raw, "alias")
    if len(pair) != 2:
        raise c.fail("an alias must be [key, target]")
    return c.str(pair[0], "alias key"), c.str(pair[1], "alias target")


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
                raise c.fail(f"tensor {e.key!r} stores the same chunk twice")
            chunks.add((e.key, e.chunk))
        if (head.rank is None) != (e.rank is None):
            raise c.fail(f"{what} {e.key!r} has both global and per-rank entries")
        if e.rank is not None:
            if (e.key, e.rank) in ranks:
                raise c.fail(f"{what} {e.key!r} has two entries of rank {e.rank}")
            ranks.add((e.key, e.rank))
        elif e is not head and (what == "object" or (e.kind, e.dtype, e.shape) !=
                                (head.kind, head.dtype, head.shape)):
            raise c.fail(f"{what} {e.key!r} has global entries that disagree (a global object is "
                         "stored once; a tensor's chunks share kind, dtype and shape)")
    return first


MAX_TREE_DEPTH = 256


def tree_keys(tree: Any, c: _Check) -> list[str]:
    """Every leaf key of a tree, checking each node's shape (iteratively: hostile depth is an
    error, not a RecursionError)."""
    out: list[str] = []
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise c.fail(f"the tree nests deeper than {MAX_TREE_DEPTH} levels")
        if not isinstance(node, dict) or len(node) != 1:
            raise c.fail(f"tree node {node!r:.60} is not a one-field object")
        (tag, body), = node.items()
        if tag == "k" and isinstance(body, str):
            out.append(body)
        elif tag == "s":
            stack.append((body, depth + 1))
        elif tag in ("l", "t") and isinstance(body, list):
            stack.extend((child, depth + 1) for child in reversed(body))
        elif tag == "d" and isinstance(body, list):
            for pair in reversed(body):
                if not (isinstance(pair, list) and len(pair) == 2 and _dict_key(pair[0])):
                    raise c.fail(f"tree dict item {pair!r:.60} is not [str or int key, node]")
                stack.append((pair[1], depth + 1))
        else:
            raise c.fail(f"tree node {node!r:.60} has an unknown tag or a malformed body")
    return out


def _dict_key(key: Any) -> bool:
    return isinstance(key, str) or (type(key) is int)
