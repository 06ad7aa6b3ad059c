"""Writable shared mappings of files on tmpfs and the cache of them a memory tier's root owns.

A save into a directory on tmpfs (``shm://``) copies the state straight into its data files'
own pages: ``Mappings.open_file(path, nbytes, reused=...)`` opens the file (a slot just renamed
there by storage/local/slots.py, or a new one made with O_EXCL), sizes it (ftruncate, then
fallocate: a full tmpfs is an error here, never a SIGBUS inside the copy) and maps it
MAP_SHARED: the pages are the file, there is nothing to write or fsync. ``release`` keeps the
mapping for a later save into the same file (cached by (st_dev, st_ino), bounded in bytes; a
file unlinked since is unmapped at the next open) where its root keeps slots. ``borrow`` lends
a load the idle mapping of a file a save through the same ``Mappings`` wrote; ``new_shared_file``
makes a file a peer's bytes are received into (redundancy/peers.py). One ``Mappings``
per memory tier's root (LocalRoot), carried by its steps' LocalStores; nothing module-wide.

Hand-written through ctypes: os.statvfs has no filesystem type (statfs's f_type is what tells
tmpfs), Python's mmap refuses to unmap while a tensor views it, and os.rename replaces its
target (renameat2 with RENAME_NOREPLACE does not: slots.py). Linux only; elsewhere nothing is
on tmpfs.

Owns: the mappings and their cache (Mappings). Does not own: who holds one (LocalRoot), the
slot directory (storage/local/slots.py), what is copied into the pages (saving/mapped_regions.py,
saving/persist.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ckptio.errors import StorageIOError
from ckptio.io import pages

__all__ = ["SLOTS_DIR", "MappedFile", "Mappings", "libc", "new_shared_file", "on_tmpfs",
           "size_file"]

log = logging.getLogger("ckptio")
TMPFS_MAGIC = 0x01021994  # statfs f_type of tmpfs (linux/magic.h)
SLOTS_DIR = ".ckptio-slots"  # beside a root's steps: never a step name, never listed
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
_NBYTES, _TICK = operator.attrgetter("nbytes"), operator.attrgetter("tick")


@dataclass(eq=False)
class MappedFile:
    """One file mapped whole: bytes [0, nbytes) at ``address`` (0 for an empty file)."""

    path: str
    nbytes: int
    address: int
    fd: int
    key: tuple[int, int]  # (st_dev, st_ino)
    reused: bool  # taken from a slot (its pages were allocated by an earlier save)
    kept: dict[object, object] = field(default_factory=dict)  # users' objects over the pages
    on_unmap: list[Callable[[], None]] = field(default_factory=list)  # run before munmap
    in_use: bool = True
    tick: int = 0  # last use (the cache drops the least recently used first)


@functools.cache
def libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]
    lib.mmap.restype = ctypes.c_void_p
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if hasattr(lib, "renameat2"):
        lib.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                  ctypes.c_char_p, ctypes.c_uint]
    return lib


def on_tmpfs(path: str) -> bool:
    """Whether ``path`` (or its nearest existing parent) lies on a tmpfs."""
    if not sys.platform.startswith("linux"):
        return False
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field
    try:
        if libc().statfs(os.fsencode(path), buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return (ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF) == TMPFS_MAGIC


def size_file(fd: int, nbytes: int) -> tuple[int, int]:
    """Make the file ``nbytes`` long with every page allocated -> its (st_dev, st_ino)."""
    info = os.fstat(fd)
    if info.st_size != nbytes:
        os.ftruncate(fd, nbytes)
        info = os.fstat(fd)
    if nbytes and info.st_blocks * 512 < nbytes:
        os.posix_fallocate(fd, 0, nbytes)
    return info.st_dev, info.st_ino


def new_shared_file(path: str, nbytes: int) -> None:
    """Make a new file at ``path`` (none may be there), ``nbytes`` long with every page
    allocated (size_file: a full tmpfs fails here, not at a later write through a shared
    mapping of it). No torch here: the CLI imports this module without it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        size_file(fd, nbytes)
    finally:
        os.close(fd)


def _map(fd: int, nbytes: int, *, populate: bool = False) -> int:
    """A shared mapping of ``nbytes`` of ``fd`` (``populate``: its pages faulted in, a step at
    a time, io/pages.py: one MAP_POPULATE held up every mapping of the process meanwhile)."""
    if nbytes == 0:
        return 0
    address = libc().mmap(None, nbytes, _PROT_READ_WRITE, _MAP_SHARED, fd, 0)
    if address in (None, _MAP_FAILED):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    if populate:
        pages.populate(int(address), nbytes)  # what it leaves faults in at its first use
    return int(address)


def _unmap(entry: MappedFile) -> None:
    for hook in entry.on_unmap:
        hook()
    entry.on_unmap.clear()
    entry.kept.clear()
    if entry.address:
        libc().munmap(entry.address, entry.nbytes)
        entry.address = 0
    if entry.fd >= 0:  # held open while cached: its inode (the cache key) is never reused
        os.close(entry.fd)
        entry.fd = -1


