"""The conformance suite every IOBackend passes (the contract is ckptio/io/base.py).

Two ways to use it:

* pytest (zarr's StoreTests style): subclass ``IOBackendConformance`` in a test module and give
  it a ``backend_factory`` fixture returning a zero-argument callable that builds a fresh, unused
  backend. Override the ``io_dir`` fixture to test on another filesystem, and ``expect_direct``
  (True/False) to also check what kind of handle the backend opens::

      class TestMyBackend(IOBackendConformance):
          @pytest.fixture
          def backend_factory(self):
              return lambda: MyBackend(depth=4)

* plain functions: each ``check_*(factory, directory)`` runs one group of checks and raises
  AssertionError (or the backend's own error) on a failure; ``run_all`` runs them all.

Buffers come from ckptio.io.stage.BufferPool, as in real saves and loads, so they are page-aligned
and O_DIRECT-valid; offsets and lengths are multiples of BLOCK. Every byte written is compared
with an independent reader (plain ``open``) as well as read back through the backend, so a
backend that misplaces bytes symmetrically on write and read still fails. No check measures time.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from ckptio.errors import StorageIOError
from ckptio.io.base import FileHandle, IOBackend
from ckptio.options import BLOCK, MiB
from ckptio.io.stage import BufferPool

Factory = Callable[[], IOBackend]
TIMEOUT = 120.0  # seconds a single request may take before the check gives up (a hang, not speed)

__all__ = [
    "IOBackendConformance", "Factory", "run_all", "CHECKS",
    "check_protocol", "check_roundtrip_many_offsets", "check_offsets_past_4gib",
    "check_many_in_flight", "check_several_files", "check_preallocates",
    "check_open_write_existing_fails", "check_read_past_end", "check_read_missing_fails",
    "check_errors_come_through_futures", "check_close_sync_and_reopen",
    "check_shutdown_then_reuse", "check_picklable",
]


# -- helpers ---------------------------------------------------------------------------------

def _pattern(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


@contextlib.contextmanager
def _staging(nbuffers: int, buffer_bytes: int) -> Iterator[BufferPool]:
    """A fresh pool for one check. Not closed explicitly: views of its buffers may still be
    referenced by the check's locals (mmap.close() refuses then); it is freed with them."""
    yield BufferPool(nbuffers, buffer_bytes)


def _done(future: Future[int]) -> int:
    return future.result(timeout=TIMEOUT)


def _disk_bytes(path: str, offset: int, nbytes: int) -> bytes:
    """What an independent reader (buffered, no backend) sees."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


def _open_fds() -> set[str]:
    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:
        return set()


@contextlib.contextmanager
def _backend(factory: Factory) -> Iterator[Any]:
    backend = factory()
    try:
        yield backend
    finally:
        backend.shutdown()


class _Handles:
    """Handles opened during a check, closed (without fsync) if the check fails midway."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.open: list[FileHandle] = []

    def write(self, path: str, nbytes: int) -> FileHandle:
        fh = self.backend.open_write(path, nbytes)
        self.open.append(fh)
        return fh

    def read(self, path: str) -> FileHandle:
        fh = self.backend.open_read(path)
        self.open.append(fh)
        return fh

    def close(self, fh: FileHandle, *, sync: bool) -> None:
        self.open.remove(fh)
        self.backend.close(fh, sync=sync)

    def close_all(self) -> None:
        for fh in list(self.open):
            with contextlib.suppress(Exception):
                self.close(fh, sync=False)


@contextlib.contextmanager
def _handles(backend: Any) -> Iterator[_Handles]:
    handles = _Handles(backend)
    try:
        yield handles
    finally:
        handles.close_all()


def _check_direct(fh: FileHandle, expect_direct: bool | None) -> None:
    assert isinstance(fh.direct, bool), f"FileHandle.direct must be a bool, got {fh.direct!r}"
    if expect_direct is not None:
        assert fh.direct == expect_direct, (
            f"{fh.path}: opened with direct={fh.direct}, expected direct={expect_direct}")


# -- the checks ------------------------------------------------------------------------------

def check_protocol(factory: Factory, directory: str) -> None:
    """The backend satisfies the IOBackend protocol and has a name."""
    with _backend(factory) as backend:
        assert isinstance(backend, IOBackend), f"{type(backend).__name__} lacks IOBackend methods"
        assert isinstance(backend.name, str) and backend.name, "IOBackend.name must be a non-empty str"


