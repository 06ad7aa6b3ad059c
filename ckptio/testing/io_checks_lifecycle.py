"""The IOBackend checks of a backend's life: data kept after a close with and without sync
and read by a new backend, shutdown then reuse leaving no thread or file descriptor behind,
registered buffers, and pickling before and after use.

Call order: each ``check_*(factory)`` runs one group of checks and raises AssertionError (or
the backend's own error); io_conformance.py runs them all, or as pytest tests.

Owns: these checks. Does not own: their shared helpers (io_check_tools.py), the data and
refusal checks (io_checks_data.py, io_checks_refusals.py), the limits a check may be skipped
for (io_conformance.py).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptio.alignment import BLOCK
from ckptio.io.buffers import Buffer
from ckptio.options import MiB
from ckptio.storage.files import StoreFiles
from ckptio.testing.io_check_tools import (
    Factory,
    data_file,
    open_handles,
    opened,
    random_bytes,
    read_whole,
    result_of,
    staging_pool,
    stored_bytes,
    write_whole,
)

__all__ = [
    "check_close_sync_and_reopen",
    "check_close_without_sync_keeps_data",
    "check_picklable",
    "check_register_buffers",
    "check_shutdown_closes_fds",
    "check_shutdown_then_reuse",
]


def _read_pieces(files: StoreFiles, name: str, nbytes: int, bufs: list[Buffer]) -> bytes:
    """``nbytes`` of ``name`` through ``files``' backend, a buffer a read, all in flight."""
    with open_handles(files) as handles:
        fh = handles.read(name)
        for b in bufs:
            b.view[:] = bytes(b.nbytes)
        starts = range(0, nbytes, MiB)
        futures = [files.submit_read(fh, start, bufs[k].view[:min(MiB, nbytes - start)])
                   for k, start in enumerate(starts)]
        got = b"".join(bytes(bufs[k].view[:result_of(f)]) for k, f in enumerate(futures))
        handles.close(fh, sync=False)
    return got


def _reopened(factory: Factory, sync: bool) -> None:
    """A file of several buffers closed with ``sync`` reads back through the store, the writing
    backend and a new backend (another factory call's: one backend reaches every store of its
    kind)."""
    name = data_file(0)
    nbytes = 6 * MiB + BLOCK  # several buffers (for an object store, several parts)
    data = random_bytes(nbytes, seed=int(sync))
    with opened(factory) as files, opened(factory) as other, staging_pool(7) as pool:
        bufs = [pool.acquire() for _ in range(7)]
        with open_handles(files) as handles:
            fh = handles.write(name, nbytes)
            futures = []
            for k, start in enumerate(range(0, nbytes, MiB)):
                piece = data[start:start + MiB]
                bufs[k].view[:len(piece)] = piece
                view = bufs[k].view[:len(piece)]
                futures.append((len(piece), files.submit_write(fh, start, view)))
            assert all(result_of(f) == n for n, f in futures), "a write's future must give len(data)"
            handles.close(fh, sync=sync)
        assert stored_bytes(files, name, 0, nbytes) == data, (
            f"data closed with sync={sync} is not stored")
        assert _read_pieces(files, name, nbytes, bufs) == data, f"sync={sync}: re-open read wrong"
        fresh = StoreFiles(files.store, other.backend)
        assert _read_pieces(fresh, name, nbytes, bufs) == data, (
            f"data closed with sync={sync} read wrong through a new backend")


def check_close_sync_and_reopen(factory: Factory) -> None:
    """Data closed with sync=True is there when reopened, by the same and by a new backend
    (and, through the store, before any reopening)."""
    _reopened(factory, sync=True)


def check_close_without_sync_keeps_data(factory: Factory) -> None:
    """Data closed with sync=False is there too (not durable yet, but kept)."""
    _reopened(factory, sync=False)


def _settled(current: Callable[[], set[Any]], expected: set[Any]) -> set[Any]:
    """``current()``, waiting briefly for what other threads are just closing (a listdir's fd,
    a worker on its way out) to go: a bounded wait, not a timing assertion."""
    now = current()
    for _ in range(50):
        if now <= expected:
            break
        time.sleep(0.02)
        now = current()
    return now


def _open_fds() -> set[str]:
    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:
        return set()


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