class Mappings:
    """The mappings a memory tier's root keeps for its files (storage/local/local_root.py's
    LocalRoot owns one; its steps' stores carry it): by (st_dev, st_ino), bounded in bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[tuple[int, int], MappedFile] = {}
        self._ticks = 0

    def open_file(self, path: str, nbytes: int, *, reused: bool) -> MappedFile:
        """``path`` of ``nbytes``, mapped whole and writable: a slot file just renamed there
        (``reused``: storage/local/slots.take_slot), else a new file (which must not exist).
        StorageIOError if it cannot be made (tmpfs full: fallocate fails before any byte is
        copied)."""
        self.prune()
        try:
            flags = os.O_RDWR | os.O_CLOEXEC | (0 if reused else os.O_CREAT | os.O_EXCL)
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise StorageIOError(f"creating {path} failed: {exc.strerror or exc}") from None
        try:
            key = size_file(fd, nbytes)
            with self._lock:
                entry = self._cache.pop(key, None)
            if entry is not None and entry.nbytes == nbytes and not entry.in_use:
                os.close(fd)
                entry.path, entry.in_use, entry.reused = path, True, reused
            else:
                if entry is not None:
                    _unmap(entry)
                entry = MappedFile(path, nbytes, _map(fd, nbytes), fd, key, reused)
        except OSError as exc:
            os.close(fd)
            raise StorageIOError(f"mapping {path} ({nbytes} bytes) failed: {exc.strerror or exc}"
                                 " (a full tmpfs: free host memory there, or lower keep_last)"
                                 ) from None
        with self._lock:
            self._ticks += 1
            entry.tick = self._ticks
            self._cache[entry.key] = entry
            self._bound()
        return entry

    def release(self, entry: MappedFile, *, keep: bool = True) -> None:
        """The save is done with ``entry``: kept for a later save of its file (``keep``, and its
        root keeps slots: elsewhere no save takes the file again), else unmapped now (a failed
        save, whose files are removed)."""
        root = os.path.dirname(os.path.dirname(os.path.abspath(entry.path)))
        keep = keep and os.path.isdir(os.path.join(root, SLOTS_DIR))
        with self._lock:
            entry.in_use = False
            if keep:
                return
            if self._cache.get(entry.key) is entry:
                del self._cache[entry.key]
        _unmap(entry)

    def borrow(self, path: str) -> MappedFile | None:
        """The idle mapping this process holds of file ``path`` (a save here wrote it), in use
        until ``release(entry)``: a load copies out of its pages, no read and no page faults;
        None where there is none (another process's file: read() is the one copy there)."""
        try:
            info = os.stat(path)
        except OSError:
            return None
        with self._lock:
            entry = self._cache.get((info.st_dev, info.st_ino))
            if entry is None or entry.in_use or entry.nbytes != info.st_size:
                return None
            entry.in_use = True
            return entry

    def forget(self) -> None:
        """Unmap every cached mapping no save uses (a Checkpointer closing, the root dropping
        its slots)."""
        with self._lock:
            idle = [e for e in self._cache.values() if not e.in_use]
            for entry in idle:
                del self._cache[entry.key]
        for entry in idle:
            _unmap(entry)

    def prune(self) -> None:
        """Unmap the cached files unlinked since (their pages are freed then)."""
        with self._lock:
            for key, entry in list(self._cache.items()):
                if entry.in_use:
                    continue
                try:
                    gone = os.fstat(entry.fd).st_nlink == 0
                except OSError:
                    gone = True
                if gone:
                    del self._cache[key]
                    _unmap(entry)

    def _bound(self) -> None:
        """Under the lock: the least recently used idle mappings go while the cache maps more
        than the host's memory."""
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        total = sum(map(_NBYTES, self._cache.values()))
        if total <= limit:
            return
        for entry in sorted(self._cache.values(), key=_TICK):
            if total <= limit:
                break
            if not entry.in_use:
                del self._cache[entry.key]
                _unmap(entry)
                total -= entry.nbytes

    def cache_idle(self, path: str, fd: int) -> MappedFile | None:
        """Cache an idle, populated mapping of the open file ``fd`` (a slot; closed if not kept)
        -> the new mapping, None where none was made (mapped already, empty, or mapping failed)."""
        try:
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            with self._lock:
                known = key in self._cache
            if known or not info.st_size:
                os.close(fd)
                return None
            entry = MappedFile(path, info.st_size, _map(fd, info.st_size, populate=True), fd,
                               key, True, in_use=False)
        except OSError as exc:
            os.close(fd)
            log.info("ckptio: could not map the slot %s ahead of the next save (%s)", path, exc)
            return None
        with self._lock:
            if key not in self._cache:
                self._ticks += 1
                entry.tick = self._ticks
                self._cache[key] = entry
                self._bound()
                return entry
        _unmap(entry)  # a save mapped it meanwhile
        return None

    def idle(self, key: tuple[int, int], nbytes: int) -> bool:
        """Whether the file of ``key`` (st_dev, st_ino) is mapped here whole (``nbytes``),
        unused."""
        with self._lock:
            entry = self._cache.get(key)
            return entry is not None and not entry.in_use and entry.nbytes == nbytes

    def idle_keys(self) -> set[tuple[int, int]]:
        """The files mapped here that no save or load uses now."""
        with self._lock:
            return {key for key, entry in self._cache.items() if not entry.in_use}
