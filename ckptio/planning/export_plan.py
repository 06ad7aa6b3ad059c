"""The plan of a Hugging Face safetensors export: which keys, their names, files, offsets, the
windows each file is written in, and which rank writes which file. Pure: dataclasses in and
out, no I/O, no torch.

* ``select``: the manifest's tensor keys under a prefix (stripped), renamed by a callable
  (returning None drops a key). Alias keys whose target is exported are dropped: Hugging Face
  ties weights itself and safetensors refuses shared storages. Per-rank tensors, inline values
  and other entry kinds under the prefix that the rename does not drop are refused. ``dtype``
  converts floating tensors.
* ``plan_files``: files filled greedily in manifest order up to ``max_shard_bytes``; inside a
  file tensors are ordered by itemsize (largest first), then name, and the header is padded so
  the data starts at ``align``: every tensor then starts at a multiple of its itemsize.
* ``windows``: a file cut into ``window_bytes`` windows (multiples of ``align``), each with the
  flat element ranges of the tensors it covers; boundaries always fall between elements.
* ``assign``: files to ranks by bytes, largest first (LPT).

Owns: that arithmetic and the refusals. Does not own: reading (loading/read.py), writing and
committing (ckptio/export.py), the header bytes (format/safetensors.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ckptio.errors import CkptError
from ckptio.format import safetensors as st
from ckptio.format.types import DTYPE_ITEMSIZE, Manifest, TensorEntry

__all__ = [
    "FLOATING",
    "ExportFile",
    "ExportPlan",
    "ExportTensor",
    "Part",
    "Source",
    "Window",
    "assign",
    "plan_export",
    "plan_files",
    "select",
    "windows",
]

Rename = Callable[[str], "str | None"]
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})


@dataclass(frozen=True)
class Source:
    """One tensor to export: saved ``key`` (its stored ``entries``) as output ``name``."""

    key: str
    name: str
    dtype: str  # as saved
    out_dtype: str  # as exported
    shape: tuple[int, ...]
    entries: tuple[TensorEntry, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def out_nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.out_dtype]


@dataclass(frozen=True)
class ExportTensor:
    source: Source
    offset: int  # absolute byte offset of its data in the output file

    @property
    def end(self) -> int:
        return self.offset + self.source.out_nbytes


@dataclass(frozen=True)
class ExportFile:
    name: str
    header: bytes  # length prefix + padded JSON: the file's first bytes
    nbytes: int  # the exact file size
    tensors: tuple[ExportTensor, ...]


@dataclass(frozen=True)
class ExportPlan:
    files: tuple[ExportFile, ...]
    weight_map: dict[str, str]
    total_size: int  # data bytes of every tensor (the index's metadata.total_size)
    total_parameters: int
    dropped: tuple[str, ...]  # alias keys left out (tied weights)


@dataclass(frozen=True)
class Part:
    """Elements [start, start + count) of ``tensor`` (flattened), at byte ``at`` of a window."""

    tensor: ExportTensor
    start: int
    count: int
    at: int


@dataclass(frozen=True)
class Window:
    """Bytes [offset, offset + nbytes) of an output file; ``header`` bytes of it come first."""

    offset: int
    nbytes: int
    parts: tuple[Part, ...]


def select(record: Manifest, keys: str | None, rename: Rename | None,
           dtype: str | None) -> tuple[list[Source], list[str]]:
    """The tensors to export, in manifest order, and the alias keys dropped."""
    prefix = keys or ""
    if dtype is not None and dtype not in FLOATING:
        raise CkptError(f"export dtype={dtype!r}: only a floating dtype ({sorted(FLOATING)}) "
                        "converts floating tensors")
    entries: dict[str, list[TensorEntry]] = {}
    for entry in record.tensors:
        entries.setdefault(entry.key, []).append(entry)
    for obj in record.objects:  # rename decides first: a value renamed to None is left out
        if obj.key.startswith(prefix) and _name(obj.key[len(prefix):], rename, obj.key):
            raise CkptError(f"key {obj.key!r} is a Python value, not a tensor; safetensors holds "
                            "tensors only: choose keys= so it is left out, or rename it to None")
    sources: list[Source] = []
    names: dict[str, str] = {}

    def add(key: str, found: Sequence[TensorEntry]) -> None:
        name = _name(key[len(prefix):], rename, key)
        if name is None:
            return
        if name in names:
            raise CkptError(f"keys {names[name]!r} and {key!r} are both exported as {name!r}; "
                            "make rename= give them different names")
        names[name] = key
        sources.append(_source(key, name, found, dtype))

    for key, found in entries.items():
        if key.startswith(prefix):
            add(key, found)
    exported = set(names.values())
    dropped: list[str] = []
    for alias, target in record.aliases:
        if alias.startswith(prefix):
            if target in exported:
                dropped.append(alias)  # tied to an exported tensor: HF ties it again
            else:
                add(alias, entries.get(target, []))
    if not sources:
        raise CkptError(f"no tensor key starts with {prefix!r} (the keys= prefix, --keys): nothing to export; the "
                        f"checkpoint's keys begin {sorted(entries)[:5]}")
    return sources, dropped


def _name(stripped: str, rename: Rename | None, key: str) -> str | None:
    name = rename(stripped) if rename is not None else stripped
    if name is not None and (not isinstance(name, str) or not name or name == "__metadata__"):
        raise CkptError(f"key {key!r} is renamed to {name!r}; a safetensors name must be a "
                        "non-empty str other than '__metadata__'")
    return name


def _source(key: str, name: str, found: Sequence[TensorEntry], dtype: str | None) -> Source:
    head = found[0]
    if any(e.rank is not None for e in found):
        raise CkptError(f"key {key!r} was saved per rank (each rank's own value), not as one "
                        "tensor; export it by leaving it out (keys=, or rename to None)")
    if head.kind != "tensor":
        raise CkptError(f"key {key!r} was saved as {head.kind!r}, not a torch tensor; leave it out "
                        "(keys=, or rename to None)")
    out = dtype if dtype is not None and head.dtype in FLOATING else head.dtype
    if out not in st.DTYPES:
        raise CkptError(f"key {key!r} is {out}, which safetensors cannot hold; leave it out or "
                        "convert it before saving")
    return Source(key, name, head.dtype, out, head.shape, tuple(found))


def plan_files(sources: Sequence[Source], max_shard_bytes: int, align: int,
               metadata: dict[str, str] | None = None) -> tuple[ExportFile, ...]:
    """Greedy shards in order, each laid out (see the module docstring)."""
    if max_shard_bytes < 1:
        raise CkptError(f"max_shard_bytes={max_shard_bytes}: must be positive")
    groups: list[list[Source]] = [[]]
    size = 0
    for source in sources:
        if groups[-1] and size + source.out_nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(source)
        size += source.out_nbytes
    meta = {"format": "pt", **_checked(metadata or {})}
    return tuple(_lay_out(group, st.shard_name(i, len(groups)), align, meta)
                 for i, group in enumerate(groups))


def _checked(metadata: dict[str, str]) -> dict[str, str]:
    """``metadata`` if it is what safetensors holds (str to str) and keeps ``format: pt``."""
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CkptError(f"metadata {k!r}: {v!r}: safetensors metadata maps str to str; pass "
                            "str(value)")
        if k == "format" and v != "pt":
            raise CkptError(f"metadata format={v!r}: the format is always 'pt' (what transformers "
                            "checks); put yours under another key")
    return metadata


def _lay_out(group: list[Source], name: str, align: int, meta: dict[str, str]) -> ExportFile:
    ordered = sorted(group, key=lambda s: (-DTYPE_ITEMSIZE[s.out_dtype], s.name))
    described: list[st.STensor] = []
    at = 0
    for s in ordered:
        described.append(st.STensor(s.name, s.out_dtype, s.shape, at, at + s.out_nbytes))
        at += s.out_nbytes
    header = st.encode_header(described, meta, align)
    tensors = tuple(ExportTensor(s, len(header) + d.begin) for s, d in zip(ordered, described))
    return ExportFile(name, header, len(header) + at, tensors)


def plan_export(record: Manifest, *, keys: str | None, rename: Rename | None, dtype: str | None,
                max_shard_bytes: int, align: int,
                metadata: dict[str, str] | None = None) -> ExportPlan:
    sources, dropped = select(record, keys, rename, dtype)
    files = plan_files(sources, max_shard_bytes, align, metadata)
    weight_map = {t.source.name: f.name for f in files for t in f.tensors}
    return ExportPlan(files, weight_map, sum(s.out_nbytes for s in sources),
                      sum(s.numel for s in sources), tuple(dropped))


def windows(file: ExportFile, window_bytes: int) -> list[Window]:
    """``file`` as consecutive windows of ``window_bytes`` (the last one shorter)."""
    out: list[Window] = []
    i = 0
    for lo in range(0, file.nbytes, window_bytes):
        hi = min(lo + window_bytes, file.nbytes)
        while i < len(file.tensors) and file.tensors[i].end <= lo:
            i += 1
        parts = []
        j = i
        while j < len(file.tensors) and file.tensors[j].offset < hi:
            t = file.tensors[j]
            a, b = max(lo, t.offset), min(hi, t.end)
            if b > a:
                size = DTYPE_ITEMSIZE[t.source.out_dtype]
                parts.append(Part(t, (a - t.offset) // size, (b - a) // size, a - lo))
            j += 1
        out.append(Window(lo, hi - lo, tuple(parts)))
    return out


def assign(files: Sequence[ExportFile], nranks: int) -> list[list[int]]:
    """File indices per rank: largest file first to the least loaded rank (ties: lower rank)."""
    load = [0] * nranks
    out: list[list[int]] = [[] for _ in range(nranks)]
    for i in sorted(range(len(files)), key=lambda i: (-files[i].nbytes, i)):
        rank = min(range(nranks), key=lambda r: (load[r], r))
        out[rank].append(i)
        load[rank] += files[i].nbytes
    return [sorted(x) for x in out]
