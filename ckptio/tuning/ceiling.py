"""The raw disk ceiling, measured from Python: what the storage gives to large O_DIRECT I/O.

Owns: a timed O_DIRECT sequential write of N bytes (posix_fallocate, page-aligned mmap buffers of
8 MiB, 4 threads doing os.pwrite, fsync) and a timed cold O_DIRECT sequential read of the same
file, plus dropping the page cache. Chunk size and thread count are parameters (GEOMETRIES).
Does not own: any engine or the protocol of the peer benchmarks (benchmarks/engines.py,
benchmarks/save_load.py, which call this module, as the I/O study does). The write clock runs
from creating the file to fsync returning, as an engine's would; the fallocate share is reported
apart.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptio.alignment import align_up

__all__ = ["GEOMETRIES", "Writer", "drop_page_cache", "read_ceiling", "write_ceiling"]

CHUNK = 8 << 20
THREADS = 4
# Geometries tried every repetition; the ceiling is the best of them, so it is never weaker than
# ckptio's own pattern (16 MiB x 4 in flight): fio's --bs=8M --iodepth=16 sits between these.
GEOMETRIES: tuple[tuple[int, int], ...] = ((8 << 20, 4), (32 << 20, 8))
DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache(paths: Iterable[Path] = ()) -> str:
    """sync + drop_caches as root; else POSIX_FADV_DONTNEED on every file under ``paths``.

    Returns the method used, so results say how cold the load was.
    """
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        for root in paths:
            for file in _files_under(Path(root)):
                _fadvise_dontneed(file)
        return "fadvise"


def _files_under(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return [p for p in root.rglob("*") if p.is_file()]


def _fadvise_dontneed(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Buffers:
    """One page-aligned, pre-faulted ``chunk``-byte buffer per worker thread, reused."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._local = threading.local()
        self._all: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def get(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = mmap.mmap(-1, self.chunk)
            buf.write(bytes(range(256)) * (self.chunk // 256))  # fault every page before I/O
            self._local.buf = buf
            with self._lock:
                self._all.append(buf)
        return buf

    def close(self) -> None:
        for buf in self._all:
            buf.close()


def _chunks(nbytes: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """(offset, length) pairs covering ``nbytes`` rounded up to the O_DIRECT block."""
    total = align_up(nbytes)
    return [(off, min(chunk, total - off)) for off in range(0, total, chunk)]


def _warm_buffers(pool: ThreadPoolExecutor, buffers: _Buffers, threads: int) -> None:
    """Start every pool thread and fault its buffer before the clock starts."""
    barrier = threading.Barrier(threads)

    def touch(_: int) -> None:
        buffers.get()
        barrier.wait()

    list(pool.map(touch, range(threads)))


Transfer = Callable[[int, memoryview, int], int]  # (fd, buffer, file offset) -> bytes moved


def _io(fn: Transfer, buffers: _Buffers) -> Callable[[int, tuple[int, int]], int]:
    """Adapt a (fd, view, offset) transfer to one chunk through this thread's buffer."""

    def run(fd: int, chunk: tuple[int, int]) -> int:
        off, length = chunk
        view = memoryview(buffers.get())[:length]
        try:
            return fn(fd, view, off)
        finally:
            view.release()

    return run


class Writer:
    """O_DIRECT sequential writes of whole files through ``threads`` threads, each with its own
    pre-faulted ``chunk``-byte buffer, made (threads started, buffers faulted) before any clock
    starts and reused for every file: what one rank of a raw N-writer ceiling does."""

    def __init__(self, chunk: int = CHUNK, threads: int = THREADS) -> None:
        self.chunk = chunk
        self._buffers = _Buffers(chunk)
        self._pool = ThreadPoolExecutor(threads)
        _warm_buffers(self._pool, self._buffers, threads)
        self._write = _io(_write_full, self._buffers)

    def write(self, path: Path, nbytes: int) -> dict[str, float]:
        """Write ``nbytes`` (rounded up to 4 KiB) to a new ``path``; timed to fsync done."""
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.posix_fallocate(fd, 0, align_up(nbytes))
            t_alloc = time.perf_counter() - t0
            chunks = _chunks(nbytes, self.chunk)
            written = sum(self._pool.map(lambda c: self._write(fd, c), chunks))
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"bytes": float(written), "seconds": time.perf_counter() - t0, "fallocate_s": t_alloc}

    def close(self) -> None:
        self._pool.shutdown()
        self._buffers.close()


def write_ceiling(path: Path, nbytes: int, chunk: int = CHUNK,
                  threads: int = THREADS) -> dict[str, float | str]:
    """O_DIRECT sequential write of ``nbytes`` (rounded up to 4 KiB); timed to fsync done."""
    writer = Writer(chunk, threads)
    try:
        return dict(writer.write(path, nbytes))
    finally:
        writer.close()


def _write_full(fd: int, view: memoryview, offset: int) -> int:
    """pwrite until done (a short O_DIRECT write is rare; a retry stays block-aligned)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def read_ceiling(path: Path, idle: float = 0.0, chunk: int = CHUNK,
                 threads: int = THREADS) -> dict[str, float | str]:
    """Cold O_DIRECT sequential read of the whole file written by write_ceiling.

    Waits ``idle`` seconds after dropping the page cache, as the engines' loads do: right after a
    drop this VM is busy handing the freed pages back to the host."""
    nbytes = path.stat().st_size
    buffers = _Buffers(chunk)
    read = _io(_read_full, buffers)
    with ThreadPoolExecutor(threads) as pool:
        _warm_buffers(pool, buffers, threads)
        method = drop_page_cache([path])
        time.sleep(idle)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            got = sum(pool.map(lambda c: read(fd, c), _chunks(nbytes, chunk)))
        finally:
            os.close(fd)
        seconds = time.perf_counter() - t0
    buffers.close()
    return {"bytes": float(got), "seconds": seconds, "cache_drop": method}


def _read_full(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"unexpected end of file at byte {offset + done}")
        done += n
    return done
