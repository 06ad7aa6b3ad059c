"""A torch_checkpointing checkpoint directory, seen as a ckptio Manifest.

Meta's torch_checkpointing writes one ``torch.save`` file per item and rank,
``<item>_<rank>.pt`` (its default layout), and with a resharder a ``metadata.pkl`` (a pickle
of plain dicts: the world size, each item's DTensor specs and per-rank layouts). ckptio reads
such a directory as one checkpoint: each rank's file is opened as a torch.save file
(loading/torchsave_manifest.py: three rounds of reads, its records' CRC-32s, the allow-list
unpickler), its keys put under the item's name; a DTensor's shard becomes its chunk of the
global tensor (its replicas kept once), so a load fills any layout (one process, another
rank count, another mesh); a plain tensor or value of a many-rank checkpoint is its rank's
own (``per_rank_from`` chooses, as for any per-rank value), unless it is the same on every
rank (a value equal, a tensor of one dtype, shape and CRC-32): then it is one value. 0.1.1
keeps no checksum file: each record's CRC-32 is what a read checks.

Call order: ``holds_tc`` (opening.py's dispatch) -> ``open_tc`` -> the load path reads the
entries like any checkpoint's (read.py, fill.py). Refused, with a CkptError naming the file:
a directory still under its save's temporary name (``tmp_NAME``: not committed) or holding
``MOVING_NAME`` (a commit through ckptio/tc_storage.py cut short on an object store), a rank's
file missing, ranks whose keys differ, a ``metadata.pkl`` naming any Python global (it never
does) or a custom layout, and whatever torchsave_manifest.py refuses.

Owns: detecting the directory, its metadata check and the merged Manifest. Does not own: the
zip and pickle parsing (format/), reading bytes (read.py), matching keys (matching.py).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, TypeVar

from ckptio.errors import (CheckpointNotFoundError, CkptError, CorruptCheckpointError,
                           PickleRefusedError, UnsupportedStateError)
from ckptio.format import keyrules, validate
from ckptio.format.allowlist import NO_ALLOW_PICKLE, PICKLE_ERRORS, AllowListUnpickler
from ckptio.format.types import FileInfo, Json, Manifest, ObjectEntry, TensorEntry, show
from ckptio.loading.foreign_common import BLOCK_NBYTES, ReadFn, read_small
from ckptio.loading.torchsave_manifest import Archive, Walk, read_archive
from ckptio.storage.store_contract import Store, TreeStore

__all__ = ["METADATA_NAME", "MOVING_BODY", "MOVING_NAME", "holds_tc", "open_tc", "rank_files"]

METADATA_NAME = "metadata.pkl"
TEMP_PREFIX = "tmp_"  # its CheckpointWriterConfig.temp_dir_prefix, by default
# Where a commit copies object by object (tc_storage.py on an object store): written into the
# temporary directory first, so copied first (its name sorts before any item's), removed from
# the final one once every object is there.
MOVING_NAME = ".ckptio-moving"
MOVING_BODY = (b"ckptio: a torch_checkpointing commit copying this checkpoint object by object; "
               b"removed once every object is copied\n")
_MAX_METADATA_NBYTES = 1 << 28
_RANK_FILE = re.compile(r"(?P<item>.+)_(?P<rank>0|[1-9][0-9]{0,5})\.pt")


def rank_files(store: Store) -> dict[str, dict[int, str]]:
    """Item -> rank -> file name, for every ``<item>_<rank>.pt`` directly in ``store``."""
    out: dict[str, dict[int, str]] = {}
    if not isinstance(store, TreeStore):
        return out
    for name in store.entries():
        found = _RANK_FILE.fullmatch(name)
        if found is not None:
            out.setdefault(found["item"], {})[int(found["rank"])] = name
    return out


def holds_tc(store: Store) -> bool:
    """Whether ``store`` holds a torch_checkpointing checkpoint (a ``metadata.pkl`` or an
    ``<item>_0.pt``)."""
    if store.sizes([METADATA_NAME]):
        return True
    return any(0 in ranks for ranks in rank_files(store).values())


def open_tc(store: Store, read: ReadFn) -> Manifest:
    """The Manifest of the torch_checkpointing checkpoint in ``store``."""
    where = store.location
    _check_committed(where)
    _check_copied(store)
    files = rank_files(store)
    world = _world(store, read, files, where)
    tensors: list[TensorEntry] = []
    objects: list[ObjectEntry] = []
    aliases: list[tuple[str, str]] = []
    infos: list[FileInfo] = []
    tree: list[list[Json]] = []
    for item in sorted(files):
        trees: list[Json] = []
        item_objects: list[ObjectEntry] = []
        item_tensors: list[TensorEntry] = []
        for rank in range(world):
            archive = _archive(store, files[item][rank], read)
            walk = Walk(archive, rank=None if world == 1 else rank, sharded=world > 1)
            trees.append(walk.expand(archive.obj, item, 1))
            walk.settle(read)
            if trees[-1] != trees[0]:
                raise UnsupportedStateError(
                    f"{archive.where}: rank {rank}'s {item!r} holds other keys than rank 0's "
                    f"({store.path_of(files[item][0])}); ckptio reads a torch_checkpointing "
                    "item whose ranks hold the same keys; load it with torch_checkpointing")
            item_tensors += walk.tensors
            item_objects += walk.objects
            aliases += walk.aliases if rank == 0 or world == 1 else []
            infos.append(FileInfo(archive.name, archive.size, rank))
        objects += _same_once(item_objects, world)
        tensors += _same_once(item_tensors, world)
        tree.append([item, trees[0]])
    manifest = Manifest(
        version=2, save_id="torch_checkpointing", checksum_algorithm="crc32", world_size=world,
        files=tuple(infos), tensors=tuple(tensors), objects=tuple(objects),
        aliases=tuple(aliases), tree={"d": tree}, meta={"torch_checkpointing": {
            "items": sorted(files), "metadata": bool(store.sizes([METADATA_NAME]))}},
        block_nbytes=BLOCK_NBYTES)
    keyrules.check_keys(manifest, where)
    validate.check_values(manifest, where)
    return manifest


def _archive(store: Store, name: str, read: ReadFn) -> Archive:
    """Rank file ``name`` opened; a refused pickle global said with the fix that applies here:
    allow_pickle does not reach the files of a torch_checkpointing directory."""
    try:
        return read_archive(store, name, read)
    except PickleRefusedError as exc:
        said = str(exc).split(" For a file you trust", 1)[0]
        raise PickleRefusedError(
            f"{said} ckptio decodes every file of a torch_checkpointing checkpoint with the "
            f"allow-list ({NO_ALLOW_PICKLE}); for files you trust, load "
            "it with torch_checkpointing's CheckpointManager.load, or a file with "
            f"torch.load({store.path_of(name)!r}, weights_only=False)") from None


def _check_committed(where: str) -> None:
    """Refuse a directory named as torch_checkpointing's save names its checkpoint until every
    rank has written it (``tmp_NAME``, renamed to NAME at its commit): its files may be some
    ranks' or some items' only, and nothing in them says so."""
    name = where.rstrip("/").rsplit("/", 1)[-1]
    if name.startswith(TEMP_PREFIX) and len(name) > len(TEMP_PREFIX):
        final = name[len(TEMP_PREFIX):]
        raise CheckpointNotFoundError(
            f"{where}: a torch_checkpointing save writes its checkpoint under {name} and "
            f"renames it to {final} once every rank has written it, so this one is a save in "
            f"progress or one that died (it may lack a rank's or an item's files); load {final} "
            "once the save commits, or an earlier checkpoint; if you know every rank finished, "
            f"rename it to {final} first")


def _check_copied(store: Store) -> None:
    """Refuse a checkpoint whose commit copied it object by object and did not finish (its
    MOVING_NAME still there): it may lack any item's files, and nothing else says so."""
    if MOVING_NAME in store.sizes([MOVING_NAME]):
        where = store.location
        name = where.rstrip("/").rsplit("/", 1)[-1]
        raise CheckpointNotFoundError(
            f"{where}: its commit (ckptio.tc_storage on an object store copies each object of "
            f"{TEMP_PREFIX}{name} to {name}, then removes {MOVING_NAME}) did not finish, so it "
            "may lack an item's or a rank's files; load an earlier checkpoint, or save this "
            f"step again; if {TEMP_PREFIX}{name} is gone and you know every file was copied, "
            f"remove {store.path_of(MOVING_NAME)} first")


