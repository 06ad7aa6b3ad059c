"""A store's files as the save and load paths see them: a file name in, an open handle out.

``StoreFiles`` binds one Store to one IOBackend: ``open_write(name, nbytes)`` and
``open_read(name)`` give handles for the store's own files (the store turns the name into what
its backend reaches, ``Store.path_of``), and the handle's transfers go to that backend. Nothing
above storage/ builds a file's path: saving/persist.py and loading/read.py take a StoreFiles.

``Capabilities`` (defined in store_contract.py beside the Store, named here too) is what a store can do,
as data (a property of every store, read instead of ``isinstance`` checks): O_DIRECT-style
aligned I/O, registered (pinned) staging buffers, an atomic rename, a lock across processes, a
conditional commit, the local directory whose filesystem's tuned I/O profile applies, and
whether it lies across a network (tuning/profile.py).

``IOResources`` is the contract between a driver that owns the reused staging pool and the backends
(api's Checkpointer, through ckptio/resources.py) and the save and load sessions that borrow them.
A driver may hold several backends at once (one per ``Store.backend_kind``): a drain reads one
store and writes another with the same pool.

A load's StoreFiles is ``watched`` by its Activity (io/stall.py): each open and each read is a
call in flight from its submission to its completion, so a read that storage never answers is
warned about as a save's write is.

Owns: the binding, the IOResources protocol, which reads and opens a watched one reports. Does not own: what a backend
does (io/), the names a store holds (store_contract.py), the pool (io/stage.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from ckptio.errors import StorageIOError
from ckptio.io.backend_contract import BatchReads, FileHandle, Filled, IOBackend, all_of
from ckptio.io.stall import Activity
from ckptio.storage.local import slots
from ckptio.storage.local.mapped import MappedFile, Mappings, on_tmpfs
from ckptio.storage.store_contract import Capabilities, Store

if TYPE_CHECKING:  # torch-free at run time: manifest-only commands import storage/
    from ckptio.io.stage import StagingPool
    from ckptio.options import Options

__all__ = ["Capabilities", "IOResources", "StoreFiles", "in_memory", "mappable", "mappings_of"]


class StoreFiles:
    """One store's files through one backend (the caller owns the backend's lifetime);
    ``activity``: where its opens and reads are watched (io/stall.py), or None."""

    def __init__(self, store: Store, backend: IOBackend, activity: Activity | None = None) -> None:
        self.store, self.backend, self.activity = store, backend, activity

    def watched(self, activity: Activity) -> StoreFiles:
        """These files, their opens and reads watched by ``activity`` (a load's)."""
        return StoreFiles(self.store, self.backend, activity)

    def beside(self, store: Store) -> StoreFiles:
        """``store``'s files through the same backend, watched by the same activity (a delta's
        base checkpoint, read by the load of the delta)."""
        return StoreFiles(store, self.backend, self.activity)

    @property
    def location(self) -> str:
        return self.store.location

    def where(self, name: str) -> str:
        """What messages name for file ``name`` of this store."""
        return self.store.path_of(name)

    def open_write(self, name: str, nbytes: int) -> FileHandle:
        """Create file ``name`` (it must not exist) with ``nbytes`` preallocated."""
        return self.backend.open_write(self.store.path_of(name), nbytes)

    def open_read(self, name: str, *, cached: bool = False) -> FileHandle:
        """Open file ``name`` for reading; ``cached``: through the page cache (IOBackend;
        passed only when asked, so a backend written before it existed still opens reads)."""
        path = self.store.path_of(name)
        with self._call("open", path):
            if cached:
                return self.backend.open_read(path, cached=True)
            return self.backend.open_read(path)

    def _call(self, what: str, path: str) -> contextlib.AbstractContextManager[None]:
        if self.activity is None:
            return contextlib.nullcontext()
        return self.activity.call(what, path)

    def _watched(self, fh: FileHandle, submit: Callable[[], Future[int]]) -> Future[int]:
        """``submit()``'s read, in flight in the activity until its future is done."""
        activity = self.activity
        if activity is None:
            return submit()
        token = activity.begin("read", fh.path)
        try:
            future = submit()
        except BaseException:
            activity.end(token)
            raise
        future.add_done_callback(lambda _f: activity.end(token))
        return future

    def in_memory(self) -> bool:
        """Whether the store's files are pages of host memory (``in_memory``)."""
        return in_memory(self.store)

    def open_mapped(self, name: str, nbytes: int) -> MappedFile:
        """Create file ``name`` of ``nbytes`` mapped writable (a store for which mappable()
        holds; storage/local/mapped.py): a slot of its root's dropped steps where there is one
        (storage/local/slots.py), mapped into the store's Mappings (its root's)."""
        mappings, path = self._mappings(), self.store.path_of(name)
        return mappings.open_file(path, nbytes, reused=slots.take_slot(path, nbytes, mappings))

    def borrow_mapped(self, name: str) -> MappedFile | None:
        """The idle mapping of file ``name`` in the store's Mappings (a save through them wrote
        it), in use until ``release_mapped``; None where there is none (Mappings.borrow)."""
        mappings = mappings_of(self.store)
        return None if mappings is None else mappings.borrow(self.store.path_of(name))

    def release_mapped(self, entry: MappedFile, *, keep: bool = True) -> None:
        """Done with ``entry`` (from open_mapped or borrow_mapped): Mappings.release."""
        self._mappings().release(entry, keep=keep)

    def _mappings(self) -> Mappings:
        mappings = mappings_of(self.store)
        if mappings is None:
            raise StorageIOError(f"{self.location} keeps no mappings (only a memory tier's step "
                                 "does, storage/files.mappable): nothing is mapped here")
        return mappings

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        return self.backend.submit_write(fh, offset, data)

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        return self._watched(fh, lambda: self.backend.submit_read(fh, offset, into))

    def submit_reads(self, fh: FileHandle, reads: Sequence[tuple[int, memoryview]],
                     each: Filled) -> Future[int]:
        """backend_contract.BatchReads.submit_reads through the backend where it has it, else
        one submit_read per read, ``each`` called once per read as it completes."""
        backend = self.backend
        if isinstance(backend, BatchReads):
            return self._watched(fh, lambda: backend.submit_reads(fh, reads, each))
        futures = []
        for i, (offset, into) in enumerate(reads):
            future = self.submit_read(fh, offset, into)
            futures.append(_then(future, _last_call(each, i)))
        return all_of(futures)

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        self.backend.close(fh, sync=sync)


def in_memory(store: Store) -> bool:
    """Whether ``store``'s files are pages of host memory (a local directory on tmpfs): a
    buffered read of them into any address is one copy (loading/direct_reads.py), and its
    transfers are copies that threads spread over the cores (ckptio/resources.py)."""
    directory = store.capabilities.filesystem
    return directory is not None and on_tmpfs(directory)


def mappable(store: Store, sizes: Sequence[int]) -> bool:
    """Whether a save of files of ``sizes`` may write ``store``'s files as shared mappings: a
    local directory on tmpfs, whose pages are the files, beside slots of those sizes that this
    process has mapped ahead (storage/local/slots.py; a manager's memory tier once its retention
    dropped a step). Elsewhere, and until then, the capture copies into the staging pool and
    the backend writes: a fresh mapping would allocate and fault its pages inside the call."""
    mappings = mappings_of(store)
    return (mappings is not None and in_memory(store)
            and slots.warm_fit(store.capabilities.filesystem or "", sizes, mappings))


def mappings_of(store: Store) -> Mappings | None:
    """The Mappings ``store``'s files are kept in: a memory tier's step's (its root's, carried
    by the LocalStore the root made, LocalRoot.store_at); None for any other store."""
    found = getattr(store, "mappings", None)
    return found if isinstance(found, Mappings) else None


class IOResources(Protocol):
    """The staging pool and the backends a driver owns, lent to one save or load at a time
    (under ``lock``)."""

    lock: threading.Lock
    options: Options  # what the driver was made with (a delta's base stores are opened with it)

    def files(self, store: Store, nbytes: int | None = None, *, copy_faults: bool = False,
              behind: bool = False, reading: bool = False,
              fit: Sequence[int] = ()) -> tuple[StagingPool, StoreFiles]:
        """The pool and ``store``'s files through the backend of its kind (made on first use;
        ``nbytes``: the bytes this use stages, so a small one gets a small pool;
        ``copy_faults``: a pool made now is faulted in by this use's copies, not beforehand;
        ``behind``: a save that persists while its caller goes on; ``reading``: a load;
        ``fit``: file sizes the pool is first grown to hold, as ``fit()``)."""
        ...

    def fit(self, file_nbytes: Sequence[int]) -> None:
        """Make the pool hold files of these sizes whole, where the budget allows."""
        ...

    @property
    def io_depth(self) -> int:
        """Reads in flight per load (the options the backends were made with)."""
        ...


def _last_call(each: Filled, i: int) -> Callable[[int], None]:
    """``each`` for read ``i``, called once with all its bytes."""
    return lambda got: each(i, got, True)


def _then(future: Future[int], after: Callable[[int], None]) -> Future[int]:
    """A future of ``future``'s bytes once ``after(bytes)`` has run (its failure, or
    ``future``'s, fails it)."""
    out: Future[int] = Future()

    def done(f: Future[int]) -> None:
        try:
            got = f.result()
            after(got)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through ``out``
            out.set_exception(exc)
        else:
            out.set_result(got)

    future.add_done_callback(done)
    return out