def _shut_down_and_reused(factory: Factory) -> None:
    """shutdown() on an unused backend, twice in a row and between uses: each round after a
    shutdown still writes and reads the right bytes."""
    with staging_pool(1) as pool:
        buf = pool.acquire()
        files = factory()
        files.backend.shutdown()  # never used
        try:
            for round_ in range(3):
                data = random_bytes(256 * 1024, seed=round_)
                write_whole(files, data_file(round_), data, buf)
                assert read_whole(files, data_file(round_), len(data), buf) == data, (
                    f"round {round_} after shutdown read the wrong bytes")
                assert stored_bytes(files, data_file(round_)) == data, f"round {round_}: wrong bytes stored"
                files.backend.shutdown()
        finally:
            files.backend.shutdown()


def check_shutdown_then_reuse(factory: Factory) -> None:
    """The backend works after any shutdown(), and after the last one no thread it started is
    running (workers joined, reapers stopped)."""
    before = _threads()
    _shut_down_and_reused(factory)
    left = _settled(_threads, before) - before
    assert not left, f"threads still running after shutdown(): {sorted(t.name for t in left)}"


def check_shutdown_closes_fds(factory: Factory) -> None:
    """After the last shutdown() the backend holds no file descriptor (files, rings, eventfds)."""
    before = _open_fds()
    _shut_down_and_reused(factory)
    leaked = _settled(_open_fds, before) - before
    assert not leaked, f"file descriptors left open after shutdown(): {sorted(leaked)}"


def check_register_buffers(factory: Factory) -> None:
    """register_buffers(the whole pool) answers a bool, False where the store's capabilities
    say its backend never pins (registered_buffers=False); transfers from the registered pool,
    and from memory outside it, move the right bytes."""
    name = data_file(0)
    with opened(factory) as files, open_handles(files) as handles, staging_pool(4) as pool, \
            staging_pool(1) as outside:
        registered = files.backend.register_buffers(pool.whole_view())
        assert isinstance(registered, bool), f"register_buffers gave {registered!r}, not a bool"
        if not files.store.capabilities.registered_buffers:
            assert registered is False, "a backend pinned buffers its store says it cannot"
        bufs = [pool.acquire() for _ in range(4)] + [outside.acquire()]
        fh = handles.write(name, len(bufs) * MiB)
        for i, b in enumerate(bufs):
            b.view[:] = random_bytes(MiB, seed=30 + i)
        assert [result_of(files.submit_write(fh, i * MiB, b.view)) for i, b in enumerate(bufs)] == (
            [MiB] * len(bufs))
        handles.close(fh, sync=True)
        expect = b"".join(random_bytes(MiB, seed=30 + i) for i in range(len(bufs)))
        assert stored_bytes(files, name) == expect, "bytes written from registered buffers differ"
        for b in bufs:
            b.view[:] = bytes(MiB)
        fh = handles.read(name)
        assert [result_of(files.submit_read(fh, i * MiB, b.view)) for i, b in enumerate(bufs)] == (
            [MiB] * len(bufs))
        handles.close(fh, sync=False)
        assert b"".join(bytes(b.view) for b in bufs) == expect, (
            "reads into registered buffers differ")


def _round_trip(files: StoreFiles, name: str, seed: int, buf: Buffer) -> None:
    data = random_bytes(BLOCK, seed=seed)
    write_whole(files, name, data, buf)
    assert stored_bytes(files, name) == data, f"{files.where(name)} holds the wrong bytes"
    assert read_whole(files, name, BLOCK, buf) == data, f"{files.where(name)} read back wrong"


def check_picklable(factory: Factory) -> None:
    """A backend pickles before use and after use (no fds, threads or rings made in __init__,
    none carried across); the copies and the original all work."""
    with opened(factory) as files, staging_pool(1) as pool:
        buf = pool.acquire()
        copies = [pickle.loads(pickle.dumps(files.backend))]
        _round_trip(files, data_file(0), 9, buf)  # used: threads and rings now exist
        copies.append(pickle.loads(pickle.dumps(files.backend)))
        for k, copy in enumerate([*copies, files.backend]):
            assert type(copy) is type(files.backend)
            try:
                _round_trip(StoreFiles(files.store, copy), data_file(1 + k), 20 + k, buf)
            finally:
                if copy is not files.backend:
                    copy.shutdown()
