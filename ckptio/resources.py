"""The reusable resources of one Checkpointer: the staging pool and the I/O backends.

A ``ReusedIOResources`` is what saves and loads borrow (storage/files.IOResources): one pre-faulted staging
pool, made on first use and reused by every later save and load, and one backend per kind of
store (``Store.backend_kind``), so a job may read one store and write another with the same
pool. Backends are made for the store's tuned I/O profile (tuning/profile.py); where the store
allows it the backend pins the whole pool (io_uring's fixed buffers, ``_pin``). How the pool is
sized, grown and pinned: docs/BEHAVIOUR.md, "ckptio.resources".

Call order: ``fit`` for a state (prepare(state=): grow within this rank's share of the host's
budget, io/hostbudget.py, pre-faulted on the pool's thread) -> ``prepare(store)`` (optional,
at startup) -> under ``lock``, per save or load, ``files(store, nbytes=)`` (the pool and the
store's files through its backend) -> ``fit`` after an async save (grow within that share) ->
``release`` (made again on next use) or ``free`` (after the last cleanup, forgetting the grown
size).

A forked child (a DataLoader worker, a multiprocessing Process) that saves or loads through
the parent's Checkpointer makes its own pool and backends: the parent's pool is not mapped in
it (io/stage.py), and the parent's rings, threads and locks are not the child's.

Owns: the pool's and backends' lifetime and size, the lock one save or load holds while using
them, the cleanup of superseded files behind the next save, the saves' threads
(saving/workers.py). Does not own: what a save or load does with them (saving/save_session.py,
loading/load_session.py), the pool itself (io/stage.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence

from ckptio.io.backend_contract import IOBackend
from ckptio.io.hostbudget import HostBudget, host_budget, local_world_size, size_text
from ckptio.io.stage import StagingPool
from ckptio.options import GiB, Options
from ckptio.saving.cleanup import Cleanup
from ckptio.saving.commits import Commits
from ckptio.saving.workers import SaveWorkers
from ckptio.storage.files import StoreFiles, in_memory
from ckptio.storage.local.local_root import LocalRoot
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.select import store_and_file
from ckptio.storage.store_contract import Store
from ckptio.tuning.profile import io_fields, tuned_options, tuned_s3_options

__all__ = ["BLOCK_CHECKSUM_NBYTES", "ReusedIOResources"]

log = logging.getLogger("ckptio")
BLOCK_CHECKSUM_NBYTES = 1 << 20  # partial reads (resharding) verify whole 1 MiB blocks


class ReusedIOResources:
    """One Checkpointer's staging pool and backends (storage/files.IOResources)."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.lock = threading.Lock()
        self.workers = SaveWorkers()  # the threads saves run on, kept from save to save
        self.cleanup = Cleanup(self.workers)  # removal of superseded files, behind the next save
        self.commits = Commits()  # the manifests its saves committed last (managing/copy.py)
        self._pool: StagingPool | None = None
        self._backends: dict[str, IOBackend] = {}  # Store.backend_kind -> its backend
        self._stores: dict[str, Store] = {}  # Store.backend_kind -> the store it was made for
        self._pinned: set[str] = set()  # the kinds whose backend registered the pool
        self._unpinnable: set[str] = set()  # kinds whose backend refused, until the pool changes
        self._grown_pool: StagingPool | None = None  # the pool fit() made, pinned once resident
        self._grown_nbytes = 0  # the pool's size since an async save grew it (0: not grown)
        self._over_budget_logged = False
        self._active = options  # the options the pool and backends were made with
        self._local_ranks = local_world_size()  # the ranks sharing this host's budget
        self._roots: dict[str, LocalRoot] = {}  # a manager's local tier roots, by location
        _made.add(self)

    # ---------------------------------------------------------------- which store a path is

    def serve(self, root: LocalRoot) -> None:
        """A manager's local tier: its steps' stores are made by ``root`` (LocalRoot.store_at,
        carrying the mappings the root owns for a memory tier), so its saves, restores and
        drains through this Checkpointer share them. A second root at the same location (two
        managers over one Checkpointer) shares the first one's mappings."""
        known = self._roots.setdefault(root.location, root)
        root.mappings = known.mappings

    def served(self, store: Store) -> Store:
        """``store`` (select.store_for's), or, for a step of a root ``serve`` was given, the
        store that root makes of it."""
        if not isinstance(store, LocalStore) or store.mappings is not None:
            return store
        root = self._roots.get(os.path.dirname(store.location.rstrip("/")))
        return store if root is None else root.store_at(store.location)

    def located(self, path: str | os.PathLike[str]) -> tuple[Store, str | None]:
        """select.store_and_file(path) with its store ``served``."""
        store, file = store_and_file(path, self.options)
        return self.served(store), file

    # ---------------------------------------------------------------- what a save or load borrows

    def files(self, store: Store, nbytes: int | None = None, *, copy_faults: bool = False,
              behind: bool = False, reading: bool = False, fit: Sequence[int] = (),
              whole: Sequence[int] = ()) -> tuple[StagingPool, StoreFiles]:
        """The pool and ``store``'s files through the backend of its kind; the pool and every
        backend are made again only when a store's filesystem is tuned differently, or when
        this use stages more bytes (``nbytes``; None: unknown, a pool of Options.pool_bytes)
        than a pool sized to a smaller use holds. ``copy_faults``: a pool made now is not
        pre-faulted, this use's copies into it fault its pages (a save: torch's copy on every
        core, faster than waiting for a pre-fault thread: docs/BENCH_LIMIT.md, "small states
        and the first save"). ``behind``: a save that persists while the caller goes on
        (async, lazy): io_backend "auto" takes the POSIX threads there, whose Python holds the
        interpreter less while the loop runs than io_uring's submissions and reaper.
        ``reading``: a load, whose backend pins the pool buffer by buffer, each at its first
        read (pinning a whole fresh pool before the first read slowed a restarting job's first
        load, reading through unpinned buffers slowed every load: docs/BENCH_RESTART.md).
        ``fit``: an async save's file sizes: the pool grown first to hold them (``fit()``,
        with the lock held), its buffers handed to the capture as its own thread faults them in.
        ``whole``: instead of ``nbytes``, files of these sizes, each staged whole in buffers of
        its own (an async save's, for prepare(state=)): a pool made now holds them and no more."""
        if fit:
            self._fit(fit)
        wanted = self.options
        filesystem, endpoint = store.capabilities.filesystem, store.capabilities.endpoint
        if filesystem is not None:
            wanted = tuned_options(self.options, filesystem)
        elif endpoint is not None:
            wanted = tuned_s3_options(self.options, endpoint)
        if io_fields(wanted) != io_fields(self._active) and (self._pool or self._backends):
            self.release()
        self._active = wanted
        want = self._nbuffers_for(nbytes, whole)
        if self._pool is not None and self._pool.nbuffers < want:
            self._drop_pool()  # a pool sized to a smaller state: made again at this use's size
        pool = self._made_pool(want, prefault=not copy_faults)
        kind = store.backend_kind
        # behind the caller: the user's "auto" holds over a tuned backend (the tuner measures
        # saves waited for, not the loop they run beside)
        if (self.options.io_backend == "auto" and behind) or (
                wanted.io_backend == "auto" and in_memory(store)):
            wanted, kind = dataclasses.replace(wanted, io_backend="posix"), f"{kind}+threads"
        backend = self._backends.get(kind)
        if backend is None:
            backend = self._backends[kind] = store.backend(wanted)
            self._stores[kind] = store
        self._pin(store, backend, pool, kind, by_parts=reading)
        return pool, StoreFiles(store, backend)

    def _pin(self, store: Store, backend: IOBackend, pool: StagingPool, kind: str,
             by_parts: bool = False) -> None:
        """Register the pool with ``backend``, once: ``by_parts`` (a load), each buffer at its
        first read; otherwise a pool of Options.pool_bytes at the backend's first use, which
        faults in what the pool has not yet (faster pinned than not: docs/BENCH_LIMIT.md, "the
        save's gap to the disk was page pinning"); a smaller one (sized to a small state) or
        one grown for async saves (``fit``) only once it is resident: faulting it all first
        slowed a small cold load and the async_save call after a grown pool (same page)."""
        if (kind in self._pinned or kind in self._unpinnable
                or not store.capabilities.registered_buffers):
            return
        if not by_parts and not pool.resident and (
                pool is self._grown_pool or pool.nbuffers < self._active.nbuffers):
            return
        part_bytes = pool.buffer_bytes if by_parts else 0
        if backend.register_buffers(pool.whole_view(), part_bytes=part_bytes):
            self._pinned.add(kind)
        else:
            self._unpinnable.add(kind)

    def _pin_resident(self, pool: StagingPool) -> None:
        """On ``pool``'s pre-fault thread, once it is resident: the backends made so far pin
        it now rather than inside the next save's call (registering a grown pool is a
        visible part of a first save's call); if a save or load holds the lock,
        its next files() pins it instead (never waited for: close() joins this thread)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if pool is self._pool:
                for kind, backend in list(self._backends.items()):
                    self._pin(self._stores[kind], backend, pool, kind)
        finally:
            self.lock.release()

    def _drop_pool(self) -> None:
        """Free the pool only, stopping the backends that pinned it (which forgets the pool;
        they, and what they learnt of their filesystem, stay); the next use makes a pool of
        its size."""
        pool, self._pool = self._pool, None
        for kind in self._pinned:
            self._backends[kind].shutdown()
        self._pinned.clear()
        self._unpinnable.clear()  # a backend may take the next pool (another size)
        self._grown_pool = None
        if pool is not None:
            pool.close()

    @property
    def io_depth(self) -> int:
        return self._active.io_depth

    @property
    def block_nbytes(self) -> int:
        """Checksum block of a save's entries: a quarter buffer at most, so a resharding load
        with the same options reads pieces and their widening within one buffer."""
        return min(BLOCK_CHECKSUM_NBYTES, self.options.buffer_bytes // 4)

    @property
    def pool(self) -> StagingPool | None:
        """The pool, if made (None before the first save or load and after release())."""
        return self._pool

    def _nbuffers_for(self, nbytes: int | None, whole: Sequence[int] = ()) -> int:
        """Buffers a use staging ``nbytes`` (or files of the sizes ``whole``, each in buffers
        of its own) wants: as many as those bytes fill, two at least (staging overlaps
        writing), Options.pool_bytes' worth at most, or the grown size."""
        buffer_bytes = self._active.buffer_bytes
        default = max(self._active.nbuffers, -(-self._grown_nbytes // buffer_bytes))
        if whole:
            return min(default, max(2, sum(-(-n // buffer_bytes) for n in whole)))
        if nbytes is None:
            return default
        return min(default, max(2, -(-nbytes // buffer_bytes)))

    def _made_pool(self, nbuffers: int, prefault: bool = True) -> StagingPool:
        if self._pool is None:
            self._pool = StagingPool(nbuffers, self._active.buffer_bytes, prefault=prefault,
                                    background=True, when_resident=self._pin_resident)
        return self._pool

    def prepare(self, store: Store | None, *, wait: bool = True,
                whole: Sequence[int] = ()) -> None:
        """Make the pool and ``store``'s backend (a local one's by default); ``wait``: return
        once the pool is faulted in (and pinned where the backend can), else its own thread
        faults it in while the caller goes on (a save meanwhile takes the buffers faulted).
        ``whole``: the sizes of a state's files (prepare(state=)): a pool made now holds them
        whole and no more, never Options.pool_bytes for a smaller state; without, a pool
        already made stays as it is (restore()'s pinning after its load keeps the state's)."""
        target = LocalStore(".") if store is None else store
        with self.lock:
            kept = None if whole or self._pool is None else self._pool.nbytes
            pool, _files = self.files(target, kept, whole=whole)
        if not wait:
            return
        pool.faulted()
        with self.lock:
            self.files(target, pool.nbytes)  # resident now: a backend that can pin it does

    def wrap_backend(self, store: Store, wrap: Callable[[IOBackend], IOBackend]) -> IOBackend:
        """Replace the backend of ``store``'s kind by ``wrap(it)`` (test support: fault
        injection), for the saves behind the caller too; release() drops it."""
        kind = store.backend_kind
        with self.lock:  # the pool made stays as it is
            _pool, files = self.files(store, None if self._pool is None else self._pool.nbytes)
            wrapped = self._backends[kind] = self._backends[f"{kind}+threads"] = wrap(files.backend)
            self._stores[kind] = self._stores[f"{kind}+threads"] = store  # both kinds pin by it
        return wrapped

    # ---------------------------------------------------------------- growing the pool

    def fit(self, file_nbytes: Sequence[int]) -> None:
        """After an async save, or for prepare(state=): grow the pool to hold files of these
        sizes whole (so the next async save never waits for the disk), within the budget; the
        grown pool faults in on its own thread."""
        with self.lock:
            self._fit(file_nbytes)

    def _fit(self, file_nbytes: Sequence[int]) -> None:
        buffer_bytes = self._pool.buffer_bytes if self._pool else self._active.buffer_bytes
        current = max(self._pool.nbuffers if self._pool else 0, self._active.nbuffers,
                      -(-self._grown_nbytes // buffer_bytes))
        need = sum(-(-n // buffer_bytes) for n in file_nbytes)
        if need <= current:
            return
        budget = self._budget(self._pool.nbytes if self._pool else 0)
        allowed = budget.share // buffer_bytes
        if need > allowed:
            self._log_over_budget(need * buffer_bytes, budget, current * buffer_bytes)
        target = min(need, allowed)
        if target > current:
            self._grow(target, buffer_bytes, current)

    def _grow(self, target: int, buffer_bytes: int, current: int) -> None:
        self._grown_nbytes = target * buffer_bytes
        self._drop_pool()  # and the backends that pinned it (made again, pinning the new one)
        try:
            self._pool = self._grown_pool = StagingPool(target, buffer_bytes, background=True,
                                                        when_resident=self._pin_resident)
        except (OSError, MemoryError) as exc:  # the old size is made again on next use
            self._grown_nbytes = 0
            log.warning("ckptio: could not grow the staging pool to %.2f GiB (%s); async saves "
                        "keep streaming through %.2f GiB", target * buffer_bytes / GiB, exc,
                        current * buffer_bytes / GiB)
            return
        log.info("ckptio: staging pool grown to %.2f GiB so that async saves of this state "
                 "return at copy speed (Options.host_budget_bytes)", target * buffer_bytes / GiB)

    def _log_over_budget(self, need_nbytes: int, budget: HostBudget, floor_nbytes: int) -> None:
        if self._over_budget_logged:
            return
        self._over_budget_logged = True
        floor = ""
        if budget.share < floor_nbytes:
            floor = (f"; the pool stays at {size_text(floor_nbytes)} (Options.pool_bytes, the "
                     f"least a save streams through), so this host's {budget.ranks} rank(s) "
                     "may hold that much each: lower Options.pool_bytes to stay within")
        log.warning("ckptio: this rank's state (%s of files) is larger than the host memory "
                    "its async saves may stage (%s): async_save waits for the disk for the "
                    "rest%s", size_text(need_nbytes), budget.describe(), floor)

    def _budget(self, pool_nbytes: int) -> HostBudget:
        """The host's staging budget and this rank's share of it (io/hostbudget.py)."""
        return host_budget(self.options.host_budget_bytes, pool_nbytes, self._local_ranks)

    # ---------------------------------------------------------------- letting go

    def forget_parent(self) -> None:
        """In a forked child: forget the parent's pool (not mapped here: touching it faulted
        the child), backends, cleanup and lock (a parent's thread may have held it), without
        stopping them (that would act on the parent's rings); made anew on next use."""
        self.lock = threading.Lock()
        self.cleanup = Cleanup(self.workers)
        self._pool, self._grown_pool, self._grown_nbytes = None, None, 0
        self._backends, self._stores = {}, {}
        self._pinned, self._unpinnable = set(), set()

    def release(self) -> None:
        """Free the pool and stop every backend (made again on next use)."""
        pool, backends = self._pool, list(self._backends.values())
        self._pool, self._backends = None, {}
        self._pinned.clear()
        self._unpinnable.clear()
        self._grown_pool = None
        for backend in backends:
            backend.shutdown()
        if pool is not None:
            pool.close()

    def free(self) -> None:
        """release(), after the last save's cleanup, and forget the grown size; the save
        threads are joined (made again by the next save)."""
        with self.lock:
            self.cleanup.finish()
            self.workers.close()
            self.release()
            self._grown_nbytes = 0
        for root in list(self._roots.values()):  # the mapped saves' files stay, their
            root.mappings.forget()  # idle mappings in this process go


_made: weakref.WeakSet[ReusedIOResources] = weakref.WeakSet()


def _forget_in_child() -> None:
    for each in list(_made):
        each.forget_parent()


os.register_at_fork(after_in_child=_forget_in_child)