def check_roundtrip_many_offsets(factory: Factory, directory: str, *,
                                 expect_direct: bool | None = None) -> None:
    """Writes of many sizes at many aligned offsets, in shuffled order, with untouched gaps
    between them, read back bitwise (whole-file and per-write, through the backend and through
    plain open); the gaps (preallocated, never written) read as zeros."""
    rng = random.Random(1234)
    sizes = [BLOCK, 2 * BLOCK, 3 * BLOCK, 16 * BLOCK, 64 * 1024, 256 * 1024 + BLOCK,
             MiB - BLOCK, MiB] + [BLOCK * rng.randint(1, 64) for _ in range(24)]
    rng.shuffle(sizes)
    regions: list[tuple[int, int]] = []  # (offset, nbytes)
    end = 0
    for size in sizes:
        end += BLOCK * rng.randint(0, 3)  # a gap of 0-3 blocks
        regions.append((end, size))
        end += size
    file_nbytes = end + 2 * BLOCK  # a never-written tail too
    image = bytearray(file_nbytes)
    path = os.path.join(directory, "many-offsets.bin")
    order = list(range(len(regions)))
    rng.shuffle(order)
    with _backend(factory) as backend, _handles(backend) as handles, \
            _staging(len(regions), MiB) as pool:
        fh = handles.write(path, file_nbytes)
        _check_direct(fh, expect_direct)
        futures = []
        for i in order:
            offset, size = regions[i]
            buf = pool.acquire()
            data = _pattern(size, seed=i)
            buf.view[:size] = data
            image[offset:offset + size] = data
            futures.append((size, backend.submit_write(fh, offset, buf.view[:size])))
        for size, future in futures:
            assert _done(future) == size, "a write's future must give len(data)"
        handles.close(fh, sync=True)
        for buf in list(pool._all):  # every buffer was taken by one write above
            pool.release(buf)

        with open(path, "rb") as f:
            on_disk = f.read()
        assert len(on_disk) >= file_nbytes
        assert on_disk[:file_nbytes] == bytes(image), "bytes on disk differ from what was written"

        fh = handles.read(path)
        _check_direct(fh, expect_direct)
        # whole file, in buffer-sized reads
        got = bytearray()
        for start in range(0, file_nbytes, MiB):
            buf = pool.acquire()
            want = min(MiB, file_nbytes - start)
            n = _done(backend.submit_read(fh, start, buf.view[:want]))
            assert n == want, f"read of {want} bytes at {start} (inside the file) gave {n}"
            got += buf.view[:n]
            pool.release(buf)
        assert bytes(got) == bytes(image), "bytes read back through the backend differ"
        # each write on its own, into a view at an aligned offset inside a buffer, all in flight
        reads = []
        for i, (offset, size) in enumerate(regions):
            buf = pool.acquire()
            into_at = BLOCK * (i % 4) if size + BLOCK * (i % 4) <= MiB else 0
            view = buf.view[into_at:into_at + size]
            reads.append((i, offset, size, view, backend.submit_read(fh, offset, view)))
        for i, offset, size, view, future in reads:
            assert _done(future) == size
            assert bytes(view) == _pattern(size, seed=i), f"write #{i} at {offset} read back wrong"
        handles.close(fh, sync=False)


def check_offsets_past_4gib(factory: Factory, directory: str) -> None:
    """Offsets above 2**32 are not truncated (a 32-bit offset field would wrap them to 0).

    Writes past the preallocated size: the file simply grows (sparse), as with pwrite."""
    path = os.path.join(directory, "past-4gib.bin")
    offsets = [0, (1 << 32) + 2 * BLOCK, (5 << 30) + BLOCK]
    size = 4 * BLOCK
    with _backend(factory) as backend, _handles(backend) as handles, \
            _staging(2 * len(offsets), MiB) as pool:
        src = [pool.acquire() for _ in offsets]
        dst = [pool.acquire() for _ in offsets]
        fh = handles.write(path, size)
        futures = []
        for i, offset in enumerate(offsets):
            src[i].view[:size] = _pattern(size, seed=100 + i)
            futures.append(backend.submit_write(fh, offset, src[i].view[:size]))
        assert [_done(f) for f in futures] == [size] * len(offsets)
        handles.close(fh, sync=True)
        for i, offset in enumerate(offsets):
            assert _disk_bytes(path, offset, size) == _pattern(size, seed=100 + i), (
                f"bytes written at offset {offset} are not there")
        fh = handles.read(path)
        futures = [backend.submit_read(fh, offset, dst[i].view[:size])
                   for i, offset in enumerate(offsets)]
        for i, offset in enumerate(offsets):
            assert _done(futures[i]) == size
            assert bytes(dst[i].view[:size]) == _pattern(size, seed=100 + i), (
                f"bytes read at offset {offset} are wrong")
        handles.close(fh, sync=False)


