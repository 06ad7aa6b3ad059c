"""POSIX backend: pwrite/preadv on a small thread pool, O_DIRECT where the filesystem allows.

Owns: file opening flags, preallocation, the buffered fallback (logged once per filesystem),
short-transfer loops and turning OSError into StorageIOError naming file and offset.
Threads are created on first use, never in __init__, so the backend can be pickled.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ckptio.errors import StorageIOError
from ckptio.io.backend_contract import FileHandle, Filled

# _error (an OSError as the StorageIOError every backend raises) is shared with uring.py.
__all__ = ["PosixBackend", "_error", "os_hint"]

log = logging.getLogger("ckptio")
READ_CHUNK = 1 << 20  # bytes per system call of submit_reads: hashed while still in cache


class PosixBackend:
    name = "posix"

    def __init__(self, *, depth: int = 4, direct_io: str = "auto") -> None:
        self.depth = depth
        self.direct_io = direct_io
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._warned_devices: set[int] = set()

    def __getstate__(self) -> dict[str, object]:
        return {"depth": self.depth, "direct_io": self.direct_io}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(depth=state["depth"], direct_io=state["direct_io"])  # type: ignore[misc]

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="ckptio-io")
            return self._pool

    def open_write(self, path: str, nbytes: int) -> FileHandle:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        fh = self._open(path, flags, 0o644)
        try:
            if nbytes:
                _preallocate(fh.token, nbytes)
        except OSError as exc:
            os.close(fh.token)
            raise _error("preallocating", path, 0, exc) from None
        return fh

    def open_read(self, path: str, *, cached: bool = False) -> FileHandle:
        if not cached:
            return self._open(path, os.O_RDONLY | os.O_CLOEXEC, 0)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise _error("opening", path, 0, exc) from None
        with contextlib.suppress(OSError):  # a hint: only the bytes asked for, no read-ahead of
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # what other reads take directly
        return FileHandle(path, fd, False)

    def _open(self, path: str, flags: int, mode: int) -> FileHandle:
        try:
            fd = os.open(path, flags, mode)
        except OSError as exc:
            raise _error("opening", path, 0, exc) from None
        if self.direct_io == "off":
            return FileHandle(path, fd, False)
        # O_DIRECT is switched on after the open: a filesystem that refuses it at open() would
        # already have created the file, and a retry with O_EXCL would then fail.
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
            return FileHandle(path, fd, True)
        except OSError as exc:
            if exc.errno != errno.EINVAL or self.direct_io == "on":
                os.close(fd)
                raise _error("enabling O_DIRECT on", path, 0, exc) from None
        self._warn_buffered(path)
        return FileHandle(path, fd, False)

    def _warn_buffered(self, path: str) -> None:
        device = os.stat(os.path.dirname(os.path.abspath(path))).st_dev
        with self._lock:
            if device in self._warned_devices:
                return
            self._warned_devices.add(device)
        log.warning("ckptio: the filesystem holding %s refuses O_DIRECT; using buffered I/O "
                    "with fsync there", os.path.dirname(os.path.abspath(path)))

    def submit_write(self, fh: FileHandle, offset: int, data: memoryview) -> Future[int]:
        return self._executor().submit(_pwrite_all, fh, offset, data)

    def submit_read(self, fh: FileHandle, offset: int, into: memoryview) -> Future[int]:
        return self._executor().submit(_pread_all, fh, offset, into)

    def submit_reads(self, fh: FileHandle, reads: Sequence[tuple[int, memoryview]],
                     each: Filled) -> Future[int]:
        """backend_contract.BatchReads: every read in order on one thread, READ_CHUNK bytes per
        system call, ``each`` after each (while its bytes are still in the core's cache)."""
        return self._executor().submit(_pread_each, fh, reads, each)

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        try:
            if sync:
                os.fsync(fh.token)
        except OSError as exc:
            raise _error("fsync", fh.path, 0, exc) from None
        finally:
            os.close(fh.token)

    def register_buffers(self, view: memoryview, *, part_bytes: int = 0) -> bool:
        """No fixed buffers here: every request maps its own."""
        return False

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _preallocate(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise  # ENOSPC here is the cheapest moment to learn the disk is full
        os.ftruncate(fd, nbytes)


def _pwrite_all(fh: FileHandle, offset: int, data: memoryview) -> int:
    done = 0
    try:
        while done < len(data):
            n = os.pwrite(fh.token, data[done:], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0 bytes")
            done += n
    except OSError as exc:
        raise _error("writing", fh.path, offset + done, exc) from None
    return done


def _pread_all(fh: FileHandle, offset: int, into: memoryview) -> int:
    done = 0
    try:
        while done < len(into):
            n = os.preadv(fh.token, [into[done:]], offset + done)
            if n == 0:
                break  # end of file: the caller compares against the expected length
            done += n
    except OSError as exc:
        raise _error("reading", fh.path, offset + done, exc) from None
    return done


def _pread_each(fh: FileHandle, reads: Sequence[tuple[int, memoryview]], each: Filled) -> int:
    total = 0
    for i, (offset, into) in enumerate(reads):
        done = 0
        try:
            while done < len(into):
                n = os.preadv(fh.token, [into[done:done + READ_CHUNK]], offset + done)
                if n == 0:
                    break  # end of file: ``each`` sees the read end short
                done += n
                each(i, done, done == len(into))
        except OSError as exc:
            raise _error("reading", fh.path, offset + done, exc) from None
        if done < len(into) or not into:
            each(i, done, True)
        total += done
    return total


def _error(what: str, path: str, offset: int, exc: OSError) -> StorageIOError:
    return StorageIOError(f"{what} {path} at byte {offset} failed: {exc.strerror or exc}; "
                          f"{os_hint(exc)}")


def os_hint(exc: OSError) -> str:
    """What to do about ``exc`` (a full disk: free space; a read-only file system...), for
    the message of a failed file call."""
    return {
        errno.ENOSPC: "the disk is full: free space or save elsewhere",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EACCES: "permission denied: check the directory's owner and mode, or save "
                      "elsewhere",
        errno.EROFS: "the filesystem is read-only: remount it read-write, or save elsewhere",
        errno.EEXIST: "a file of that name already exists (another save running?)",
        errno.ENOENT: "the file is missing (removed or never written)",
    }.get(exc.errno or 0, "see the OS error")
