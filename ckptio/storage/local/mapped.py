"""Writable shared mappings of files on tmpfs, a process-wide cache of them, and the slots (data
files of dropped steps) a new save's file is taken from.

A save into a directory on tmpfs (``shm://``) copies the state straight into its data files'
own pages: ``open_file(path, nbytes)`` takes a slot file of the manager's root (renamed into
place, never over a file) or creates the file (O_EXCL), sizes it (ftruncate, then fallocate: a
full tmpfs is an error here, never a SIGBUS inside the copy) and maps it MAP_SHARED: the pages
are the file, there is nothing to write or fsync. ``release`` keeps the mapping for a later
save into the same file (cached by (st_dev, st_ino), bounded in bytes; a file unlinked since is
unmapped at the next open) where its root keeps slots, so a reused slot is neither allocated
nor faulted in again. ``borrow`` lends a load the idle mapping of a file a save here wrote
(loading/direct_reads.py copies out of it), in use until ``release``.
``keep_slots`` (a LocalRoot's retention) moves the data files of the newest dropped steps (at
most SLOT_STEPS) into ``.ckptio-slots`` beside the steps, older slots into a dropped step,
removed with it; ``warm_slots`` maps them ahead; ``drop_slots`` (the manager's close) removes
them. A save is mapped only where ``warm_fit`` says slots of its files' sizes are mapped ahead:
otherwise the call would allocate and fault fresh pages, and the staging pool is faster.

Hand-written through ctypes: os.statvfs has no filesystem type (statfs's f_type is what tells
tmpfs), Python's mmap refuses to unmap while a tensor views it, and os.rename replaces its
target (renameat2 with RENAME_NOREPLACE does not). Linux only; elsewhere nothing is on tmpfs.

Owns: the mappings, their cache, the slot directory. Does not own: what is copied into the
pages (saving/mapped_regions.py, saving/persist.py), which steps are dropped (the manager).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ckptio.errors import StorageIOError

__all__ = ["SLOTS_DIR", "SLOT_STEPS", "MappedFile", "borrow", "drop_slots", "forget", "keep_slots",
           "make_slots", "on_tmpfs", "open_file", "release", "slot_nbytes", "warm_fit",
           "warm_slots"]

log = logging.getLogger("ckptio")
TMPFS_MAGIC = 0x01021994  # statfs f_type of tmpfs (linux/magic.h)
SLOTS_DIR = ".ckptio-slots"  # beside a root's steps: never a step name, never listed
SLOT_STEPS = 2  # the dropped steps whose data files a root keeps as slots, at most
DATA_PREFIX = "data-"  # the data files (planning/layout.py's names): what a slot keeps
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_PROT_READ_WRITE = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_POPULATE = 0x8000
_MAP_FAILED = ctypes.c_void_p(-1).value


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


_lock = threading.Lock()
_cache: dict[tuple[int, int], MappedFile] = {}
_ticks = 0
_libc: ctypes.CDLL | None = None


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.mmap.restype = ctypes.c_void_p
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        if hasattr(lib, "renameat2"):
            lib.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                      ctypes.c_char_p, ctypes.c_uint]
        _libc = lib
    return _libc


def on_tmpfs(path: str) -> bool:
    """Whether ``path`` (or its nearest existing parent) lies on a tmpfs."""
    if not sys.platform.startswith("linux"):
        return False
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field
    try:
        if _c().statfs(os.fsencode(path), buf) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return (ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF) == TMPFS_MAGIC


def open_file(path: str, nbytes: int) -> MappedFile:
    """``path`` (which must not exist) of ``nbytes``, mapped whole and writable: a slot file
    of the root two levels up when there is one, else a new file. StorageIOError if it cannot
    be made (tmpfs full: fallocate fails before any byte is copied)."""
    with _lock:
        _prune()
    reused = _take_slot(path, nbytes)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | (0 if reused else os.O_CREAT | os.O_EXCL),
                     0o644)
    except OSError as exc:
        raise StorageIOError(f"creating {path} failed: {exc.strerror or exc}") from None
    try:
        key = _sized(fd, nbytes)
        with _lock:
            entry = _cache.pop(key, None)
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
    with _lock:
        global _ticks
        _ticks += 1
        entry.tick = _ticks
        _cache[entry.key] = entry
        _bound()
    return entry


def _sized(fd: int, nbytes: int) -> tuple[int, int]:
    """Make the file ``nbytes`` long with every page allocated -> its (st_dev, st_ino)."""
    info = os.fstat(fd)
    if info.st_size != nbytes:
        os.ftruncate(fd, nbytes)
        info = os.fstat(fd)
    if nbytes and info.st_blocks * 512 < nbytes:
        os.posix_fallocate(fd, 0, nbytes)
    return info.st_dev, info.st_ino


def _map(fd: int, nbytes: int, *, populate: bool = False) -> int:
    if nbytes == 0:
        return 0
    flags = _MAP_SHARED | (_MAP_POPULATE if populate else 0)
    address = _c().mmap(None, nbytes, _PROT_READ_WRITE, flags, fd, 0)
    if address in (None, _MAP_FAILED):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(address)


def _unmap(entry: MappedFile) -> None:
    for hook in entry.on_unmap:
        hook()
    entry.on_unmap.clear()
    entry.kept.clear()
    if entry.address:
        _c().munmap(entry.address, entry.nbytes)
        entry.address = 0
    if entry.fd >= 0:  # held open while cached: its inode (the cache key) is never reused
        os.close(entry.fd)
        entry.fd = -1


def release(entry: MappedFile, *, keep: bool = True) -> None:
    """The save is done with ``entry``: kept for a later save of its file (``keep``, and its
    root keeps slots: elsewhere no save takes the file again), else unmapped now (a failed
    save, whose files are removed)."""
    keep = keep and os.path.isdir(_slots_of(entry.path))
    with _lock:
        entry.in_use = False
        if keep:
            return
        if _cache.get(entry.key) is entry:
            del _cache[entry.key]
    _unmap(entry)


def borrow(path: str) -> MappedFile | None:
    """The idle mapping this process holds of file ``path`` (a save here wrote it), in use
    until ``release(entry)``: a load copies out of its pages, no read and no page faults;
    None where there is none (another process's file: read() is the one copy there)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    with _lock:
        entry = _cache.get((info.st_dev, info.st_ino))
        if entry is None or entry.in_use or entry.nbytes != info.st_size:
            return None
        entry.in_use = True
        return entry


def forget() -> None:
    """Unmap every cached mapping no save uses (a Checkpointer closing)."""
    with _lock:
        idle = [e for e in _cache.values() if not e.in_use]
        for entry in idle:
            del _cache[entry.key]
    for entry in idle:
        _unmap(entry)


def _prune() -> None:
    """Under _lock: unmap the cached files unlinked since (their pages are freed then)."""
    for key, entry in list(_cache.items()):
        if entry.in_use:
            continue
        try:
            gone = os.fstat(entry.fd).st_nlink == 0
        except OSError:
            gone = True
        if gone:
            del _cache[key]
            _unmap(entry)


def _bound() -> None:
    """Under _lock: the least recently used idle mappings go while the cache maps more than
    the host's memory."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    total = sum(e.nbytes for e in _cache.values())
    for entry in sorted(_cache.values(), key=lambda e: e.tick):
        if total <= limit:
            break
        if not entry.in_use:
            del _cache[entry.key]
            _unmap(entry)
            total -= entry.nbytes


# ---------------------------------------------------------------- slots


def _take_slot(path: str, nbytes: int) -> bool:
    """Rename the best-sized slot file of ``path``'s root (two levels up) to ``path``."""
    slots = _slots_of(path)
    try:
        with os.scandir(slots) as it:
            found = [(e.stat(follow_symlinks=False), e.path) for e in it
                     if e.is_file(follow_symlinks=False)]
    except OSError:
        return False
    with _lock:  # the best fit: of the size, mapped here already, else the nearest size
        mapped = {key for key, entry in _cache.items() if not entry.in_use}
    found.sort(key=lambda s: (s[0].st_size != nbytes, (s[0].st_dev, s[0].st_ino) not in mapped,
                              s[0].st_size < nbytes, abs(s[0].st_size - nbytes)))
    for _info, source in found:
        code = _rename_noreplace(source, path)
        if code == 0:
            return True
        if code != errno.ENOENT:  # EEXIST (the create says so), or no renameat2: a new file
            return False
    return False


def _slots_of(path: str) -> str:
    """The slot directory of a step's file ``path`` (its root's)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), SLOTS_DIR)


def _rename_noreplace(source: str, target: str) -> int:
    """rename(2) that never replaces ``target`` -> 0 or the errno."""
    lib = _c()
    if not hasattr(lib, "renameat2"):
        return errno.ENOSYS
    if lib.renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target),
                     _RENAME_NOREPLACE) == 0:
        return 0
    return ctypes.get_errno()


def keep_slots(root: str, dropped: Sequence[tuple[int, str]]) -> None:
    """Of the dropped step directories ``dropped`` ((step, directory), oldest first), make the
    data files of the newest steps the slots of ``root``, with the slots held before: the
    newest SLOT_STEPS steps' files are kept, the older ones go into the newest dropped
    directory, removed with it. Two steps drop at once where one was pinned (a drain copying
    it): keeping both keeps the ring big enough that the next pin finds a slot too. A failure
    is logged: the removal deletes what is left."""
    if not dropped:
        return
    newest, slots = dropped[-1][1], os.path.join(root, SLOTS_DIR)
    try:
        fresh = [(step, _data_files(directory)) for step, directory in dropped[-SLOT_STEPS:]]
        fresh = [(step, files) for step, files in fresh if files]
        if not fresh:
            return
        os.makedirs(slots, exist_ok=True)
        with os.scandir(slots) as it:
            held = [(e.path, e.name) for e in it]
        keep = sorted({step for step, _ in fresh} | {_slot_step(n) for _, n in held})
        keep = keep[-SLOT_STEPS:]
        for source, name in held:
            if _slot_step(name) not in keep:
                os.rename(source, os.path.join(newest, f"old-slot-{name}"))
        for step, files in fresh:
            if step in keep:
                for source in files:
                    os.rename(source, os.path.join(slots, f"{step}.{os.path.basename(source)}"))
    except OSError as exc:
        log.warning("ckptio: could not keep the pages of %s for later saves (%s); they are "
                    "removed with it", newest, exc)


def _data_files(directory: str) -> list[str]:
    with os.scandir(directory) as it:
        return [e.path for e in it
                if e.name.startswith(DATA_PREFIX) and e.is_file(follow_symlinks=False)]


def _slot_step(name: str) -> int:
    """The dropped step a slot file came from (``<step>.<data file>``; -1: unknown, oldest)."""
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def make_slots(root: str, sizes: Sequence[int], sets: int) -> None:
    """Slot files of ``sizes`` for ``root``'s first ``sets`` saves, every page allocated (a
    manager's prepare: its memory tier's first saves then copy into slots mapped ahead, not
    through the pool). Sizes held already count: dropped steps' files and this process's own
    (another rank's are its own). Named as the oldest dropped step (``prepared.*``), so a
    dropped step's files outrank them."""
    slots, mine = os.path.join(root, SLOTS_DIR), f"prepared.{os.getpid()}."
    os.makedirs(slots, exist_ok=True)
    with os.scandir(slots) as it:
        held = [e.stat(follow_symlinks=False).st_size for e in it
                if e.is_file(follow_symlinks=False)
                and (e.name.startswith(mine) or not e.name.startswith("prepared."))]
    for index, size in enumerate(sorted(list(sizes) * sets)):
        if size in held:
            held.remove(size)
            continue
        fd = os.open(os.path.join(slots, f"{mine}{index:04d}.{size}"),
                     os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _sized(fd, size)
        finally:
            os.close(fd)


def warm_slots(root: str, on_mapped: Callable[[MappedFile], object] | None = None) -> None:
    """Map ``root``'s slot files here with every page-table entry populated (MAP_POPULATE), so
    the save that takes one copies into resident, mapped pages (the retention's pass, before
    the next save: only slots written through the staging pool cost anything, a mapped save's
    files are mapped here already and left as they are). ``on_mapped``: called with each
    newly mapped slot (page-locking it for device copies)."""
    try:
        with os.scandir(os.path.join(root, SLOTS_DIR)) as it:
            paths = [e.path for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # taken by a save meanwhile
        entry = _warm(path, fd)
        if entry is not None and on_mapped is not None:
            on_mapped(entry)


def _warm(path: str, fd: int) -> MappedFile | None:
    """Cache a populated mapping of the open slot file ``fd`` (closed if not kept) -> the new
    mapping, None where none was made."""
    try:
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino)
        with _lock:
            known = key in _cache
        if known or not info.st_size:
            os.close(fd)
            return None
        entry = MappedFile(path, info.st_size, _map(fd, info.st_size, populate=True), fd, key,
                           True, in_use=False)
    except OSError as exc:
        os.close(fd)
        log.info("ckptio: could not map the slot %s ahead of the next save (%s)", path, exc)
        return None
    global _ticks
    with _lock:
        if key not in _cache:
            _ticks += 1
            entry.tick = _ticks
            _cache[key] = entry
            _bound()
            return entry
    _unmap(entry)  # a save mapped it meanwhile
    return None


def warm_fit(directory: str, sizes: Sequence[int]) -> bool:
    """Whether the slot files beside step directory ``directory`` that this process has mapped
    and no save uses hold files of exactly ``sizes``, one each: a save of those files then
    copies into resident, mapped pages, never allocating or faulting one (a slot of another
    size would be resized and mapped afresh inside the save's call)."""
    slots = os.path.join(os.path.dirname(os.path.abspath(directory)), SLOTS_DIR)
    try:
        with os.scandir(slots) as it:
            found = [e.stat(follow_symlinks=False) for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return False
    with _lock:
        warm = sorted(i.st_size for i in found if (entry := _cache.get((i.st_dev, i.st_ino)))
                      is not None and not entry.in_use and entry.nbytes == i.st_size)
    for size in sorted(sizes):
        if size in warm:
            warm.remove(size)
        elif size:
            return False
    return True


def slot_nbytes(root: str) -> int:
    """Bytes of ``root``'s slots: free for its next save, which takes them."""
    try:
        with os.scandir(os.path.join(root, SLOTS_DIR)) as it:
            return sum(e.stat(follow_symlinks=False).st_size for e in it
                       if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


def drop_slots(root: str) -> None:
    """Remove ``root``'s slots (no later save of this manager takes them) and unmap this
    process's mappings of files removed: their pages go back to the host."""
    shutil.rmtree(os.path.join(root, SLOTS_DIR), ignore_errors=True)
    with _lock:
        _prune()
