"""The conformance suite every IOBackend passes, reached as the save and load paths reach it:
through a store, by file name (the contracts: ckptio/io/backend_contract.py, ckptio/storage/files.py).

Every check gets its files from ``StoreFiles(store, backend)`` and names files, never paths;
what was written is read back through the store itself (``Store.read_file``, ``Store.sizes``)
as well as through the backend, so a backend that misplaces bytes symmetrically on write and
read still fails. The same checks run on a directory (posix, io_uring), host memory and an S3
bucket, with StagingPool buffers as in real saves and loads. No check measures time.

Call order, pytest: subclass ``IOBackendConformance`` and give it a ``files_factory`` fixture
(how: on the class); plain: each ``check_*(factory)`` runs one group of checks and raises
AssertionError (or the backend's own error); ``run_all(factory, limits=...)`` runs them all.
Only the checks in ``LIMITABLE`` may be declared unmeetable, each for the reason given there.

Owns: the checks, their helpers, the limits a check may be skipped for. Does not own: the
backends (ckptio/io/), the stores and their naming (ckptio/storage/), the Store checks
(store_conformance.py).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, ClassVar

import pytest

from ckptio.alignment import BLOCK
from ckptio.errors import StorageIOError
from ckptio.io.backend_contract import FileHandle, IOBackend
from ckptio.io.buffers import Buffer
from ckptio.io.stage import StagingPool
from ckptio.options import MiB, Options
from ckptio.storage.files import Capabilities, StoreFiles
from ckptio.storage.store_contract import Store
from ckptio.testing.store_conformance import data_name

Factory = Callable[[], StoreFiles]
TIMEOUT = 120.0  # seconds a single request may take before the check gives up (a hang, not speed)
SAVE_ID = "0123456789abcdef012"  # every location is fresh, so one save id serves every check

__all__ = [
    "CHECKS",
    "LIMITABLE",
    "Factory",
    "IOBackendConformance",
    "check_close_sync_and_reopen",
    "check_close_without_sync_keeps_data",
    "check_errors_come_through_futures",
    "check_limits",
    "check_many_in_flight",
    "check_offsets_past_4gib",
    "check_open_write_existing_fails",
    "check_open_write_twice_fails",
    "check_picklable",
    "check_preallocates",
    "check_protocol",
    "check_read_missing_fails",
    "check_read_past_end",
    "check_register_buffers",
    "check_roundtrip_many_offsets",
    "check_several_files",
    "check_shutdown_closes_fds",
    "check_shutdown_then_reuse",
    "check_unwritten_reads_zeros",
    "fresh_files",
    "run_all",
]

# The checks an implementation may declare it cannot meet, and what each relies on that some
# kind of storage does not have. An implementation declares ``{check: why}`` (``limits``).
LIMITABLE: dict[str, str] = {
    "offsets_past_4gib": "a file grows sparsely past the size given to open_write, to offsets "
                         "beyond 4 GiB (a dense file costs its size in memory; an object's "
                         "parts are fixed at open_write and it is uploaded whole)",
    "preallocates": "a file exists, at its full size, from open_write on (an object store "
                    "makes an object visible only when its upload completes)",
    "open_write_twice_fails": "a file being written already exists for a second open_write "
                              "(an object exists only once its upload completes)",
    "close_without_sync_keeps_data": "close(sync=False) keeps what was written (an object "
                                     "store's backend abandons the upload instead)",
    "shutdown_closes_fds": "every file descriptor the backend used is its own (an object "
                           "store's connections belong to a client shared by the process)",
}


# -- helpers ---------------------------------------------------------------------------------

def fresh_files(make: Callable[[str], Store], options: Options) -> Factory:
    """A factory over ``make(key)`` (a store at the location for ``key``, as StoreConformance's
    store_factory): each call takes a new key, prepares the store and makes it a new backend."""
    keys = itertools.count()

    def factory() -> StoreFiles:
        store = make(f"io-{next(keys)}")
        store.prepare()
        return StoreFiles(store, store.backend(options))

    return factory


def check_limits(limits: Mapping[str, str]) -> None:
    """Every declared limit names a check in LIMITABLE and says why (ValueError otherwise)."""
    for check, why in limits.items():
        if check not in LIMITABLE:
            raise ValueError(f"limit {check!r}: only {sorted(LIMITABLE)} may be declared "
                             "unmeetable; every other check is the contract itself")
        if not isinstance(why, str) or not why.strip():
            raise ValueError(f"limit {check!r}: say why the implementation cannot meet it")


def _pattern(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def _name(index: int) -> str:
    """A data file name as a ckptio save makes it (stores may care: S3 lists only these)."""
    return data_name(index, SAVE_ID)


@contextlib.contextmanager
def _staging_pool(nbuffers: int, buffer_bytes: int = MiB) -> Iterator[StagingPool]:
    """A fresh pool for one check. Not closed explicitly: views of its buffers may still be
    referenced by the check's locals (mmap.close() refuses then); it is freed with them."""
    yield StagingPool(nbuffers, buffer_bytes)


