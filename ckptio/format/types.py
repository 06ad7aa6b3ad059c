"""Frozen dataclasses every layer shares: what is saved, where its bytes go, what is read back.

Owns: the vocabulary (items, extents, entries, read ranges, what a load reads), the torch-free
dtype table and which of those dtypes numpy has; ``show``, a bounded description of a manifest
value for error messages. ``Chunk`` is defined in geometry.py (grid.py uses it without this module).
Does not own: how these are computed (plan, layout, reshard) or stored (manifest, io).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ckptio.format.geometry import Chunk

if TYPE_CHECKING:
    from ckptio.format.grid import Grid

__all__ = [
    "DTYPE_ITEMSIZE",
    "BYTE_KINDS",
    "KINDS",
    "MAX_TREE_DEPTH",
    "NUMPY_DTYPES",
    "PICKLED_KINDS",
    "Chunk",
    "Delta",
    "FileInfo",
    "FileLayout",
    "IndexFile",
    "Json",
    "Manifest",
    "ObjectEntry",
    "Placement",
    "Read",
    "ReadRange",
    "RegularTensor",
    "Stored",
    "TensorEntry",
    "WriteItem",
    "Written",
    "show",
]

# name -> bytes per element. The manifest stores these names; readers need no torch to size data.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
}

# The deepest tree of containers a manifest holds: flatten refuses deeper state on save, and
# validate refuses a deeper tree on load.
MAX_TREE_DEPTH = 256

# How a stored byte range is turned back into a Python value on load. "torch_save": the bytes of
# torch.save(value) (a DCP BYTE_IO item, kept verbatim), decoded by torch.load(weights_only=True).
# "bytesio": the content of an io.BytesIO (loaded as a new BytesIO at position 0).
# "torch_pickle": such bytes that need torch.load(weights_only=False) (an object the allow-list
# refuses or ckptio cannot hold inline; in-memory manifests only), loaded only with allow_pickle.
KINDS = ("tensor", "numpy", "numpy_scalar", "bytes", "bytearray", "bytesio", "pickle",
         "torch_save", "torch_pickle")
# The kinds whose entries are 1-D uint8 bytes.
BYTE_KINDS = ("bytes", "bytearray", "bytesio", "pickle", "torch_save", "torch_pickle")
PICKLED_KINDS = ("pickle", "torch_pickle")  # loaded only with allow_pickle

# The dtypes a "numpy" / "numpy_scalar" entry may have: those numpy itself has (not bfloat16,
# float8 or complex32, which Tensor.numpy() refuses).
NUMPY_DTYPES = frozenset(DTYPE_ITEMSIZE) - {
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "complex32"}

Json = Any  # a value json.dumps accepts


def show(value: Any) -> str:
    """A short description of a JSON value for an error message: never the repr of a whole
    (possibly huge or deeply nested) container."""
    if isinstance(value, list):
        return f"a list of {len(value)} item(s)"
    if isinstance(value, dict):
        return f"an object of {len(value)} field(s)"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


@dataclass(frozen=True)
class WriteItem:
    """One chunk of bytes this rank will write, before it has a place in a file."""

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    chunk: Chunk
    nbytes: int


@dataclass(frozen=True)
class Placement:
    """A WriteItem given its byte offset inside a data file."""

    item: WriteItem
    offset: int


@dataclass(frozen=True)
class FileLayout:
    """One data file: its name, padded size and the items it holds in offset order."""

    name: str
    nbytes: int
    placements: tuple[Placement, ...]


@dataclass(frozen=True)
class Stored:
    """Version 4: how a compressed entry's bytes lie in its file: ``nbytes`` bytes, the
    concatenation of independent frames (each of ``Manifest.block_nbytes`` logical bytes, the
    last one shorter), frame i ``frames[i]`` bytes long, encoded by ``codec`` (format/codec.py;
    a frame as long as its logical bytes is stored raw)."""

    codec: str
    nbytes: int
    frames: tuple[int, ...]


@dataclass(frozen=True)
class Delta:
    """Version 4: an entry whose logical bytes need the entry of the same key, chunk and rank in
    sibling checkpoint ``checkpoint``: ``"ref"``, they are that entry's bytes (``file``,
    ``offset`` and ``stored`` name its place there); ``"xor"``, the stored bytes here are their
    XOR with that entry's."""

    kind: str  # "ref" | "xor"
    checkpoint: str