E = TypeVar("E", ObjectEntry, TensorEntry)


def _same_once(entries: list[E], world: int) -> list[E]:
    """Per-rank entries, each key the same on every rank kept once (rank None): a value equal
    on every rank, a tensor of the same dtype, shape and CRC-32 everywhere (AdamW's step,
    a replicated bias)."""
    if world == 1:
        return entries
    by_key: dict[str, list[E]] = {}
    out: list[E] = []
    for e in entries:
        if e.rank is None:
            out.append(e)
        else:
            by_key.setdefault(e.key, []).append(e)
    for found in by_key.values():
        first = replace(found[0], rank=None)
        if len(found) == world and all(_as_shared(e, first) == first for e in found):
            out.append(first)
        else:
            out += found
    return out


def _as_shared(entry: ObjectEntry | TensorEntry,
               first: ObjectEntry | TensorEntry) -> ObjectEntry | TensorEntry:
    """``entry`` as the one shared entry ``first`` would be: no rank (a tensor's file and
    offset are its own rank's, so they are not compared)."""
    if isinstance(entry, TensorEntry) and isinstance(first, TensorEntry):
        return replace(entry, rank=None, file=first.file, offset=first.offset)
    return replace(entry, rank=None)


def _world(store: Store, read: ReadFn, files: dict[str, dict[int, str]], where: str) -> int:
    """The rank count, from metadata.pkl when there is one, else the files; every item's
    file of every rank present."""
    meta = _metadata(store, read, where)
    world = meta if meta is not None else 1 + max(
        (r for ranks in files.values() for r in ranks), default=-1)
    if not files:
        raise CorruptCheckpointError(f"{where}: a torch_checkpointing {METADATA_NAME} and no "
                                     "<item>_<rank>.pt file beside it; the checkpoint is "
                                     "incomplete")
    for item, ranks in sorted(files.items()):
        missing = [r for r in range(world) if r not in ranks]
        extra = [r for r in ranks if r >= world]
        if missing or extra:
            name = f"{item}_{(missing or extra)[0]}.pt"
            raise CorruptCheckpointError(
                f"{store.path_of(name)}: the torch_checkpointing checkpoint was saved by "
                f"{world} ranks, and rank {(missing or extra)[0]}'s file of item {item!r} is "
                f"{'missing' if missing else 'beyond them'}; the checkpoint is incomplete "
                "(copy every file of the directory)")
    return world