def _done(future: Future[int]) -> int:
    return future.result(timeout=TIMEOUT)


@contextlib.contextmanager
def _opened(factory: Factory) -> Iterator[StoreFiles]:
    files = factory()
    try:
        yield files
    finally:
        files.backend.shutdown()


def _stored(files: StoreFiles, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
    """What the store itself (not the backend under test) holds."""
    return files.store.read_file(name, offset, nbytes)


def _size(files: StoreFiles, name: str) -> int | None:
    return files.store.sizes([name]).get(name)


def _names_it(error: BaseException, files: StoreFiles, name: str) -> None:
    where = files.where(name)
    assert where in str(error), f"the error must name the file ({where}): {error}"


class _Handles:
    """Handles opened during a check, closed (without sync) if the check fails midway. Every
    handle is checked: it names what the store says messages name, and it is direct only where
    the store can do direct I/O (and as ``expect_direct`` says, when given)."""

    def __init__(self, files: StoreFiles, expect_direct: bool | None) -> None:
        self.files, self.expect_direct = files, expect_direct
        self.open: list[FileHandle] = []

    def write(self, name: str, nbytes: int) -> FileHandle:
        return self._checked(name, self.files.open_write(name, nbytes))

    def read(self, name: str, *, cached: bool = False) -> FileHandle:
        fh = self._checked(name, self.files.open_read(name, cached=cached), cached)
        assert not (cached and fh.direct), f"{fh.path}: opened cached, the handle is direct"
        return fh

    def _checked(self, name: str, fh: FileHandle, cached: bool = False) -> FileHandle:
        self.open.append(fh)
        assert isinstance(fh, FileHandle), f"open gave {fh!r}, not a FileHandle"
        assert fh.path == self.files.where(name), (
            f"a handle must name {self.files.where(name)} (the store's path_of), not {fh.path}")
        assert isinstance(fh.direct, bool), f"FileHandle.direct must be a bool, got {fh.direct!r}"
        if not self.files.store.capabilities.direct_io:
            assert not fh.direct, f"{fh.path}: a direct handle from a store without direct_io"
        if self.expect_direct is not None and not cached:
            assert fh.direct == self.expect_direct, (
                f"{fh.path}: opened with direct={fh.direct}, expected direct={self.expect_direct}")
        return fh

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        self.open.remove(fh)
        self.files.close(fh, sync=sync)

    def close_all(self) -> None:
        for fh in list(self.open):
            with contextlib.suppress(Exception):  # the check's own failure is what is raised
                self.close(fh, sync=False)


@contextlib.contextmanager
def _handles(files: StoreFiles, expect_direct: bool | None = None) -> Iterator[_Handles]:
    handles = _Handles(files, expect_direct)
    try:
        yield handles
    finally:
        handles.close_all()


def _write_whole(files: StoreFiles, name: str, data: bytes, buf: Buffer) -> None:
    """File ``name`` holding ``data`` (at most one buffer), closed with sync=True."""
    with _handles(files) as handles:
        fh = handles.write(name, len(data))
        buf.view[:len(data)] = data
        done = _done(files.submit_write(fh, 0, buf.view[:len(data)]))
        assert done == len(data), f"a write of {len(data)} bytes reported {done}"
        handles.close(fh, sync=True)


def _read_whole(files: StoreFiles, name: str, nbytes: int, buf: Buffer) -> bytes:
    """The first ``nbytes`` (at most one buffer) of ``name``, read through ``files``' backend."""
    with _handles(files) as handles:
        fh = handles.read(name)
        buf.view[:nbytes] = b"\x00" * nbytes
        got = _done(files.submit_read(fh, 0, buf.view[:nbytes]))
        handles.close(fh, sync=False)
    return bytes(buf.view[:got])


# -- the checks ------------------------------------------------------------------------------

def check_protocol(factory: Factory) -> None:
    """A factory call gives a StoreFiles over a Store and an IOBackend that has a name; each
    call a fresh, empty location of one backend kind (so one backend reaches them all)."""
    with _opened(factory) as files, _opened(factory) as other:
        assert isinstance(files, StoreFiles), f"the factory gave {files!r}, not a StoreFiles"
        backend = files.backend
        assert isinstance(backend, IOBackend), f"{type(backend).__name__} lacks IOBackend methods"
        assert isinstance(backend.name, str) and backend.name, (
            "IOBackend.name must be a non-empty str")
        assert isinstance(files.store, Store), f"{type(files.store).__name__} lacks Store methods"
        assert isinstance(files.store.capabilities, Capabilities)
        assert files.location != other.location, "each factory call must give a fresh location"
        assert files.store.backend_kind == other.store.backend_kind
        assert files.store.names() == [], f"{files.location} is not fresh: {files.store.names()}"
        assert files.store.sizes([_name(0)]) == {}


def _regions(rng: random.Random) -> list[tuple[int, int]]:
    """(offset, nbytes) of writes of many sizes, with untouched gaps of 0-3 blocks between."""
    sizes = [BLOCK, 2 * BLOCK, 3 * BLOCK, 16 * BLOCK, 64 * 1024, 256 * 1024 + BLOCK,
             MiB - BLOCK, MiB] + [BLOCK * rng.randint(1, 64) for _ in range(24)]
    rng.shuffle(sizes)
    regions: list[tuple[int, int]] = []
    end = 0
    for size in sizes:
        end += BLOCK * rng.randint(0, 3)
        regions.append((end, size))
        end += size
    return regions


def check_roundtrip_many_offsets(factory: Factory, *, expect_direct: bool | None = None) -> None:
    """Writes of many sizes at many aligned offsets, in shuffled order, with untouched gaps
    between them, read back bitwise (whole-file and per-write, through the backend and through
    the store); the gaps and the tail (never written) read as zeros."""
    rng = random.Random(1234)
    regions = _regions(rng)
    file_nbytes = regions[-1][0] + regions[-1][1] + 2 * BLOCK  # a never-written tail too
    image = bytearray(file_nbytes)
    for i, (offset, size) in enumerate(regions):
        image[offset:offset + size] = _pattern(size, seed=i)
    order = list(range(len(regions)))
    rng.shuffle(order)
    name = _name(0)
    with _opened(factory) as files, _handles(files, expect_direct) as handles, \
            _staging_pool(len(regions)) as pool:
        fh = handles.write(name, file_nbytes)
        bufs = [pool.acquire() for _ in regions]
        futures = []
        for i in order:
            offset, size = regions[i]
            bufs[i].view[:size] = image[offset:offset + size]
            futures.append((size, files.submit_write(fh, offset, bufs[i].view[:size])))
        for size, future in futures:
            assert _done(future) == size, "a write's future must give len(data)"
        handles.close(fh, sync=True)
        stored = _stored(files, name)
        assert len(stored) >= file_nbytes, f"{len(stored)} bytes stored of {file_nbytes} written"
        assert stored[:file_nbytes] == bytes(image), "the stored bytes differ from those written"

        fh = handles.read(name)
        got = bytearray()
        for start in range(0, file_nbytes, MiB):  # the whole file, in buffer-sized reads
            want = min(MiB, file_nbytes - start)
            n = _done(files.submit_read(fh, start, bufs[0].view[:want]))
            assert n == want, f"read of {want} bytes at {start} (inside the file) gave {n}"
            got += bufs[0].view[:n]
        assert bytes(got) == bytes(image), "bytes read back through the backend differ"
        reads = []  # each write on its own, into a view at an aligned offset, all in flight
        for i, (offset, size) in enumerate(regions):
            at = BLOCK * (i % 4) if size + BLOCK * (i % 4) <= MiB else 0
            view = bufs[i].view[at:at + size]
            reads.append((i, offset, size, view, files.submit_read(fh, offset, view)))
        for i, offset, size, view, future in reads:
            assert _done(future) == size
            assert bytes(view) == _pattern(size, seed=i), f"write #{i} at {offset} read back wrong"
        handles.close(fh, sync=False)


def check_offsets_past_4gib(factory: Factory) -> None:
    """Offsets above 2**32 are not truncated (a 32-bit offset field would wrap them to 0).

    Writes past the size given to open_write: the file simply grows (sparse), as with pwrite."""
    name = _name(0)
    offsets = [0, (1 << 32) + 2 * BLOCK, (5 << 30) + BLOCK]
    size = 4 * BLOCK
    with _opened(factory) as files, _handles(files) as handles, \
            _staging_pool(2 * len(offsets)) as pool:
        src = [pool.acquire() for _ in offsets]
        dst = [pool.acquire() for _ in offsets]
        fh = handles.write(name, size)
        futures = []
        for i, offset in enumerate(offsets):
            src[i].view[:size] = _pattern(size, seed=100 + i)
            futures.append(files.submit_write(fh, offset, src[i].view[:size]))
        assert [_done(f) for f in futures] == [size] * len(offsets)
        handles.close(fh, sync=True)
        for i, offset in enumerate(offsets):
            assert _stored(files, name, offset, size) == _pattern(size, seed=100 + i), (
                f"bytes written at offset {offset} are not there")
        fh = handles.read(name)
        futures = [files.submit_read(fh, offset, dst[i].view[:size])
                   for i, offset in enumerate(offsets)]
        for i, offset in enumerate(offsets):
            assert _done(futures[i]) == size
            assert bytes(dst[i].view[:size]) == _pattern(size, seed=100 + i), (
                f"bytes read at offset {offset} are wrong")
        handles.close(fh, sync=False)


def check_many_in_flight(factory: Factory, *, requests: int = 96,
                         request_bytes: int = 64 * 1024) -> None:
    """``requests`` writes submitted before any is waited for, then as many reads: every one
    completes with its own bytes in its own place (no request overwrites or drops another)."""
    name = _name(0)
    per_buffer = MiB // request_bytes
    nbuffers = -(-requests // per_buffer)
    order = list(range(requests))
    random.Random(7).shuffle(order)
    with _opened(factory) as files, _handles(files) as handles, _staging_pool(2 * nbuffers) as pool:
        src = [pool.acquire() for _ in range(nbuffers)]
        dst = [pool.acquire() for _ in range(nbuffers)]

        def view(bufs: list[Buffer], i: int) -> memoryview:
            b, k = divmod(i, per_buffer)
            return bufs[b].view[k * request_bytes:(k + 1) * request_bytes]

        fh = handles.write(name, requests * request_bytes)
        futures = []
        for i in order:  # request i goes to offset i * request_bytes, submitted out of order
            view(src, i)[:] = _pattern(request_bytes, seed=1000 + i)
            futures.append(files.submit_write(fh, i * request_bytes, view(src, i)))
        assert all(_done(f) == request_bytes for f in futures)
        handles.close(fh, sync=True)
        stored = _stored(files, name, 0, requests * request_bytes)
        for i in range(requests):
            assert stored[i * request_bytes:(i + 1) * request_bytes] == _pattern(
                request_bytes, seed=1000 + i), f"request {i} landed in the wrong place"

        fh = handles.read(name)
        futures = [files.submit_read(fh, i * request_bytes, view(dst, i)) for i in order]
        assert all(_done(f) == request_bytes for f in futures)
        for i in range(requests):
            assert bytes(view(dst, i)) == _pattern(request_bytes, seed=1000 + i), (
                f"read {i} of {requests} in flight got the wrong bytes")
        handles.close(fh, sync=False)


def check_several_files(factory: Factory, *, nfiles: int = 4, per_file: int = 6) -> None:
    """Writes to several files interleaved (all in flight at once), then reads interleaved."""
    size = 128 * 1024
    names = [_name(k) for k in range(nfiles)]
    per_buf = MiB // size
    nviews = 2 * nfiles * per_file
    with _opened(factory) as files, _handles(files) as handles, \
            _staging_pool(-(-nviews // per_buf)) as pool:
        bufs = [pool.acquire() for _ in range(pool.nbuffers)]
        views = [bufs[j // per_buf].view[(j % per_buf) * size:(j % per_buf + 1) * size]
                 for j in range(nviews)]
        fhs = [handles.write(n, per_file * size) for n in names]
        futures = []
        for i in range(per_file):
            for k, fh in enumerate(fhs):
                views[k * per_file + i][:] = _pattern(size, seed=10_000 * k + i)
                futures.append(files.submit_write(fh, i * size, views[k * per_file + i]))
        assert all(_done(f) == size for f in futures)
        for fh in fhs:
            handles.close(fh, sync=True)
        for k, n in enumerate(names):
            assert _stored(files, n, 0, per_file * size) == b"".join(
                _pattern(size, seed=10_000 * k + i) for i in range(per_file)), (
                f"{files.where(n)} holds the wrong bytes")

        fhs = [handles.read(n) for n in names]
        base = nfiles * per_file
        reads = [(k, i, files.submit_read(fh, i * size, views[base + k * per_file + i]))
                 for i in reversed(range(per_file)) for k, fh in enumerate(fhs)]
        for k, i, future in reads:
            assert _done(future) == size
            assert bytes(views[base + k * per_file + i]) == _pattern(size, seed=10_000 * k + i), (
                f"file {k} block {i} read back wrong while other files were being read")
        for fh in fhs:
            handles.close(fh, sync=False)


def check_preallocates(factory: Factory) -> None:
    """open_write makes the file with at least ``nbytes`` before anything is written, and it
    stays after a close without sync."""
    with _opened(factory) as files, _handles(files) as handles:
        for k, nbytes in enumerate((0, BLOCK, 3 * MiB + BLOCK, 64 * MiB)):
            name = _name(k)
            fh = handles.write(name, nbytes)
            size = _size(files, name)
            assert size is not None and size >= nbytes, (
                f"open_write({nbytes}) left {files.where(name)} of {size} bytes")
            handles.close(fh, sync=False)
            assert _size(files, name) == size, "a close without sync changed the file's size"


def check_unwritten_reads_zeros(factory: Factory) -> None:
    """A file opened for ``nbytes`` and closed with sync=True, never written, holds at least
    ``nbytes`` bytes, all zeros, through the store and through the backend."""
    with _opened(factory) as files, _handles(files) as handles, _staging_pool(1) as pool:
        buf = pool.acquire()
        for k, nbytes in enumerate((0, BLOCK, 6 * MiB + BLOCK)):
            name = _name(k)
            handles.close(handles.write(name, nbytes), sync=True)
            size = _size(files, name)
            assert size is not None and size >= nbytes, (
                f"open_write({nbytes}) then close left {files.where(name)} of {size} bytes")
            assert _stored(files, name, 0, nbytes) == bytes(nbytes), "unwritten bytes are not 0"
            fh = handles.read(name)
            for start in range(0, nbytes, MiB):
                want = min(MiB, nbytes - start)
                buf.view[:want] = b"\xff" * want
                assert _done(files.submit_read(fh, start, buf.view[:want])) == want
                assert bytes(buf.view[:want]) == bytes(want), f"unwritten bytes at {start} not 0"
            handles.close(fh, sync=False)


def check_open_write_existing_fails(factory: Factory) -> None:
    """open_write never overwrites: a name written and closed raises StorageIOError naming the
    file, which is left as it was."""
    name = _name(0)
    data = _pattern(2 * BLOCK, seed=3)
    with _opened(factory) as files, _handles(files) as handles, _staging_pool(1) as pool:
        _write_whole(files, name, data, pool.acquire())
        with pytest.raises(StorageIOError) as info:
            handles.write(name, BLOCK)
        _names_it(info.value, files, name)
        assert _stored(files, name) == data, "the existing file was changed"


def check_open_write_twice_fails(factory: Factory) -> None:
    """A second open_write of a name whose first handle is still open raises StorageIOError
    naming the file; the first handle still writes it."""
    name = _name(0)
    data = _pattern(BLOCK, seed=4)
    with _opened(factory) as files, _handles(files) as handles, _staging_pool(1) as pool:
        fh = handles.write(name, BLOCK)
        with pytest.raises(StorageIOError) as info:
            handles.write(name, BLOCK)
        _names_it(info.value, files, name)
        buf = pool.acquire()
        buf.view[:BLOCK] = data
        assert _done(files.submit_write(fh, 0, buf.view[:BLOCK])) == BLOCK
        handles.close(fh, sync=True)
        assert _stored(files, name) == data, "the first handle's write is not stored"


def check_read_past_end(factory: Factory) -> None:
    """Reading past the end of a file returns a short count (0 at or past the end), no error;
    also for a file whose size is not a multiple of BLOCK (a truncated data file: opened for
    BLOCK + 904 bytes, its first block written)."""
    short, odd = _name(0), _name(1)
    data = _pattern(3 * BLOCK, seed=5)
    odd_data = _pattern(BLOCK, seed=6) + bytes(904)
    with _opened(factory) as files, _handles(files) as handles, _staging_pool(2) as pool:
        buf = pool.acquire()
        _write_whole(files, short, data, buf)
        with _handles(files) as writing:
            fh = writing.write(odd, len(odd_data))
            buf.view[:BLOCK] = odd_data[:BLOCK]
            assert _done(files.submit_write(fh, 0, buf.view[:BLOCK])) == BLOCK
            writing.close(fh, sync=True)
        assert _size(files, odd) == len(odd_data), (
            f"open_write({len(odd_data)}) then close made a file of {_size(files, odd)} bytes")

        fh = handles.read(short)
        for offset, want, expect in [(0, 8 * BLOCK, 3 * BLOCK), (2 * BLOCK, 2 * BLOCK, BLOCK),
                                     (3 * BLOCK, BLOCK, 0), (100 * BLOCK, 2 * BLOCK, 0)]:
            buf.view[:want] = b"\x00" * want
            n = _done(files.submit_read(fh, offset, buf.view[:want]))
            assert n == expect, f"read of {want} at {offset} in a {len(data)}-byte file gave {n}"
            assert bytes(buf.view[:n]) == data[offset:offset + n]
        handles.close(fh, sync=False)

        fh = handles.read(odd)
        for offset, want in [(0, 2 * BLOCK), (0, 4 * BLOCK), (BLOCK, BLOCK), (2 * BLOCK, BLOCK)]:
            n = _done(files.submit_read(fh, offset, buf.view[:want]))
            expect = max(0, min(want, len(odd_data) - offset))
            assert n == expect, (
                f"read of {want} at {offset} in a {len(odd_data)}-byte file gave {n}")
            assert bytes(buf.view[:n]) == odd_data[offset:offset + n]
        handles.close(fh, sync=False)


def check_cached_reads(factory: Factory) -> None:
    """A file opened ``cached`` (IOBackend.open_read) is never direct and reads the bytes a
    direct handle of the same file reads, with both open at once and reads interleaved (a load
    reads a file's partly wanted blocks through one and the rest through the other); past the
    end, a short count."""
    name = _name(0)
    data = _pattern(2 * MiB + 3 * BLOCK, seed=11)
    with _opened(factory) as files, _handles(files) as handles, _staging_pool(3, 4 * MiB) as pool:
        whole, direct_buf, cached_buf = pool.acquire(), pool.acquire(), pool.acquire()
        _write_whole(files, name, data, whole)
        direct, cached = handles.read(name), handles.read(name, cached=True)
        for offset, want in [(MiB - BLOCK, 2 * BLOCK), (0, MiB), (2 * MiB, 8 * BLOCK), (0, 4 * MiB)]:
            expect = max(0, min(want, len(data) - offset))
            late = files.submit_read(direct, offset, direct_buf.view[:want])
            got = _done(files.submit_read(cached, offset, cached_buf.view[:want]))
            assert got == expect, f"a cached read of {want} at {offset} gave {got}, not {expect}"
            assert _done(late) == expect
            assert bytes(cached_buf.view[:got]) == data[offset:offset + got], (
                f"a cached read at {offset} gave other bytes than the file holds")
            assert bytes(direct_buf.view[:got]) == bytes(cached_buf.view[:got])
        handles.close(cached, sync=False)
        handles.close(direct, sync=False)


def check_read_missing_fails(factory: Factory) -> None:
    """open_read of a name never written raises StorageIOError naming the file; so does one
    written only at another location (locations do not share files)."""
    with _opened(factory) as files, _opened(factory) as other, _staging_pool(1) as pool:
        with pytest.raises(StorageIOError) as info:
            files.open_read(_name(0))
        _names_it(info.value, files, _name(0))
        _write_whole(other, _name(1), _pattern(BLOCK, seed=8), pool.acquire())
        assert files.store.sizes([_name(1)]) == {}, "a file of another location is seen here"
        with pytest.raises(StorageIOError) as info:
            files.open_read(_name(1))
        _names_it(info.value, files, _name(1))


def check_errors_come_through_futures(factory: Factory) -> None:
    """A failing write or read is a StorageIOError naming the file, raised by the future; the
    handle stays usable for what it was opened for."""
    name = _name(0)
    with _opened(factory) as files, _handles(files) as handles, _staging_pool(1) as pool:
        buf = pool.acquire()
        buf.view[:2 * BLOCK] = _pattern(2 * BLOCK, seed=11)
        fh = handles.write(name, 2 * BLOCK)
        future = files.submit_read(fh, 0, buf.view[2 * BLOCK:3 * BLOCK])  # a write-only handle
        with pytest.raises(StorageIOError) as info:
            _done(future)
        _names_it(info.value, files, name)
        assert _done(files.submit_write(fh, 0, buf.view[:2 * BLOCK])) == 2 * BLOCK
        handles.close(fh, sync=True)

        fh = handles.read(name)
        future = files.submit_write(fh, 0, buf.view[:BLOCK])  # a read-only handle
        with pytest.raises(StorageIOError) as info:
            _done(future)
        _names_it(info.value, files, name)
        assert _done(files.submit_read(fh, 0, buf.view[3 * BLOCK:4 * BLOCK])) == BLOCK
        assert bytes(buf.view[3 * BLOCK:4 * BLOCK]) == _pattern(2 * BLOCK, seed=11)[:BLOCK]
        handles.close(fh, sync=False)
        assert _stored(files, name) == _pattern(2 * BLOCK, seed=11), "a refused write landed"


def _read_pieces(files: StoreFiles, name: str, nbytes: int, bufs: list[Buffer]) -> bytes:
    """``nbytes`` of ``name`` through ``files``' backend, a buffer a read, all in flight."""
    with _handles(files) as handles:
        fh = handles.read(name)
        for b in bufs:
            b.view[:] = bytes(b.nbytes)
        starts = range(0, nbytes, MiB)
        futures = [files.submit_read(fh, start, bufs[k].view[:min(MiB, nbytes - start)])
                   for k, start in enumerate(starts)]
        got = b"".join(bytes(bufs[k].view[:_done(f)]) for k, f in enumerate(futures))
        handles.close(fh, sync=False)
    return got


def _reopened(factory: Factory, sync: bool) -> None:
    """A file of several buffers closed with ``sync`` reads back through the store, the writing
    backend and a new backend (another factory call's: one backend reaches every store of its
    kind)."""
    name = _name(0)
    nbytes = 6 * MiB + BLOCK  # several buffers (for an object store, several parts)
    data = _pattern(nbytes, seed=int(sync))
    with _opened(factory) as files, _opened(factory) as other, _staging_pool(7) as pool:
        bufs = [pool.acquire() for _ in range(7)]
        with _handles(files) as handles:
            fh = handles.write(name, nbytes)
            futures = []
            for k, start in enumerate(range(0, nbytes, MiB)):
                piece = data[start:start + MiB]
                bufs[k].view[:len(piece)] = piece
                view = bufs[k].view[:len(piece)]
                futures.append((len(piece), files.submit_write(fh, start, view)))
            assert all(_done(f) == n for n, f in futures), "a write's future must give len(data)"
            handles.close(fh, sync=sync)
        assert _stored(files, name, 0, nbytes) == data, (
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
    with _staging_pool(1) as pool:
        buf = pool.acquire()
        files = factory()
        files.backend.shutdown()  # never used
        try:
            for round_ in range(3):
                data = _pattern(256 * 1024, seed=round_)
                _write_whole(files, _name(round_), data, buf)
                assert _read_whole(files, _name(round_), len(data), buf) == data, (
                    f"round {round_} after shutdown read the wrong bytes")
                assert _stored(files, _name(round_)) == data, f"round {round_}: wrong bytes stored"
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
    name = _name(0)
    with _opened(factory) as files, _handles(files) as handles, _staging_pool(4) as pool, \
            _staging_pool(1) as outside:
        registered = files.backend.register_buffers(pool.whole_view())
        assert isinstance(registered, bool), f"register_buffers gave {registered!r}, not a bool"
        if not files.store.capabilities.registered_buffers:
            assert registered is False, "a backend pinned buffers its store says it cannot"
        bufs = [pool.acquire() for _ in range(4)] + [outside.acquire()]
        fh = handles.write(name, len(bufs) * MiB)
        for i, b in enumerate(bufs):
            b.view[:] = _pattern(MiB, seed=30 + i)
        assert [_done(files.submit_write(fh, i * MiB, b.view)) for i, b in enumerate(bufs)] == (
            [MiB] * len(bufs))
        handles.close(fh, sync=True)
        expect = b"".join(_pattern(MiB, seed=30 + i) for i in range(len(bufs)))
        assert _stored(files, name) == expect, "bytes written from registered buffers differ"
        for b in bufs:
            b.view[:] = bytes(MiB)
        fh = handles.read(name)
        assert [_done(files.submit_read(fh, i * MiB, b.view)) for i, b in enumerate(bufs)] == (
            [MiB] * len(bufs))
        handles.close(fh, sync=False)
        assert b"".join(bytes(b.view) for b in bufs) == expect, (
            "reads into registered buffers differ")


def _round_trip(files: StoreFiles, name: str, seed: int, buf: Buffer) -> None:
    data = _pattern(BLOCK, seed=seed)
    _write_whole(files, name, data, buf)
    assert _stored(files, name) == data, f"{files.where(name)} holds the wrong bytes"
    assert _read_whole(files, name, BLOCK, buf) == data, f"{files.where(name)} read back wrong"


def check_picklable(factory: Factory) -> None:
    """A backend pickles before use and after use (no fds, threads or rings made in __init__,
    none carried across); the copies and the original all work."""
    with _opened(factory) as files, _staging_pool(1) as pool:
        buf = pool.acquire()
        copies = [pickle.loads(pickle.dumps(files.backend))]
        _round_trip(files, _name(0), 9, buf)  # used: threads and rings now exist
        copies.append(pickle.loads(pickle.dumps(files.backend)))
        for k, copy in enumerate([*copies, files.backend]):
            assert type(copy) is type(files.backend)
            try:
                _round_trip(StoreFiles(files.store, copy), _name(1 + k), 20 + k, buf)
            finally:
                if copy is not files.backend:
                    copy.shutdown()


CHECKS: dict[str, Callable[..., None]] = {
    "protocol": check_protocol,
    "roundtrip_many_offsets": check_roundtrip_many_offsets,
    "offsets_past_4gib": check_offsets_past_4gib,
    "many_in_flight": check_many_in_flight,
    "several_files": check_several_files,
    "preallocates": check_preallocates,
    "unwritten_reads_zeros": check_unwritten_reads_zeros,
    "open_write_existing_fails": check_open_write_existing_fails,
    "open_write_twice_fails": check_open_write_twice_fails,
    "read_past_end": check_read_past_end,
    "cached_reads": check_cached_reads,
    "read_missing_fails": check_read_missing_fails,
    "errors_come_through_futures": check_errors_come_through_futures,
    "close_sync_and_reopen": check_close_sync_and_reopen,
    "close_without_sync_keeps_data": check_close_without_sync_keeps_data,
    "shutdown_then_reuse": check_shutdown_then_reuse,
    "shutdown_closes_fds": check_shutdown_closes_fds,
    "register_buffers": check_register_buffers,
    "picklable": check_picklable,
}


def run_all(factory: Factory, *, limits: Mapping[str, str] | None = None,
            expect_direct: bool | None = None) -> dict[str, str]:
    """Every check but those ``limits`` declares unmeetable; -> the skipped ones and why."""
    limits = dict(limits or {})
    check_limits(limits)
    for name, check in CHECKS.items():
        if name in limits:
            continue
        if name == "roundtrip_many_offsets":
            check(factory, expect_direct=expect_direct)
        else:
            check(factory)
    return limits


# -- pytest ----------------------------------------------------------------------------------

class IOBackendConformance:
    """Subclass as ``TestSomething(IOBackendConformance)``, provide ``files_factory`` and, for
    what the implementation cannot meet, ``limits`` (check name -> why; see LIMITABLE).

    ``files_factory`` returns a zero-argument callable; each call gives a fresh ``StoreFiles``:
    a prepared store at a fresh, unused location and a new backend made by
    ``store.backend(options)`` (``fresh_files`` makes such a factory from ``make(key)``).
    Override ``expect_direct`` (True/False) to also check the kind of handle opened. Buffers
    are page-aligned and O_DIRECT-valid; offsets and lengths are multiples of BLOCK::

        class TestMyStore(IOBackendConformance):
            limits = {"offsets_past_4gib": "a file is one dense buffer: 5 GiB of RAM"}

            @pytest.fixture
            def files_factory(self, tmp_path):
                return fresh_files(lambda key: MyStore(tmp_path / key), Options())

    Only the checks in ``LIMITABLE`` may be declared unmeetable (a property of a kind of
    storage, not of a backend's quality); every other check is the contract itself and runs on
    every implementation."""

    limits: ClassVar[Mapping[str, str]] = {}

    @pytest.fixture
    def files_factory(self) -> Factory:
        raise NotImplementedError("a conformance test class must define the files_factory "
                                  "fixture: a zero-argument callable giving a fresh StoreFiles")

    @pytest.fixture
    def expect_direct(self) -> bool | None:
        return None

    def _run(self, check: str, factory: Factory, **options: Any) -> None:
        check_limits(self.limits)
        why = self.limits.get(check)
        if why is not None:
            pytest.skip(f"{type(self).__name__} cannot meet {check!r}: {why}")
        CHECKS[check](factory, **options)

    def test_protocol(self, files_factory: Factory) -> None:
        self._run("protocol", files_factory)

    def test_roundtrip_many_offsets(self, files_factory: Factory,
                                    expect_direct: bool | None) -> None:
        self._run("roundtrip_many_offsets", files_factory, expect_direct=expect_direct)

    def test_offsets_past_4gib(self, files_factory: Factory) -> None:
        self._run("offsets_past_4gib", files_factory)

    def test_many_in_flight(self, files_factory: Factory) -> None:
        self._run("many_in_flight", files_factory)

    def test_several_files(self, files_factory: Factory) -> None:
        self._run("several_files", files_factory)

    def test_preallocates(self, files_factory: Factory) -> None:
        self._run("preallocates", files_factory)

    def test_unwritten_reads_zeros(self, files_factory: Factory) -> None:
        self._run("unwritten_reads_zeros", files_factory)

    def test_open_write_existing_fails(self, files_factory: Factory) -> None:
        self._run("open_write_existing_fails", files_factory)

    def test_open_write_twice_fails(self, files_factory: Factory) -> None:
        self._run("open_write_twice_fails", files_factory)

    def test_read_past_end(self, files_factory: Factory) -> None:
        self._run("read_past_end", files_factory)

    def test_cached_reads(self, files_factory: Factory) -> None:
        self._run("cached_reads", files_factory)

    def test_read_missing_fails(self, files_factory: Factory) -> None:
        self._run("read_missing_fails", files_factory)

    def test_errors_come_through_futures(self, files_factory: Factory) -> None:
        self._run("errors_come_through_futures", files_factory)

    def test_close_sync_and_reopen(self, files_factory: Factory) -> None:
        self._run("close_sync_and_reopen", files_factory)

    def test_close_without_sync_keeps_data(self, files_factory: Factory) -> None:
        self._run("close_without_sync_keeps_data", files_factory)

    def test_shutdown_then_reuse(self, files_factory: Factory) -> None:
        self._run("shutdown_then_reuse", files_factory)

    def test_shutdown_closes_fds(self, files_factory: Factory) -> None:
        self._run("shutdown_closes_fds", files_factory)

    def test_register_buffers(self, files_factory: Factory) -> None:
        self._run("register_buffers", files_factory)

    def test_picklable(self, files_factory: Factory) -> None:
        self._run("picklable", files_factory)