def check_many_in_flight(factory: Factory, directory: str, *, requests: int = 96,
                         request_bytes: int = 64 * 1024) -> None:
    """``requests`` writes submitted before any is waited for, then as many reads: every one
    completes with its own bytes in its own place (no request overwrites or drops another)."""
    path = os.path.join(directory, "in-flight.bin")
    per_buffer = MiB // request_bytes
    nbuffers = -(-requests // per_buffer)
    order = list(range(requests))
    random.Random(7).shuffle(order)
    with _backend(factory) as backend, _handles(backend) as handles, \
            _staging(2 * nbuffers, MiB) as pool:
        src = [pool.acquire() for _ in range(nbuffers)]
        dst = [pool.acquire() for _ in range(nbuffers)]

        def view(bufs: list[Any], i: int) -> memoryview:
            b, k = divmod(i, per_buffer)
            return bufs[b].view[k * request_bytes:(k + 1) * request_bytes]

        fh = handles.write(path, requests * request_bytes)
        futures = []
        for i in order:  # request i goes to offset i * request_bytes, submitted out of order
            view(src, i)[:] = _pattern(request_bytes, seed=1000 + i)
            futures.append(backend.submit_write(fh, i * request_bytes, view(src, i)))
        assert all(_done(f) == request_bytes for f in futures)
        handles.close(fh, sync=True)
        with open(path, "rb") as f:
            for i in range(requests):
                assert f.read(request_bytes) == _pattern(request_bytes, seed=1000 + i), (
                    f"request {i} landed wrong on disk")

        fh = handles.read(path)
        futures = [(i, backend.submit_read(fh, i * request_bytes, view(dst, i))) for i in order]
        for i, future in futures:
            assert _done(future) == request_bytes
        for i in range(requests):
            assert bytes(view(dst, i)) == _pattern(request_bytes, seed=1000 + i), (
                f"read {i} of {requests} in flight got the wrong bytes")
        handles.close(fh, sync=False)


def check_several_files(factory: Factory, directory: str, *, nfiles: int = 4,
                        per_file: int = 6) -> None:
    """Writes to several files interleaved (all in flight at once), then reads interleaved."""
    size = 128 * 1024
    paths = [os.path.join(directory, f"multi-{k}.bin") for k in range(nfiles)]
    with _backend(factory) as backend, _handles(backend) as handles, \
            _staging(2 * nfiles * per_file * size // MiB + 2, MiB) as pool:
        per_buf = MiB // size
        views = [pool._all[j // per_buf].view[(j % per_buf) * size:(j % per_buf + 1) * size]
                 for j in range(2 * nfiles * per_file)]
        fhs = [handles.write(p, per_file * size) for p in paths]
        futures = []
        for i in range(per_file):
            for k, fh in enumerate(fhs):
                v = views[k * per_file + i]
                v[:] = _pattern(size, seed=10_000 * k + i)
                futures.append(backend.submit_write(fh, i * size, v))
        assert all(_done(f) == size for f in futures)
        for fh in fhs:
            handles.close(fh, sync=True)
        for k, p in enumerate(paths):
            assert _disk_bytes(p, 0, per_file * size) == b"".join(
                _pattern(size, seed=10_000 * k + i) for i in range(per_file)), f"{p} holds wrong bytes"

        fhs = [handles.read(p) for p in paths]
        base = nfiles * per_file
        futures = []
        for i in reversed(range(per_file)):
            for k, fh in enumerate(fhs):
                futures.append((k, i, backend.submit_read(fh, i * size, views[base + k * per_file + i])))
        for k, i, future in futures:
            assert _done(future) == size
            assert bytes(views[base + k * per_file + i]) == _pattern(size, seed=10_000 * k + i), (
                f"file {k} block {i} read back wrong while other files were being read")
        for fh in fhs:
            handles.close(fh, sync=False)


def check_preallocates(factory: Factory, directory: str) -> None:
    """open_write creates the file with at least ``nbytes`` before anything is written."""
    with _backend(factory) as backend, _handles(backend) as handles:
        for nbytes in (0, BLOCK, 3 * MiB + BLOCK, 64 * MiB):
            path = os.path.join(directory, f"prealloc-{nbytes}.bin")
            fh = handles.write(path, nbytes)
            size = os.stat(path).st_size
            assert size >= nbytes, f"open_write({nbytes}) left a file of {size} bytes"
            handles.close(fh, sync=False)
            assert os.path.exists(path)


def check_open_write_existing_fails(factory: Factory, directory: str) -> None:
    """open_write never overwrites: an existing path raises StorageIOError naming it, and the
    file is left as it was (also while the first open_write's handle is still open)."""
    path = os.path.join(directory, "exists.bin")
    with open(path, "wb") as f:
        f.write(b"keep me" * 1000)
    with _backend(factory) as backend, _handles(backend) as handles:
        with pytest.raises(StorageIOError) as info:
            handles.write(path, BLOCK)
        assert path in str(info.value), f"the error must name the file: {info.value}"
        assert _disk_bytes(path, 0, 1 << 20) == b"keep me" * 1000, "the existing file was changed"

        other = os.path.join(directory, "twice.bin")
        fh = handles.write(other, BLOCK)
        with pytest.raises(StorageIOError) as info:
            handles.write(other, BLOCK)
        assert other in str(info.value)
        handles.close(fh, sync=False)


def check_read_past_end(factory: Factory, directory: str) -> None:
    """Reading past the end of a file returns a short count (0 at or past the end), no error;
    also for a file whose size is not a multiple of BLOCK (a truncated data file)."""
    path = os.path.join(directory, "short.bin")
    data = _pattern(3 * BLOCK, seed=5)
    odd = os.path.join(directory, "odd-size.bin")
    odd_data = _pattern(BLOCK + 904, seed=6)
    with open(odd, "wb") as f:
        f.write(odd_data)
    with _backend(factory) as backend, _handles(backend) as handles, _staging(2, MiB) as pool:
        buf = pool.acquire()
        buf.view[:len(data)] = data
        fh = handles.write(path, len(data))
        assert _done(backend.submit_write(fh, 0, buf.view[:len(data)])) == len(data)
        handles.close(fh, sync=True)

        fh = handles.read(path)
        cases = [(0, 8 * BLOCK, 3 * BLOCK), (2 * BLOCK, 2 * BLOCK, BLOCK), (3 * BLOCK, BLOCK, 0),
                 (100 * BLOCK, 2 * BLOCK, 0)]
        for offset, want, expect in cases:
            buf.view[:want] = b"\x00" * want
            n = _done(backend.submit_read(fh, offset, buf.view[:want]))
            assert n == expect, f"read of {want} at {offset} in a {len(data)}-byte file gave {n}"
            assert bytes(buf.view[:n]) == data[offset:offset + n]
        handles.close(fh, sync=False)

        fh = handles.read(odd)
        for offset, want in [(0, 2 * BLOCK), (0, 4 * BLOCK), (BLOCK, BLOCK), (2 * BLOCK, BLOCK)]:
            n = _done(backend.submit_read(fh, offset, buf.view[:want]))
            expect = max(0, min(want, len(odd_data) - offset))
            assert n == expect, f"read of {want} at {offset} in a {len(odd_data)}-byte file gave {n}"
            assert bytes(buf.view[:n]) == odd_data[offset:offset + n]
        handles.close(fh, sync=False)


def check_read_missing_fails(factory: Factory, directory: str) -> None:
    """open_read of a missing file (or one in a missing directory) raises StorageIOError naming it."""
    with _backend(factory) as backend:
        for path in (os.path.join(directory, "missing.bin"),
                     os.path.join(directory, "no-such-dir", "missing.bin")):
            with pytest.raises(StorageIOError) as info:
                backend.open_read(path)
            assert path in str(info.value), f"the error must name the file: {info.value}"


def check_errors_come_through_futures(factory: Factory, directory: str) -> None:
    """A failing write or read is a StorageIOError naming the file, raised by the future."""
    path = os.path.join(directory, "ro.bin")
    with _backend(factory) as backend, _handles(backend) as handles, _staging(2, MiB) as pool:
        buf = pool.acquire()
        fh = handles.write(path, 2 * BLOCK)
        future = backend.submit_read(fh, 0, buf.view[:BLOCK])  # a write-only handle
        with pytest.raises(StorageIOError) as info:
            _done(future)
        assert path in str(info.value)
        assert _done(backend.submit_write(fh, 0, buf.view[:2 * BLOCK])) == 2 * BLOCK
        handles.close(fh, sync=True)

        fh = handles.read(path)
        future = backend.submit_write(fh, 0, buf.view[:BLOCK])  # a read-only handle
        with pytest.raises(StorageIOError) as info:
            _done(future)
        assert path in str(info.value)
        assert _done(backend.submit_read(fh, 0, buf.view[:BLOCK])) == BLOCK  # still usable
        handles.close(fh, sync=False)


def check_close_sync_and_reopen(factory: Factory, directory: str) -> None:
    """Data closed with sync=True (and sync=False) is there when reopened, by a new backend too."""
    with _staging(2, MiB) as pool:
        buf = pool.acquire()
        for sync in (True, False):
            path = os.path.join(directory, f"closed-sync-{sync}.bin")
            data = _pattern(MiB, seed=int(sync))
            with _backend(factory) as backend, _handles(backend) as handles:
                buf.view[:] = data
                fh = handles.write(path, MiB)
                assert _done(backend.submit_write(fh, 0, buf.view)) == MiB
                handles.close(fh, sync=sync)
            buf.view[:] = b"\x00" * MiB
            with _backend(factory) as fresh, _handles(fresh) as handles:
                fh = handles.read(path)
                assert _done(fresh.submit_read(fh, 0, buf.view)) == MiB
                handles.close(fh, sync=False)
            assert bytes(buf.view) == data, f"data closed with sync={sync} did not survive re-open"
            assert _disk_bytes(path, 0, MiB) == data


def _settled_fds(expected: set[str]) -> set[str]:
    """Open fds, waiting briefly for other threads' transient ones (e.g. a listdir) to close."""
    fds = _open_fds()
    for _ in range(50):
        if fds - expected == set():
            break
        time.sleep(0.02)
        fds = _open_fds()
    return fds


def check_shutdown_then_reuse(factory: Factory, directory: str) -> None:
    """shutdown() on an unused backend, twice in a row, and between uses; the backend works after
    it, and after the last shutdown it holds no file descriptor (rings, eventfds...)."""
    before = _open_fds()
    backend = factory()
    backend.shutdown()  # never used
    with _staging(2, MiB) as pool:
        buf = pool.acquire()
        for round_ in range(3):
            path = os.path.join(directory, f"reuse-{round_}.bin")
            data = _pattern(256 * 1024, seed=round_)
            buf.view[:len(data)] = data
            with _handles(backend) as handles:
                fh = handles.write(path, len(data))
                assert _done(backend.submit_write(fh, 0, buf.view[:len(data)])) == len(data)
                handles.close(fh, sync=True)
                buf.view[:len(data)] = b"\x00" * len(data)
                fh = handles.read(path)
                assert _done(backend.submit_read(fh, 0, buf.view[:len(data)])) == len(data)
                handles.close(fh, sync=False)
            assert bytes(buf.view[:len(data)]) == data, f"round {round_} after shutdown read wrong bytes"
            backend.shutdown()
        backend.shutdown()
    leaked = _settled_fds(before) - before
    assert not leaked, f"file descriptors left open after shutdown(): {sorted(leaked)}"


def check_picklable(factory: Factory, directory: str) -> None:
    """A backend pickles before use and after use (no fds, threads or rings made in __init__,
    none carried across); the copy and the original both work."""
    backend = factory()
    try:
        copies = [pickle.loads(pickle.dumps(backend))]
        with _staging(2, MiB) as pool:
            buf = pool.acquire()
            with _handles(backend) as handles:  # use it: threads/rings now exist
                path = os.path.join(directory, "pickle-orig.bin")
                buf.view[:BLOCK] = _pattern(BLOCK, seed=9)
                fh = handles.write(path, BLOCK)
                assert _done(backend.submit_write(fh, 0, buf.view[:BLOCK])) == BLOCK
                handles.close(fh, sync=True)
            copies.append(pickle.loads(pickle.dumps(backend)))
            for k, copy in enumerate([*copies, backend]):
                assert type(copy) is type(backend)
                try:
                    with _handles(copy) as handles:
                        path = os.path.join(directory, f"pickle-copy-{k}.bin")
                        buf.view[:BLOCK] = _pattern(BLOCK, seed=20 + k)
                        fh = handles.write(path, BLOCK)
                        assert _done(copy.submit_write(fh, 0, buf.view[:BLOCK])) == BLOCK
                        handles.close(fh, sync=True)
                        buf.view[:BLOCK] = b"\x00" * BLOCK
                        fh = handles.read(path)
                        assert _done(copy.submit_read(fh, 0, buf.view[:BLOCK])) == BLOCK
                        handles.close(fh, sync=False)
                    assert bytes(buf.view[:BLOCK]) == _pattern(BLOCK, seed=20 + k), (
                        f"pickled copy #{k} read back wrong bytes")
                finally:
                    if copy is not backend:
                        copy.shutdown()
    finally:
        backend.shutdown()


CHECKS: dict[str, Callable[..., None]] = {
    "protocol": check_protocol,
    "roundtrip_many_offsets": check_roundtrip_many_offsets,
    "offsets_past_4gib": check_offsets_past_4gib,
    "many_in_flight": check_many_in_flight,
    "several_files": check_several_files,
    "preallocates": check_preallocates,
    "open_write_existing_fails": check_open_write_existing_fails,
    "read_past_end": check_read_past_end,
    "read_missing_fails": check_read_missing_fails,
    "errors_come_through_futures": check_errors_come_through_futures,
    "close_sync_and_reopen": check_close_sync_and_reopen,
    "shutdown_then_reuse": check_shutdown_then_reuse,
    "picklable": check_picklable,
}


def run_all(factory: Factory, directory: str) -> None:
    """Every check, each in its own fresh subdirectory of ``directory``."""
    for name, check in CHECKS.items():
        sub = os.path.join(directory, name)
        os.makedirs(sub)
        check(factory, sub)


# -- pytest ----------------------------------------------------------------------------------

class IOBackendConformance:
    """Subclass as ``TestSomething(IOBackendConformance)`` and provide ``backend_factory``."""

    @pytest.fixture
    def backend_factory(self) -> Factory:
        raise NotImplementedError("a conformance test class must define the backend_factory fixture")

    @pytest.fixture
    def io_dir(self, tmp_path: Any) -> str:
        return str(tmp_path)

    @pytest.fixture
    def expect_direct(self) -> bool | None:
        return None

    def test_protocol(self, backend_factory: Factory, io_dir: str) -> None:
        check_protocol(backend_factory, io_dir)

    def test_roundtrip_many_offsets(self, backend_factory: Factory, io_dir: str,
                                    expect_direct: bool | None) -> None:
        check_roundtrip_many_offsets(backend_factory, io_dir, expect_direct=expect_direct)

    def test_offsets_past_4gib(self, backend_factory: Factory, io_dir: str) -> None:
        check_offsets_past_4gib(backend_factory, io_dir)

    def test_many_in_flight(self, backend_factory: Factory, io_dir: str) -> None:
        check_many_in_flight(backend_factory, io_dir)

    def test_several_files(self, backend_factory: Factory, io_dir: str) -> None:
        check_several_files(backend_factory, io_dir)

    def test_preallocates(self, backend_factory: Factory, io_dir: str) -> None:
        check_preallocates(backend_factory, io_dir)

    def test_open_write_existing_fails(self, backend_factory: Factory, io_dir: str) -> None:
        check_open_write_existing_fails(backend_factory, io_dir)

    def test_read_past_end(self, backend_factory: Factory, io_dir: str) -> None:
        check_read_past_end(backend_factory, io_dir)

    def test_read_missing_fails(self, backend_factory: Factory, io_dir: str) -> None:
        check_read_missing_fails(backend_factory, io_dir)

    def test_errors_come_through_futures(self, backend_factory: Factory, io_dir: str) -> None:
        check_errors_come_through_futures(backend_factory, io_dir)

    def test_close_sync_and_reopen(self, backend_factory: Factory, io_dir: str) -> None:
        check_close_sync_and_reopen(backend_factory, io_dir)

    def test_shutdown_then_reuse(self, backend_factory: Factory, io_dir: str) -> None:
        check_shutdown_then_reuse(backend_factory, io_dir)

    def test_picklable(self, backend_factory: Factory, io_dir: str) -> None:
        check_picklable(backend_factory, io_dir)