@dataclass(frozen=True)
class TensorEntry:
    """A stored chunk, as the manifest records it."""

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    chunk: Chunk
    file: str
    offset: int
    nbytes: int
    checksum: str
    rank: int | None = None  # the rank whose own value this is; None: part of one global tensor
    blocks: tuple[str, ...] = ()  # checksums of each Manifest.block_nbytes of it, when larger
    # () : the bytes are the chunk's elements in row-major order (every manifest.json entry).
    # Else the tensor's dims in the order its bytes lie (those of t.permute(order).contiguous()):
    # a DCP or torch.save tensor saved transposed (in-memory manifests only; always the whole
    # tensor; read.py reads it whole and permutes it back)
    order: tuple[int, ...] = ()
    stored: Stored | None = None  # version 4: compressed (None: the logical bytes, raw)
    delta: Delta | None = None  # version 4: a reference to, or XOR with, a base checkpoint

    @property
    def coded(self) -> bool:
        """Whether reading the entry takes more than reading its bytes (decoding, a base)."""
        return self.stored is not None or self.delta is not None

    @property
    def extent_nbytes(self) -> int:
        """How many bytes of ``file`` from ``offset`` the entry occupies."""
        return self.stored.nbytes if self.stored is not None else self.nbytes

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The chunk's sizes in the order its bytes lie."""
        return tuple(self.chunk.sizes[d] for d in self.order) if self.order else self.chunk.sizes


@dataclass(frozen=True)
class ObjectEntry:
    """A Python leaf stored inline in the manifest as tagged JSON (see values.py)."""

    key: str
    value: Json
    rank: int | None = None  # the rank whose own value this is; None: the same on every rank


@dataclass(frozen=True)
class FileInfo:
    name: str
    nbytes: int
    rank: int


@dataclass(frozen=True)
class RegularTensor:
    """A tensor saved in a regular layout (version 3): its chunks follow from its grid
    (Manifest.grids, grid.py); where each chunk's bytes lie is in its writer's index file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    grid: int  # into Manifest.grids


@dataclass(frozen=True)
class IndexFile:
    """A rank's index file (version 3): the file, offset and checksums of every chunk of a
    RegularTensor that rank wrote, as packed columns (format/regular_section.py)."""

    rank: int
    name: str
    nbytes: int  # of its content (the file may be padded beyond)
    checksum: str


@dataclass(frozen=True)
class Written:
    """What one rank's save wrote, as it tells the coordinator: its manifest rows keyed by the
    index of each item in its plan (built once, where their bytes were written), its data
    files, and the index file of its regular items' chunks (if any)."""

    entries: Mapping[int, TensorEntry]
    files: tuple[FileInfo, ...]
    index: IndexFile | None = None


@dataclass(frozen=True)
class Manifest:
    """Everything about a checkpoint except the tensor bytes."""

    version: int
    save_id: str
    checksum_algorithm: str
    world_size: int
    files: tuple[FileInfo, ...]
    tensors: tuple[TensorEntry, ...]
    objects: tuple[ObjectEntry, ...]
    aliases: tuple[tuple[str, str], ...]  # (key, key of the entry whose tensor it shares)
    tree: Json
    meta: dict[str, Json]
    block_nbytes: int = 1 << 20  # granularity of TensorEntry.blocks (partial reads verify blocks)
    # version 3: tensors in a regular layout, described once each; their chunks' places are
    # in the writers' index files (loading/resolve_regular.py turns the chunks a load needs into
    # TensorEntry rows). Empty in a manifest of every chunk.
    grids: tuple[Grid, ...] = ()
    regular: tuple[RegularTensor, ...] = ()
    indexes: tuple[IndexFile, ...] = ()
    # version 4: the sibling checkpoints (step names) entries reference or XOR against
    bases: tuple[str, ...] = ()


E = TypeVar("E", covariant=True)  # a range of spans is a range of what they are


@dataclass(frozen=True)
class ReadRange(Generic[E]):
    """One aligned read of a data file and the extents whose bytes it covers (partly or wholly):
    stored entries, or the parts of them a load reads."""

    file: str
    offset: int
    nbytes: int
    entries: tuple[E, ...]


@dataclass(frozen=True, eq=False)
class Read:
    """What a load reads into one tensor: region ``region`` of global tensor ``key``, from the
    stored chunks ``entries`` that hold it, into ``dest`` (the stored dtype; shape
    ``region.sizes``, or 1-D for a flat region; None: read and verified only). The same layout
    is the one-piece case: one entry whose chunk is the region, read whole (``whole``)."""

    key: str
    entries: tuple[TensorEntry, ...]
    region: Chunk
    dest: Any = None  # torch.Tensor

    @staticmethod
    def of(entry: TensorEntry, dest: Any = None) -> Read:
        """The read of one whole stored entry."""
        return Read(entry.key, (entry,), entry.chunk, dest)

    @property
    def whole(self) -> TensorEntry | None:
        """The entry this read takes whole (its bytes are the region's, in order), or None."""
        if len(self.entries) == 1 and self.entries[0].chunk == self.region:
            return self.entries[0]
        return None
