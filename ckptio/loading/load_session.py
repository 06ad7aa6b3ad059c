"""One load (or verify) top to bottom, as saving/save_session.py owns one save.

    open      the store and file a path names (storage/select.py); the manifest of whatever
              format is there (opening.py), read through the borrowed pool and the store's files
              (a DCP directory's tensor items are opened by the read that needs them: dcpdir.py)
    resolve   a version-3 manifest's regular tensors: only the chunks the state needs, and
              their writers' index files (resolve_regular.py)
    expand    values a torch.save file or a DCP checkpoint keeps as pickles (torchvalues.py)
    fill      in place into the state's leaves (match, plan, read, put back), or a fresh
              state (fill.py), each region read in one coalesced, checksummed pass (read.py)

Every byte goes through the store's files (storage/files.StoreFiles) and the staging pool the
driver lends (storage/files.IOResources), under its lock. One Activity (io/stall.py) watches a
load's manifest read, opens and reads from start to end: a read storage does not answer for
Options.io_stall_warn_s is warned about on the ``ckptio`` logger, naming the rank and the file.

Owns: the order of one load's steps, the read functions over the borrowed staging (verified
or not), verify's pass over every byte. Does not own: the pool's lifetime (ckptio/resources.py),
the agreement between ranks (the driver: api.py with distributed/collective.py), any format.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptio.alignment import BLOCK
from ckptio.distributed.loadsteps import SharedManifest
from ckptio.distributed.readshare import Known, ReadPlace, ReadWith
from ckptio.errors import CkptError, PickleRefusedError, StateMismatchError, restated
from ckptio.format.checksum import stored_algorithm
from ckptio.format.flatten import flatten
from ckptio.format.types import Manifest, Read
from ckptio.io import stall
from ckptio.loading import dcpdir, foreign_common, opening, resolve_regular
from ckptio.loading import read as reading
from ckptio.loading.fill import fill_fresh, fill_in_place
from ckptio.loading.matching import AgreeFn, Rules
from ckptio.loading.opening import ReadFn
from ckptio.loading.stored import KeyFilter, RankPolicy, checked_keys, selector
from ckptio.loading.torchvalues import expand_torch_save
from ckptio.planning.layout import read_gap
from ckptio.storage.entry_reader import Bases, EntryReader
from ckptio.storage.files import IOResources, StoreFiles, in_memory
from ckptio.storage.select import store_for
from ckptio.storage.store_contract import Store

__all__ = ["VERIFY_BATCH_NBYTES", "LoadRequest", "Opened", "load", "open_checkpoint", "read_fn", "verify"]

VERIFY_BATCH_NBYTES = 64 << 20  # verify with a progress callback reports after each batch


@dataclass(frozen=True)
class Opened:
    """A checkpoint as a load sees it: its store, the file in it (a torch.save or
    safetensors file) or None, and its manifest."""

    store: Store
    file: str | None
    record: Manifest


SharedReadFn = Callable[[list[Read], ReadWith, ReadPlace], int]


@dataclass(frozen=True)
class LoadRequest:
    """What one load asks for (Checkpointer.load's arguments, resolved)."""

    strict: bool
    keys: KeyFilter
    cast: bool
    verify: bool
    allow_pickle: bool
    per_rank_from: RankPolicy
    rank: int
    world_size: int
    agree_unexpected: AgreeFn | None  # many ranks: the keys step (matching.py)
    # many ranks: the read step (distributed/readshare.py), in place of reading alone
    shared_reads: SharedReadFn | None = None
    # many ranks: the manifest read by one rank, handed to the others (loadsteps.py)
    shared_manifest: SharedManifest | None = None
    # the checkpoint's manifest as the caller opened it for this load (not read again)
    record: Manifest | None = None

    def __post_init__(self) -> None:  # keys= checked once, an iterator's names kept
        object.__setattr__(self, "keys", checked_keys(self.keys))

    def rules(self) -> Rules:
        """The key rules of an in-place load (matching.py)."""
        return Rules(self.keys, self.strict, self.cast, self.rank, self.world_size,
                     self.per_rank_from, self.agree_unexpected)


def read_fn(resources: IOResources, store: Store, record: Manifest | None = None, *,
            verify: bool = False, probe: bool = False,
            activity: stall.Activity | None = None) -> ReadWith:
    """Fill Reads through ``staging``'s pool and ``store``'s files, under its lock: checked
    against ``record``'s checksums when ``verify``, else plain (the caller checks what it
    reads; a foreign checkpoint's "block" is its whole entry). The DCP items of ``record``
    that the reads need and that are not opened yet are opened first (dcpdir.resolve_reads).
    ``probe``: the reads open a foreign format (its metadata, a DCP item's head and tail), and
    read through no gap on a local file system (layout.read_gap). ``activity``: the load's,
    watching every open and read (None: each call watched on its own)."""
    algorithm = stored_algorithm(record.checksum_algorithm) if verify and record else None
    if record is None:  # reading a foreign format's own metadata
        block_nbytes = foreign_common.BLOCK_NBYTES
    else:  # unverified, a partial read need not widen to whole checksum blocks
        block_nbytes = record.block_nbytes if algorithm else BLOCK

    bases = _bases(resources, store, record)
    opens = record is not None and dcpdir.has_pending(record)
    items = read_fn(resources, store, probe=True, activity=activity) if opens else None
    can = store.capabilities
    gap = read_gap(probe=probe, direct_io=can.direct_io, remote=can.remote)

    def read(reads: list[Read], known: Known | None = None) -> int:
        if items is not None:
            reads = dcpdir.resolve_reads(store, items, reads)
        with resources.lock, watching(resources, store, activity) as watch:
            # a pool made now is not pre-faulted: a buffer's pages fault in as the backend pins
            # it at its first read (resources.files), or by that read (docs/BENCH_RESTART.md)
            pool, files = resources.files(store, _staged_nbytes(reads), copy_faults=True,
                                          reading=True)
            files = files.watched(watch)
            with _entry_reader(files, record, algorithm, bases, resources) as coded:
                return reading.read_regions(files, reads, pool=pool, algorithm=algorithm,
                                            block_nbytes=block_nbytes, depth=resources.io_depth,
                                            coded=coded, known=known, max_gap=gap)

    return read


@contextlib.contextmanager
def watching(resources: IOResources, store: Store, activity: stall.Activity | None = None,
             rank: int | None = None) -> Iterator[stall.Activity]:
    """``activity``, or a load's own Activity on ``store`` watched until the block ends
    (``rank``: the one its warnings name; None: this process's rank, or 0 without peers)."""
    if activity is not None:
        yield activity
        return
    own = stall.watched(store.location, _rank() if rank is None else rank,
                        resources.options.io_stall_warn_s, load=True)
    try:
        yield own
    finally:
        own.finish()


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _staged_nbytes(reads: list[Read]) -> int:
    """The stored bytes of the entries ``reads`` touch, each once: no read of them stages more,
    so a small state's load gets a pool of that size (resources.py)."""
    return sum({id(e): e.extent_nbytes for r in reads for e in r.entries}.values())


def _bases(resources: IOResources, store: Store, record: Manifest | None) -> Bases | None:
    """The base checkpoints of a delta (version 4), opened on first use."""
    if record is None or not any(t.coded for t in record.tensors):
        return None
    return Bases(store.location, lambda where: store_for(where, resources.options),
                 block_nbytes=record.block_nbytes)


def _entry_reader(files: StoreFiles, record: Manifest | None, algorithm: str | None,
                  bases: Bases | None,
                  resources: IOResources) -> contextlib.AbstractContextManager[EntryReader | None]:
    """A reader of ``record``'s compressed and delta entries (version 4), if it has any,
    decoding on Options.compress_threads threads."""
    if record is None or not any(t.coded for t in record.tensors):
        return contextlib.nullcontext()
    return EntryReader(files, block_nbytes=record.block_nbytes, algorithm=algorithm, bases=bases,
                       threads=resources.options.compress_threads)


def _open_items(resources: IOResources, store: Store, record: Manifest,
                reads: Sequence[Read], activity: stall.Activity | None = None) -> list[Read]:
    """``reads`` with the DCP items of ``record`` they need opened now (dcpdir.resolve_reads);
    reads of anything else as they are."""
    if not dcpdir.has_pending(record):
        return list(reads)
    probe = read_fn(resources, store, probe=True, activity=activity)
    return dcpdir.resolve_reads(store, probe, reads)


def open_checkpoint(resources: IOResources, store: Store, file: str | None, *, allow_pickle: bool,
                    every_chunk: bool = True, every_item: bool = True,
                    shared: SharedManifest | None = None,
                    activity: stall.Activity | None = None) -> Opened:
    """The manifest of the checkpoint in ``store`` (or of its ``file``), whatever its format.
    ``every_chunk``: a row for every chunk of its regular tensors too (their index files
    read); else a load resolves the ones it needs. ``every_item``: a DCP directory's tensor
    items opened (heads read and checked); else each read opens those it needs (dcpdir.py).
    ``shared``: with peers, a committed manifest read by one rank (skipped for a ``file``).
    ``activity``: the load's (read_fn), watching the manifest's read too."""
    with watching(resources, store, activity) as watch:
        plain = read_fn(resources, store, activity=watch)
        if shared is not None and file is not None:
            shared.skip()
            shared = None
        probe = read_fn(resources, store, probe=True, activity=watch)  # a foreign format's framing
        record = opening.open_manifest(store, file, probe, allow_pickle=allow_pickle,
                                       every_item=every_item, shared=shared, activity=watch)
        if every_chunk:
            record = resolve_regular.expand_all(record, plain)
    return Opened(store, file, record)


def load(resources: IOResources, store: Store, file: str | None, state: Any,
         request: LoadRequest) -> Any:
    """Load the checkpoint into ``state`` in place (-> LoadReport), or a fresh state (None);
    its I/O watched from start to end (io/stall.py). (One frame from fill_in_place to the
    caller: its warnings' stacklevel counts them.)"""
    with watching(resources, store, rank=request.rank) as activity:
        try:
            # one rank opens a DCP directory's items at the open (a 1-rank load needs them
            # all, and opening them later was slower: docs/BENCH_INTEROP.md, "each rank opens
            # only the items it needs"); a rank of many opens those its reads need (dcpdir.py)
            opened = _opened(resources, store, file, request, activity)
        except PickleRefusedError:
            if file is None or not request.allow_pickle:
                raise
            return _trusted_torch_load(store, file, state, activity)
        record, plain = opened.record, read_fn(resources, store, activity=activity)
        _check_piece(record, store.location)
        _stage_early(resources, store, record, request)
        read = read_fn(resources, store, record, verify=request.verify, activity=activity)
        record = expand_torch_save(record, read, where=store.location,
                                   allow_pickle=request.allow_pickle)
        select = selector(request.keys)
        if state is None:  # whole tensors: every chunk of the regular keys asked for
            record = resolve_regular.expand(record, {r.key: None for r in record.regular
                                                     if select(r.key)}, plain)
            return fill_fresh(record, _shared(read, resources, store, record, request, activity),
                              keys=request.keys, strict=request.strict,
                              allow_pickle=request.allow_pickle, rank=request.rank,
                              world_size=request.world_size, per_rank_from=request.per_rank_from)
        flat = flatten(state)
        if record.regular:  # only the chunks this state's regions need, and their index files
            record = resolve_regular.expand(
                record, resolve_regular.wanted_in_place(record, flat, select), plain)
        try:
            return fill_in_place(record, flat,
                                 _shared(read, resources, store, record, request, activity),
                                 request.rules(), allow_pickle=request.allow_pickle)
        except StateMismatchError as exc:  # which checkpoint (a restore names no path)
            raise restated(exc, f"{store.location}: ") from None


def _opened(resources: IOResources, store: Store, file: str | None, request: LoadRequest,
            activity: stall.Activity) -> Opened:
    """The checkpoint as ``request`` has it (its manifest not read again: with peers, this
    rank still takes its part in the manifest step), else as ``open_checkpoint`` opens it."""
    if request.record is None:
        return open_checkpoint(resources, store, file, allow_pickle=request.allow_pickle,
                               every_chunk=False, every_item=request.world_size == 1,
                               shared=request.shared_manifest, activity=activity)
    if request.shared_manifest is not None:
        request.shared_manifest.held()
    return Opened(store, file, request.record)


def _shared(read: ReadWith, resources: IOResources, store: Store, record: Manifest,
            request: LoadRequest, activity: stall.Activity) -> ReadFn:
    """``read``, or with peers the read step that shares the entries several ranks want whole
    between them (in place: replicated tensors; fresh: every entry the load reads) (a
    DCP directory's items opened first: what is shared is named by where its data lies and
    checked against its CRC-32)."""
    step = request.shared_reads
    if step is None:
        return read
    place = ReadPlace(store.location, record.checksum_algorithm, record.block_nbytes,
                      request.verify, in_memory(store), store.path_of)
    return lambda reads: step(_open_items(resources, store, record, reads, activity), read, place)


def _check_piece(record: Manifest, where: str) -> None:
    """A piece of a job's state (``meta.piece``: a one-rank step of a tier with redundancy)
    that misses part of a tensor (other ranks hold it) loads only into the rank that saved
    it, in a job of as many ranks: refused otherwise, before anything is read. (A piece of
    whole tensors, a rank's own plain state, loads anywhere.)"""
    piece = record.meta.get("piece")
    if not isinstance(piece, dict):
        return
    held: dict[str, int] = {}
    for t in record.tensors:
        if t.rank is None:
            held[t.key] = held.get(t.key, 0) + t.chunk.numel
    shapes = {t.key: t.shape for t in record.tensors}
    if all(n >= math.prod(shapes[key]) for key, n in held.items()):
        return
    dist = torch.distributed
    on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    if (rank, world) != (piece.get("rank"), piece.get("world_size")):
        raise StateMismatchError(
            f"{where}: rank {piece.get('rank')}'s piece of a {piece.get('world_size')}-rank "
            f"job's state (a tier with redundancy keeps each rank's own shards), and this is "
            f"rank {rank} of {world}: it loads only into that rank of a job of as many ranks, "
            "on the layout that saved it (CheckpointManager.restore does). A restart on "
            "another number of ranks cannot restore these tiers yet: restart with "
            f"{piece.get('world_size')} ranks")


def _stage_early(resources: IOResources, store: Store, record: Manifest, request: LoadRequest) -> None:
    """Make the pool a one-rank load of ``record``'s plain entries stages through now, sized to
    the stored bytes of the keys it asks for, so that its background pre-fault runs while the
    load plans its reads (before, a fresh process's load planned first and made its pool after:
    docs/BENCH_LIMIT.md, "the cold small load"). The reads then find it large enough. Only
    where those bytes fit in the buffers one load keeps in flight (2 x io_depth): a larger
    load cycles through them, and pre-faulting the whole pool beside its reads slowed it more
    than the pinning of each buffer at its first read (docs/BENCH_RESTART.md). Not for many
    ranks (each reads a part) nor for regular or version-4 entries (what those stage is known
    only once resolved), nor for a store in memory (a memory tier's): its whole entries are read
    straight into their tensors (direct_reads.py), and a pool faulting in beside the restore
    slowed it; what does stage there gets a pool at the read, faulted by its copies."""
    if (request.world_size != 1 or record.regular or in_memory(store)
            or any(t.coded or t.order for t in record.tensors)):
        return
    select = selector(request.keys)
    nbytes = sum(t.extent_nbytes for t in record.tensors if select(t.key))
    if 0 < nbytes <= 2 * resources.io_depth * resources.options.buffer_bytes:
        with resources.lock:
            resources.files(store, nbytes, reading=True)


def _trusted_torch_load(store: Store, file: str, state: Any, activity: stall.Activity) -> Any:
    """A torch.save file holding objects beyond training state, with allow_pickle and no
    state: what torch.load returns (its pickle runs: the caller trusts the file), its read
    watched by the load's ``activity``."""
    if state is not None:
        raise CkptError(
            f"{store.path_of(file)}: a torch.save file holding Python objects beyond plain "
            "training state loads only fresh with allow_pickle=True (ckptio.load(path, "
            "allow_pickle=True) returns torch.load(path, weights_only=False)), not in place"
        ) from None
    with activity.call("read", store.path_of(file)):
        raw = store.read_file(file)
    return torch.load(io.BytesIO(raw), weights_only=False, map_location="cpu")


def verify(resources: IOResources, opened: Opened,
           progress: Callable[[int], None] | None = None) -> int:
    """Read every stored byte of ``opened`` and check it against its checksum and its block
    checksums (``progress``: called with the bytes of each batch); -> bytes read."""
    record = opened.record
    reads = [Read.of(e) for e in record.tensors]
    reads = _open_items(resources, opened.store, record, reads)  # a manifest a load opened
    algorithm = stored_algorithm(record.checksum_algorithm)
    bases = _bases(resources, opened.store, record)
    nbytes = 0
    with resources.lock, watching(resources, opened.store) as activity:
        pool, files = resources.files(opened.store)
        files = files.watched(activity)
        with _entry_reader(files, record, algorithm, bases, resources) as coded:
            for batch in _batches(reads, VERIFY_BATCH_NBYTES) if progress else [reads]:
                done = reading.read_regions(files, batch, pool=pool, algorithm=algorithm,
                                            depth=resources.io_depth,
                                            block_nbytes=record.block_nbytes,
                                            check_blocks=True, coded=coded)
                nbytes += done
                if progress is not None:
                    progress(done)
    return nbytes


def _batches(reads: Sequence[Read], nbytes: int) -> list[list[Read]]:
    """``reads`` in order, cut into batches of about ``nbytes`` (whole entries each)."""
    out: list[list[Read]] = [[]]
    size = 0
    for read in reads:
        if out[-1] and size + read.entries[0].nbytes > nbytes:
            out.append([])
            size = 0
        out[-1].append(read)
        size += read.entries[0].nbytes
    return out
