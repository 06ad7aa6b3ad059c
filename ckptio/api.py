"""save / load as a handful of named steps, and the Checkpointer that owns reusable resources.

Owns: the order of steps and the lifetime of the staging pool and I/O backend (created on first
use, reused by every later save and load). The logic lives in the modules it calls.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptio import io, opening
from ckptio.distributed import collective
from ckptio.distributed.dist import Group, Solo, current_group, over_torch
from ckptio.errors import CkptError, PickleRefusedError
from ckptio.format.checksum import stored_algorithm
from ckptio.format.flatten import flatten
from ckptio.format.types import Manifest, Read
from ckptio.io.stage import BufferPool, available_host_bytes
from ckptio.loading import foreign, regular
from ckptio.loading.fill import (
    KeyFilter,
    LoadReport,
    RankPolicy,
    fill_fresh,
    fill_in_place,
    selector,
)
from ckptio.loading.read import read_regions
from ckptio.loading.torchvalues import expand_torch_save
from ckptio.options import BLOCK, GiB, Options
from ckptio.planning.layout import plan_files
from ckptio.planning.plan import PlanCache, build_plan
from ckptio.saving import session
from ckptio.saving.cleanup import Cleanup
from ckptio.saving.handle import SaveHandle, SaveResult
from ckptio.storage.base import Store
from ckptio.storage.local import LocalStore
from ckptio.storage.select import checkpoint_path, local_path, store_for
from ckptio.tuning.profile import io_fields, tuned_options

log = logging.getLogger("ckptio")
BLOCK_CHECKSUM_NBYTES = 1 << 20  # partial reads (resharding) verify whole 1 MiB blocks
VERIFY_BATCH_NBYTES = 64 << 20  # verify with a progress callback reports after each batch
AsyncSaveResult = SaveResult  # the result of an async save's handle.wait(): a save's fields

__all__ = [
    "AsyncSaveResult",
    "Checkpointer",
    "LoadReport",
    "SaveHandle",
    "SaveResult",
    "checkpoint_path",
    "local_path",
    "store_for",
]


class Checkpointer:
    """Saves and loads with one reused staging pool and I/O backend.

    Create one per training job (or use the module-level ckptio.save/load, which share one).
    Not safe for concurrent use from several threads; saves and loads run one at a time.
    """

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options.from_env()
        self._pool: BufferPool | None = None
        self._grown_nbytes = 0  # the pool's size since an async save grew it (0: not grown)
        self._over_budget_logged = False
        self._backend: io.IOBackend | None = None
        self._backend_kind = LocalStore.__name__  # the kind of store self._backend reaches
        self._lock = threading.Lock()
        self._cleanup = Cleanup()  # removal of superseded files, behind the next save
        self._active = self.options  # options the pool and backend were made with
        self._plan_cache = PlanCache()
        self._memories: dict[int | None, collective.Memory] = {}  # per group: plans of the last save
        self._groups: dict[int, tuple[Any, Group]] = {}
        self._stale_hooks: list[SaveHandle] = []  # lazy hooks to remove from their own thread
        _live.add(self)
        self._inflight: SaveHandle | None = None
        self._thread: threading.Thread | None = None

    def staging(self) -> _Staging:
        """This Checkpointer's staging pool and I/O backend (``for_store``), the lock a save
        holds while it uses them, its cleanup of superseded files and its block checksum size,
        as a save driven from outside api.py sees them (``ckptio.DcpWriter``)."""
        return _Staging(self)

    def _finish_cleanup(self) -> None:
        """Wait for the previous save's removal of superseded files (saving/cleanup.py)."""
        self._cleanup.finish()

    def _resources(self, store: Store | None = None) -> tuple[BufferPool, io.IOBackend]:
        """The pool and the backend that reaches ``store`` (a local one: made for the tuned
        profile of its filesystem, if any); remade only when a save or load goes to another
        kind of store, or a filesystem tuned differently."""
        wanted = self.options
        if isinstance(store, LocalStore):
            wanted = tuned_options(self.options, store.directory)
        kind = type(store).__name__ if store is not None else LocalStore.__name__
        if io_fields(wanted) != io_fields(self._active) and (self._pool or self._backend):
            self._release()
        elif kind != self._backend_kind and self._backend is not None:
            self._backend.shutdown()
            self._backend = None
        self._active = wanted
        if self._pool is None:
            grown = -(-self._grown_nbytes // wanted.buffer_bytes)
            self._pool = BufferPool(max(wanted.nbuffers, grown), wanted.buffer_bytes,
                                    background=True)
        if self._backend is None:
            self._backend = (LocalStore(".") if store is None else store).backend(wanted)
            self._backend_kind = kind
            register = getattr(self._backend, "register_buffers", None)
            if register is not None:  # fixed buffers: the pool is pre-faulted, so pinning is free
                register(self._pool.whole_view())
        return self._pool, self._backend

    @property
    def staging_nbytes(self) -> int:
        """Host memory the staging pool holds now: 0 before the first save or load and after
        close(); Options.pool_bytes, or more once an async save has grown it
        (Options.host_budget_bytes)."""
        pool = self._pool
        return 0 if pool is None else pool.nbytes

    def prepare(self, path: str | os.PathLike[str] | None = None, state: Any = None) -> None:
        """Allocate and pre-fault the staging pool and start the I/O backend now, for the
        filesystem of ``path``: call at startup so the first save does not pay for it. With
        ``state``: size the pool for async saves of it, as the first async save would after
        it (within Options.host_budget_bytes), so the first one returns at copy speed too."""
        if state is not None:  # first: the pool is then made once, at its grown size
            self._fit(_file_nbytes(state, self.options.max_file_bytes))
        with self._lock:
            pool, _backend = self._resources(None if path is None else store_for(path, self.options))
        pool.faulted()

    def _fit(self, file_nbytes: Sequence[int]) -> None:
        """After an async save, or for prepare(state=): grow the pool to hold files of these
        sizes whole (so the next async save never waits for the disk), within the budget."""
        with self._lock:
            buffer_bytes = self._pool.buffer_bytes if self._pool else self._active.buffer_bytes
            current = max(self._pool.nbuffers if self._pool else 0, self._active.nbuffers,
                          -(-self._grown_nbytes // buffer_bytes))
            need = sum(-(-n // buffer_bytes) for n in file_nbytes)
            if need <= current:
                return
            allowed = self._budget(current * buffer_bytes) // buffer_bytes
            if need > allowed and not self._over_budget_logged:
                self._over_budget_logged = True
                log.warning("ckptio: this rank's state (%.2f GiB of files) is larger than the "
                            "host memory async saves may stage (%.2f GiB, "
                            "Options.host_budget_bytes): async_save waits for the disk for the "
                            "rest", need * buffer_bytes / GiB, allowed * buffer_bytes / GiB)
            target = min(need, allowed)
            if target <= current:
                return
            self._grown_nbytes = target * buffer_bytes
            self._release()  # the next save or load makes it (and a backend registering it)
            try:
                self._pool = BufferPool(target, buffer_bytes, background=True)
            except (OSError, MemoryError) as exc:  # the old size is made again on next use
                self._grown_nbytes = 0
                log.warning("ckptio: could not grow the staging pool to %.2f GiB (%s); async "
                            "saves keep streaming through %.2f GiB", target * buffer_bytes / GiB,
                            exc, current * buffer_bytes / GiB)
                return
            log.info("ckptio: staging pool grown to %.2f GiB so that async saves of this state "
                     "return at copy speed (Options.host_budget_bytes)", target * buffer_bytes / GiB)

    def _budget(self, pool_nbytes: int) -> int:
        """Bytes of staging an async save may keep (Options.host_budget_bytes, or automatic:
        half of the memory available, with the pool's own, per rank of this host)."""
        if self.options.host_budget_bytes is not None:
            return self.options.host_budget_bytes
        try:
            local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            local_ranks = 1
        return (available_host_bytes() + pool_nbytes) // (2 * local_ranks)

    def close(self) -> None:
        """Wait for a save in flight, free the staging pool and stop I/O threads; the
        Checkpointer stays usable. A background error nobody has waited for is raised here."""
        try:
            self._settle()
        finally:
            self._free()

    def _free(self) -> None:
        with self._lock:
            self._finish_cleanup()
            self._release()
            self._grown_nbytes = 0

    def _release(self) -> None:
        """Free the pool and stop the backend (made again on next use)."""
        pool, backend = self._pool, self._backend
        self._pool, self._backend = None, None
        if backend is not None:
            backend.shutdown()
        if pool is not None:
            pool.close()

    def save(self, state: Any, path: str | os.PathLike[str], *, allow_pickle: bool = False,
             process_group: Any = None) -> SaveResult:
        """Write ``state`` to directory ``path``; returns once every byte is durable and committed
        (with many ranks: a collective, see async_save)."""
        return self._start(state, path, lazy=False, optimizers=(), if_busy="wait",
                           allow_pickle=allow_pickle, process_group=process_group,
                           grow_staging=False).wait()

    def async_save(
        self,
        state: Any,
        path: str | os.PathLike[str],
        *,
        lazy: bool = False,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        if_busy: str = "wait",
        allow_pickle: bool = False,
        process_group: Any = None,
    ) -> SaveHandle:
        """Start saving ``state`` to ``path``; bytes are persisted and committed in the background.

        Eager (default): returns once every tensor's bytes are copied into the staging pool (a
        state larger than the pool waits for the disk while the pool is full); the state may
        change from then on. Lazy (``lazy=True``): returns once the tensors that ``optimizers``
        do not own are copied; the rest is copied in the background while forward and backward
        run, and each optimizer's next step() waits until that copy is done. Do not change
        tensors an optimizer owns other than through its step() before then.
        if_busy: "wait" for a save still running, or "skip" (warn and return a skipped handle).
        Call ``wait()`` on the handle for the result; a background error is raised there, or
        else by the next save.
        With torch.distributed initialised (or ``process_group`` given), every rank calls this
        together: each writes its own part, replicas once, and the coordinator commits after
        every rank's bytes are durable. A failure on any rank raises on every rank.
        Staging: a state larger than the pool grows it after the save, up to
        Options.host_budget_bytes, so later async saves return at copy speed.
        """
        return self._start(state, path, lazy=lazy, optimizers=optimizers, if_busy=if_busy,
                           allow_pickle=allow_pickle, process_group=process_group,
                           grow_staging=True)

    def _start(self, state: Any, path: str | os.PathLike[str], *, lazy: bool,
               optimizers: Sequence[torch.optim.Optimizer], if_busy: str, allow_pickle: bool,
               process_group: Any, grow_staging: bool) -> SaveHandle:
        started = time.perf_counter()
        if if_busy not in ("wait", "skip"):
            raise CkptError(f"async_save(if_busy={if_busy!r}): use 'wait' or 'skip'")
        if lazy and not optimizers:
            raise CkptError("async_save(lazy=True) needs optimizers=[...]: their step() is what "
                            "must wait for the capture")
        path = checkpoint_path(path)
        group = self._group(process_group)
        if group.size > 1 and if_busy == "skip":
            raise CkptError("async_save(if_busy='skip') is not available with many ranks: ranks "
                            "could decide differently and the save would hang; use 'wait'")
        previous = self._inflight
        if previous is not None and not previous.done() and if_busy == "skip":
            warnings.warn(f"ckptio: save to {path} skipped: the save to {previous.path} is still "
                          "running (if_busy='skip')", stacklevel=2)
            return SaveHandle._skipped(path)
        previous_error: BaseException | None = None
        try:
            self._settle()
        except BaseException as exc:
            if group.size == 1:
                raise
            previous_error = exc
        self._stale_hooks = [h for h in self._stale_hooks if not h._remove_hooks()]
        context = session.SaveContext(
            group=group, store=store_for(path, self.options), options=self.options, staging=_Staging(self),
            cleanup=self._cleanup, memory=self._memory(group), plan_cache=self._plan_cache,
            meta=_meta(), block_nbytes=self._block_nbytes(), allow_pickle=allow_pickle,
            lazy=lazy, optimizers=tuple(optimizers), started=started,
            previous_error=previous_error, grow_staging=grow_staging)
        save = session.begin(context, state)
        self._inflight, self._thread = save.handle, save.thread
        save.capture_here()
        return save.handle

    def _group(self, process_group: Any) -> Group:
        """The ranks of this call: one process, or the ranks of the torch process group
        (exchanging through the job's store, with this checkpointer's deadlines)."""
        torch_group = current_group(process_group)
        if torch_group is None:
            return Solo()
        if id(torch_group) not in self._groups:
            self._groups[id(torch_group)] = (torch_group, over_torch(torch_group, self.options))
        return self._groups[id(torch_group)][1]

    def _memory(self, group: Group) -> collective.Memory:
        """The plans of the last save over ``group`` (reused while the layout is unchanged)."""
        return self._memories.setdefault(None if isinstance(group, Solo) else id(group),
                                         collective.Memory())

    def _settle(self) -> None:
        """Wait for the save in flight; raise its error if nobody has seen it yet."""
        handle, thread = self._inflight, self._thread
        if thread is not None:
            thread.join()
        if handle is not None:
            if not handle._remove_hooks():  # another thread: the trainer's next save removes them
                self._stale_hooks.append(handle)
            self._inflight, self._thread = None, None
            error = handle._unreported_error()
            if error is not None:
                raise error

    def _block_nbytes(self) -> int:
        """Checksum block of this save's entries: a quarter buffer at most, so a resharding
        load with the same options reads pieces and their widening within one buffer."""
        return min(BLOCK_CHECKSUM_NBYTES, self.options.buffer_bytes // 4)

    def _open(self, store: Store, *, allow_pickle: bool, file: str | None = None,
              every_chunk: bool = True) -> Manifest:
        """The Manifest of the checkpoint in ``store`` (or of its ``file``), whatever its format
        (opening.py), reading through this Checkpointer's pool and the store's backend, which
        a committed ckptio manifest of every chunk does not need (nor waits for a save in
        flight). ``every_chunk``: a row for every chunk of its regular tensors too (their index
        files read, loading/regular.py); else a load resolves the ones it needs."""
        read = self._plain_read(store)
        record = opening.open_manifest(store, file, read, allow_pickle=allow_pickle)
        return regular.expand_all(record, read) if every_chunk else record

    def _plain_read(self, store: Store) -> Callable[[list[Read]], int]:
        """Fill Reads unverified (the caller checks what it reads), through this
        Checkpointer's pool and the store's backend."""
        def read(reads: list[Read]) -> int:
            with self._lock:
                pool, backend = self._resources(store)
                return read_regions(store.location, reads, pool=pool, backend=backend,
                                    algorithm=None, block_nbytes=foreign.BLOCK_NBYTES,
                                    depth=self._active.io_depth)

        return read

    def manifest(self, path: str | os.PathLike[str], *, allow_pickle: bool = False) -> Manifest:
        """What the checkpoint at ``path`` holds, as a load sees it: its committed manifest, or
        the one made of a DCP checkpoint there (``ckptio ls``)."""
        store, file = opening.target(path, self.options)
        return self._open(store, allow_pickle=allow_pickle, file=file)

    def read(self, path: str | os.PathLike[str], record: Manifest, reads: Sequence[Read], *,
             verify: bool | None = None) -> int:
        """Fill the destinations of ``reads`` (regions of ``record``'s entries, as
        ``manifest(path)`` gave it) in one coalesced pass through this Checkpointer's pool and
        the store's backend, checksums checked unless ``verify`` is False (default
        Options.verify). For drivers that plan their own reads (ckptio.DcpReader). -> bytes read."""
        store, _file = opening.target(path, self.options)
        return self._reads_of(store, record, verify)(list(reads))

    def _reads_of(self, store: Store, record: Manifest,
                  verify: bool | None) -> Callable[[list[Read]], int]:
        files = opening.data_dir(store, record)
        verify = self.options.verify if verify is None else verify
        algorithm = stored_algorithm(record.checksum_algorithm) if verify else None
        # unverified, a partial read need not widen to whole checksum blocks (a foreign
        # checkpoint's "block" is its whole entry)
        block_nbytes = record.block_nbytes if verify else BLOCK

        def read(reads: list[Read]) -> int:
            with self._lock:
                pool, backend = self._resources(store)
                return read_regions(files, reads, pool=pool, backend=backend,
                                    depth=self._active.io_depth, algorithm=algorithm,
                                    block_nbytes=block_nbytes)

        return read

    def verify(self, path: str | os.PathLike[str], *, record: Manifest | None = None,
               progress: Callable[[int], None] | None = None) -> int:
        """Check everything a load checks, without loading; -> bytes read.

        The manifest (decoded and validated: bounds, chunks tiling each tensor, keys, tree),
        every inline value (decoded), every data file's size, and every stored byte against its
        checksum and its block checksums. So a checkpoint that verifies loads (pickled values
        still need allow_pickle=True, and per-rank values on another number of ranks
        per_rank_from). Nothing is copied out or unpickled; memory stays within the staging pool.
        ``progress``: called with the bytes read after each batch of entries (``ckptio verify``'s
        bar); without it everything is read in one pass. ``record``: what ``manifest(path)``
        gave, when the caller has it (not read again).
        """
        store, file = opening.target(path, self.options)
        if record is None:
            record = self._open(store, allow_pickle=False, file=file)
        reads = [Read.of(e) for e in record.tensors]
        nbytes = 0
        with self._lock:
            pool, backend = self._resources(store)
            for batch in _batches(reads, VERIFY_BATCH_NBYTES) if progress else [reads]:
                done = read_regions(
                    opening.data_dir(store, record), batch, pool=pool, backend=backend,
                    algorithm=stored_algorithm(record.checksum_algorithm), depth=self._active.io_depth,
                    block_nbytes=record.block_nbytes, check_blocks=True)
                nbytes += done
                if progress is not None:
                    progress(done)
        return nbytes

    def load(
        self,
        path: str | os.PathLike[str],
        state: Any = None,
        *,
        strict: bool = True,
        keys: KeyFilter = None,
        cast: bool = False,
        verify: bool | None = None,
        allow_pickle: bool = False,
        per_rank_from: RankPolicy = None,
        process_group: Any = None,
    ) -> Any:
        """Load into ``state`` in place (returns a LoadReport), or, with no state, return a new one.

        Every tensor leaf (plain tensor, DTensor, TensorShard, FlatShard) gets the region of the
        saved tensor it holds, whatever layout and number of ranks saved it; only the byte ranges
        that overlap it are read. With torch.distributed initialised (or ``process_group``
        given) an in-place load is a collective: a failure on any rank raises on every rank.
        strict: missing or unexpected keys raise (else they are only reported).
        keys: load only these keys (a key or a prefix of keys) or those a callable accepts.
        cast: allow a dtype conversion where the destination's dtype differs.
        verify: check checksums (default Options.verify).
        allow_pickle: unpickle objects saved with allow_pickle=True (only for trusted files).
        ``path`` may be a file written by ``torch.save(obj, path)`` (default zip format): its
        pickle is decoded with an allow-list (like ``torch.load(weights_only=True)``) and its
        tensors are read like any checkpoint's, checked against the zip's CRC-32s. A file
        holding other Python objects is refused (PickleRefusedError) unless
        ``allow_pickle=True`` and no ``state``: then this returns
        ``torch.load(path, weights_only=False, map_location="cpu")``, which runs its pickle.
        per_rank_from: which saved rank's value a per-rank key (saved differently by each rank,
        e.g. RNG state) gets on this rank: by default the same rank, which needs the same
        number of ranks; or a saved rank, a mapping or a function new rank -> saved rank.
        """
        started = time.perf_counter()
        path = checkpoint_path(path)
        group = self._group(process_group) if state is not None else Solo()
        torch_group = current_group(process_group)
        rank, world_size = (0, 1) if torch_group is None else (
            torch.distributed.get_rank(torch_group), torch.distributed.get_world_size(torch_group))
        key_step = collective.UnexpectedKeys(group, path)
        try:
            self._settle()  # a save of ours in flight finishes first (and uses the same group)
            result = self._load(path, state, strict=strict, keys=keys, cast=cast, verify=verify,
                                allow_pickle=allow_pickle, per_rank_from=per_rank_from,
                                rank=rank, world_size=world_size, key_step=key_step)
        except BaseException as exc:
            if state is not None:
                key_step.fail(exc)
            collective.agree_loaded(group, exc, path)
            raise
        collective.agree_loaded(group, None, path)
        if state is None:
            return result
        return dataclasses.replace(result, seconds=time.perf_counter() - started)

    def _load(self, path: str, state: Any, *, strict: bool, keys: KeyFilter, cast: bool,
              verify: bool | None, allow_pickle: bool, per_rank_from: RankPolicy, rank: int,
              world_size: int, key_step: collective.UnexpectedKeys) -> Any:
        store, file = opening.target(path, self.options)
        try:
            record = self._open(store, allow_pickle=allow_pickle, file=file, every_chunk=False)
        except PickleRefusedError:
            if file is None or not allow_pickle:
                raise
            if state is not None:
                raise CkptError(
                    f"{path}: a torch.save file holding Python objects beyond plain training "
                    "state loads only fresh with allow_pickle=True (ckptio.load(path, "
                    "allow_pickle=True) returns torch.load(path, weights_only=False)), not in "
                    "place") from None
            return torch.load(store.path_of(file), weights_only=False, map_location="cpu")
        read = self._reads_of(store, record, verify)
        record = expand_torch_save(record, read, where=store.location, allow_pickle=allow_pickle)
        where = {"rank": rank, "world_size": world_size, "per_rank_from": per_rank_from}
        select = selector(keys)
        if state is None:  # whole tensors: every chunk of the regular keys asked for
            record = regular.expand(record, {r.key: None for r in record.regular
                                             if select(r.key)}, self._plain_read(store))
            return fill_fresh(record, read, keys=keys, allow_pickle=allow_pickle, **where)
        flat = flatten(state)
        if record.regular:  # only the chunks this state's regions need, and their index files
            record = regular.expand(record, regular.wanted_in_place(record, flat, select),
                                    self._plain_read(store))
        return fill_in_place(record, flat, read, keys=keys, strict=strict, cast=cast,
                             allow_pickle=allow_pickle, agree_unexpected=key_step, **where)


def _batches(reads: list[Read], nbytes: int) -> list[list[Read]]:
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


@dataclass(frozen=True)
class _Staging:
    """The Checkpointer's pool and backend as a save sees them (session.Staging)."""

    checkpointer: Checkpointer

    @property
    def lock(self) -> threading.Lock:
        return self.checkpointer._lock

    def for_store(self, store: Store) -> tuple[BufferPool, io.IOBackend]:
        return self.checkpointer._resources(store)

    def fit(self, file_nbytes: Sequence[int]) -> None:
        self.checkpointer._fit(file_nbytes)

    @property
    def cleanup(self) -> Cleanup:
        return self.checkpointer._cleanup

    @property
    def block_nbytes(self) -> int:
        return self.checkpointer._block_nbytes()


def _file_nbytes(state: Any, max_file_bytes: int) -> list[int]:
    """The sizes of the data files one process's save of ``state`` writes (as planned)."""
    plan, _sources = build_plan(flatten(state), allow_pickle=True)
    files = plan_files(plan.items, save_id="size", rank=0, max_file_bytes=max_file_bytes)
    return [f.nbytes for f in files]


def _meta() -> dict[str, Any]:
    from ckptio import __version__

    return {"ckptio_version": __version__, "torch_version": torch.__version__,
            "created_unix": time.time()}


_live: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _finish_saves_at_exit() -> None:
    """At interpreter exit, before concurrent.futures stops accepting work (threading runs
    these callbacks newest first, and concurrent.futures registered its own at import): let
    every save in flight finish and commit rather than fail half-way."""
    for checkpointer in list(_live):
        thread = checkpointer._thread
        if thread is not None and thread.is_alive():
            thread.join()


threading._register_atexit(_finish_saves_at_exit)  # type: ignore[attr-defined]