class _Unpickler(AllowListUnpickler):
    """metadata.pkl: dicts, lists, tuples, strings and numbers; no global, no persistent id."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(data, where, {}, lambda module, name: (
            f"{where} refers to the Python global {module}.{name}; torch_checkpointing's "
            "metadata holds plain dicts, lists, strings and numbers only (ckptio decodes it "
            "with an allow-list and runs nothing); refused, nothing was loaded"))

    def persistent_load(self, pid: Any) -> Any:
        raise PickleRefusedError(f"{self.where} holds a pickle persistent id, which "
                                 "torch_checkpointing's metadata never does; refused, nothing "
                                 "was loaded")


def _metadata(store: Store, read: ReadFn, where: str) -> int | None:
    """The world size metadata.pkl records (None: no metadata.pkl), its items' layouts the
    default one."""
    size = store.sizes([METADATA_NAME]).get(METADATA_NAME)
    if size is None:
        return None
    path = store.path_of(METADATA_NAME)
    data = read_small(read, METADATA_NAME, size, _MAX_METADATA_NBYTES, path)
    try:
        meta = _Unpickler(data, path).load()
    except CkptError:
        raise
    except PICKLE_ERRORS as exc:
        raise CorruptCheckpointError(f"{path} cannot be decoded ({type(exc).__name__}); the "
                                     "checkpoint's metadata is damaged") from None
    world = meta.get("world_size") if type(meta) is dict else None
    items = meta.get("metadata") if type(meta) is dict else None
    if type(world) is not int or world < 1 or type(items) is not dict:
        raise CorruptCheckpointError(f"{path} is not torch_checkpointing's metadata (no "
                                     "world_size and metadata); the file is damaged")
    for item, info in items.items():
        layouts = info.get("rank_to_layout_info") if type(info) is dict else None
        if type(layouts) is not dict or any(v is not None for v in layouts.values()):
            raise UnsupportedStateError(
                f"{path}: item {show(item)} was saved with a custom checkpoint "
                "layout (LayoutInfo), which ckptio does not read (only the default "
                "<item>_<rank>.pt files); load it with torch_checkpointing")
    return world
