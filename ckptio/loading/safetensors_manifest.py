"""A safetensors file, or a Hugging Face folder of them, seen as a ckptio Manifest.

``ckptio.load("model.safetensors", state)`` (a file), or a directory holding
``model.safetensors.index.json`` (its ``weight_map`` names the files) or a single
``model.safetensors``, come here. Each file's header is read (its first HEAD_NBYTES, and the
rest of a larger header in one more read) and validated by format/safetensors.py before any
data is read: a hostile or damaged header (bad JSON, overlapping or out-of-file offsets, a
huge claimed length, an unknown dtype) is a CorruptCheckpointError naming the file. Each tensor
becomes one whole-tensor entry at ``8 + N + begin``; safetensors carries no checksums, so the
algorithm is ``none`` and block checks are empty: a resharding load (DTensor, FSDP2, TP,
TensorShard) reads only the byte ranges of its own rows or boxes (BLOCK-aligned).

An index must agree with the files: every name it maps is in its file, every tensor of those
files is in the map, no name is in two files. A folder holding a ``model.safetensors`` that its
index does not name (two exports) is refused: from_pretrained would load the single file.

Owns: detecting the layout, the header reads, the synthesized Manifest. Does not own: header
parsing (format/safetensors.py), reading data (read.py), matching keys (matching.py).
"""

from __future__ import annotations

from collections.abc import Callable

from ckptio.alignment import BLOCK
from ckptio.errors import CorruptCheckpointError
from ckptio.format import safetensors as st
from ckptio.format import keyrules
from ckptio.format.checksum import NO_CHECKSUM
from ckptio.format.types import Chunk, FileInfo, Manifest, Read, TensorEntry
from ckptio.loading.foreign_common import raw_read, read_bytes, read_small
from ckptio.storage.store_contract import Store

__all__ = ["BLOCK_NBYTES", "HEAD_NBYTES", "holds_hf", "is_safetensors_name", "open_safetensors"]

ReadFn = Callable[[list[Read]], int]  # raw reads through the store's backend, unverified
BLOCK_NBYTES = BLOCK  # no checksums to check: a partial read is widened to BLOCK only
HEAD_NBYTES = 64 << 10


def holds_hf(store: Store) -> bool:
    """Whether ``store`` is a Hugging Face folder ckptio reads (an index or model.safetensors)."""
    return bool(store.sizes([st.INDEX_NAME, st.SINGLE_NAME]))


def is_safetensors_name(name: str) -> bool:
    """Whether a file given to load is read as safetensors (or as its folder, for the index)."""
    return name.endswith(".safetensors") or name == st.INDEX_NAME


def open_safetensors(store: Store, read: ReadFn, file: str | None = None) -> Manifest:
    """The Manifest of safetensors ``file`` in ``store``, or (None, or the index's name) of the
    Hugging Face folder ``store`` is (see the module docstring)."""
    names, weight_map = _files(store, read, file)
    sizes = store.sizes(names)
    for name in names:
        if name not in sizes:
            raise CorruptCheckpointError(
                f"{store.path_of(name)} is missing"
                + (f" (named by {st.INDEX_NAME})" if weight_map is not None else ""))
    heads = {n: raw_read(n, 0, min(sizes[n], HEAD_NBYTES)) for n in names}
    read(list(heads.values()))
    lengths = {n: st.header_nbytes(read_bytes(heads[n]), sizes[n], store.path_of(n))
               for n in names}
    longer = {n: raw_read(n, 0, st.PREFIX_NBYTES + lengths[n]) for n in names
              if st.PREFIX_NBYTES + lengths[n] > heads[n].dest.numel()}
    read(list(longer.values()))
    tensors: list[TensorEntry] = []
    meta: dict[str, dict[str, str]] = {}
    for n in names:
        raw = read_bytes(longer.get(n, heads[n]))[st.PREFIX_NBYTES:st.PREFIX_NBYTES + lengths[n]]
        described, metadata = st.decode_header(raw, sizes[n], store.path_of(n))
        meta[n] = metadata
        start = st.PREFIX_NBYTES + lengths[n]
        tensors += [TensorEntry(key=t.name, kind="tensor", dtype=t.dtype, shape=t.shape,
                                chunk=Chunk.whole(t.shape), file=n, offset=start + t.begin,
                                nbytes=t.end - t.begin, checksum="") for t in described]
    where = store.path_of(st.INDEX_NAME if weight_map is not None else names[0])
    _check_names(tensors, weight_map, where)
    manifest = Manifest(
        version=2, save_id="safetensors", checksum_algorithm=NO_CHECKSUM, world_size=1,
        files=tuple(FileInfo(n, sizes[n], 0) for n in names), tensors=tuple(tensors),
        objects=(), aliases=(), tree={"d": [[t.key, {"k": t.key}] for t in tensors]},
        meta={"safetensors": meta}, block_nbytes=BLOCK_NBYTES)
    keyrules.check_keys(manifest, where)
    return manifest


def _files(store: Store, read: ReadFn, file: str | None) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files to open, and the index's weight map (None: no index)."""
    if file is not None and file != st.INDEX_NAME:
        return [file], None
    found = store.sizes([st.INDEX_NAME, st.SINGLE_NAME])
    size = found.get(st.INDEX_NAME)
    if size is None:
        return [st.SINGLE_NAME], None
    where = store.path_of(st.INDEX_NAME)
    raw = read_small(read, st.INDEX_NAME, size, st.MAX_INDEX_NBYTES, where, "; it is not an index")
    weight_map = st.decode_index(raw, where)
    names = sorted(set(weight_map.values()))
    if file is None and st.SINGLE_NAME in found and st.SINGLE_NAME not in names:
        raise CorruptCheckpointError(
            f"{store.location} holds both {st.SINGLE_NAME} and {st.INDEX_NAME}, which names "
            f"other files: two exports in one folder (from_pretrained loads {st.SINGLE_NAME}), "
            "and which is current cannot be told. Move the stale one away, or load one by "
            f"name: ckptio.load('{store.path_of(st.SINGLE_NAME)}') or the index's path")
    return names, weight_map


def _check_names(tensors: list[TensorEntry], weight_map: dict[str, str] | None,
                 where: str) -> None:
    seen: dict[str, str] = {}
    for t in tensors:
        if t.key in seen:
            raise CorruptCheckpointError(f"{where}: tensor {t.key!r} is in both {seen[t.key]} and "
                                         f"{t.file}")
        seen[t.key] = t.file
    if weight_map is None:
        return
    for name, file in weight_map.items():
        if seen.get(name) != file:
            raise CorruptCheckpointError(
                f"{where} maps tensor {name!r} to {file}, which does not hold it; the folder is "
                "damaged or its files come from different exports")
    extra = [k for k in seen if k not in weight_map]
    if extra:
        raise CorruptCheckpointError(
            f"{where} does not name tensor(s) {extra[:5]} that {seen[extra[0]]} holds; the "
            "folder is damaged or its files come from different exports")
