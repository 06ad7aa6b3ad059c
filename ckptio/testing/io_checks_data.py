"""The IOBackend checks that bytes land where they are written: many sizes at many offsets,
offsets too large for a narrow offset field, many requests in flight, several files at once,
preallocation, and unwritten bytes reading as zeros; each read back through the backend and
through the store.

Call order: each ``check_*(factory)`` runs one group of checks and raises AssertionError (or
the backend's own error); io_conformance.py runs them all, or as pytest tests.

Owns: these checks. Does not own: their shared helpers (io_check_tools.py), the refusal and
lifecycle checks (io_checks_refusals.py, io_checks_lifecycle.py), the limits a check may be
skipped for (io_conformance.py).
"""

from __future__ import annotations

import random

from ckptio.alignment import BLOCK
from ckptio.io.backend_contract import IOBackend
from ckptio.io.buffers import Buffer
from ckptio.options import MiB
from ckptio.storage.files import Capabilities, StoreFiles
from ckptio.storage.store_contract import Store
from ckptio.testing.io_check_tools import (
    Factory,
    data_file,
    open_handles,
    opened,
    random_bytes,
    result_of,
    staging_pool,
    stored_bytes,
    stored_size,
)

__all__ = [
    "check_many_in_flight",
    "check_offsets_past_4gib",
    "check_preallocates",
    "check_protocol",
    "check_roundtrip_many_offsets",
    "check_several_files",
    "check_unwritten_reads_zeros",
]


def check_protocol(factory: Factory) -> None:
    """A factory call gives a StoreFiles over a Store and an IOBackend that has a name; each
    call a fresh, empty location of one backend kind (so one backend reaches them all)."""
    with opened(factory) as files, opened(factory) as other:
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
        assert files.store.sizes([data_file(0)]) == {}


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
        image[offset:offset + size] = random_bytes(size, seed=i)
    order = list(range(len(regions)))
    rng.shuffle(order)
    name = data_file(0)
    with opened(factory) as files, open_handles(files, expect_direct) as handles, \
            staging_pool(len(regions)) as pool:
        fh = handles.write(name, file_nbytes)
        bufs = [pool.acquire() for _ in regions]
        futures = []
        for i in order:
            offset, size = regions[i]
            bufs[i].view[:size] = image[offset:offset + size]
            futures.append((size, files.submit_write(fh, offset, bufs[i].view[:size])))
        for size, future in futures:
            assert result_of(future) == size, "a write's future must give len(data)"
        handles.close(fh, sync=True)
        stored = stored_bytes(files, name)
        assert len(stored) >= file_nbytes, f"{len(stored)} bytes stored of {file_nbytes} written"
        assert stored[:file_nbytes] == bytes(image), "the stored bytes differ from those written"

        fh = handles.read(name)
        got = bytearray()
        for start in range(0, file_nbytes, MiB):  # the whole file, in buffer-sized reads
            want = min(MiB, file_nbytes - start)
            n = result_of(files.submit_read(fh, start, bufs[0].view[:want]))
            assert n == want, f"read of {want} bytes at {start} (inside the file) gave {n}"
            got += bufs[0].view[:n]
        assert bytes(got) == bytes(image), "bytes read back through the backend differ"
        reads = []  # each write on its own, into a view at an aligned offset, all in flight
        for i, (offset, size) in enumerate(regions):
            at = BLOCK * (i % 4) if size + BLOCK * (i % 4) <= MiB else 0
            view = bufs[i].view[at:at + size]
            reads.append((i, offset, size, view, files.submit_read(fh, offset, view)))
        for i, offset, size, view, future in reads:
            assert result_of(future) == size
            assert bytes(view) == random_bytes(size, seed=i), f"write #{i} at {offset} read back wrong"
        handles.close(fh, sync=False)


def check_offsets_past_4gib(factory: Factory) -> None:
    """Offsets above 2**32 are not truncated (a 32-bit offset field would wrap them to 0).

    Writes past the size given to open_write: the file simply grows (sparse), as with pwrite."""
    name = data_file(0)
    offsets = [0, (1 << 32) + 2 * BLOCK, (5 << 30) + BLOCK]
    size = 4 * BLOCK
    with opened(factory) as files, open_handles(files) as handles, \
            staging_pool(2 * len(offsets)) as pool:
        src = [pool.acquire() for _ in offsets]
        dst = [pool.acquire() for _ in offsets]
        fh = handles.write(name, size)
        futures = []
        for i, offset in enumerate(offsets):
            src[i].view[:size] = random_bytes(size, seed=100 + i)
            futures.append(files.submit_write(fh, offset, src[i].view[:size]))
        assert [result_of(f) for f in futures] == [size] * len(offsets)
        handles.close(fh, sync=True)
        for i, offset in enumerate(offsets):
            assert stored_bytes(files, name, offset, size) == random_bytes(size, seed=100 + i), (
                f"bytes written at offset {offset} are not there")
        fh = handles.read(name)
        futures = [files.submit_read(fh, offset, dst[i].view[:size])
                   for i, offset in enumerate(offsets)]
        for i, offset in enumerate(offsets):
            assert result_of(futures[i]) == size
            assert bytes(dst[i].view[:size]) == random_bytes(size, seed=100 + i), (
                f"bytes read at offset {offset} are wrong")
        handles.close(fh, sync=False)


def check_many_in_flight(factory: Factory, *, requests: int = 96,
                         request_bytes: int = 64 * 1024) -> None:
    """``requests`` writes submitted before any is waited for, then as many reads: every one
    completes with its own bytes in its own place (no request overwrites or drops another)."""
    name = data_file(0)
    per_buffer = MiB // request_bytes
    nbuffers = -(-requests // per_buffer)
    order = list(range(requests))
    random.Random(7).shuffle(order)
    with opened(factory) as files, open_handles(files) as handles, staging_pool(2 * nbuffers) as pool:
        src = [pool.acquire() for _ in range(nbuffers)]
        dst = [pool.acquire() for _ in range(nbuffers)]

        def view(bufs: list[Buffer], i: int) -> memoryview:
            b, k = divmod(i, per_buffer)
            return bufs[b].view[k * request_bytes:(k + 1) * request_bytes]

        fh = handles.write(name, requests * request_bytes)
        futures = []
        for i in order:  # request i goes to offset i * request_bytes, submitted out of order
            view(src, i)[:] = random_bytes(request_bytes, seed=1000 + i)
            futures.append(files.submit_write(fh, i * request_bytes, view(src, i)))
        assert all(result_of(f) == request_bytes for f in futures)
        handles.close(fh, sync=True)
        stored = stored_bytes(files, name, 0, requests * request_bytes)
        for i in range(requests):
            assert stored[i * request_bytes:(i + 1) * request_bytes] == random_bytes(
                request_bytes, seed=1000 + i), f"request {i} landed in the wrong place"

        fh = handles.read(name)
        futures = [files.submit_read(fh, i * request_bytes, view(dst, i)) for i in order]
        assert all(result_of(f) == request_bytes for f in futures)
        for i in range(requests):
            assert bytes(view(dst, i)) == random_bytes(request_bytes, seed=1000 + i), (
                f"read {i} of {requests} in flight got the wrong bytes")
        handles.close(fh, sync=False)


def check_several_files(factory: Factory, *, nfiles: int = 4, per_file: int = 6) -> None:
    """Writes to several files interleaved (all in flight at once), then reads interleaved."""
    size = 128 * 1024
    names = [data_file(k) for k in range(nfiles)]
    per_buf = MiB // size
    nviews = 2 * nfiles * per_file
    with opened(factory) as files, open_handles(files) as handles, \
            staging_pool(-(-nviews // per_buf)) as pool:
        bufs = [pool.acquire() for _ in range(pool.nbuffers)]
        views = [bufs[j // per_buf].view[(j % per_buf) * size:(j % per_buf + 1) * size]
                 for j in range(nviews)]
        fhs = [handles.write(n, per_file * size) for n in names]
        futures = []
        for i in range(per_file):
            for k, fh in enumerate(fhs):
                views[k * per_file + i][:] = random_bytes(size, seed=10_000 * k + i)
                futures.append(files.submit_write(fh, i * size, views[k * per_file + i]))
        assert all(result_of(f) == size for f in futures)
        for fh in fhs:
            handles.close(fh, sync=True)
        for k, n in enumerate(names):
            assert stored_bytes(files, n, 0, per_file * size) == b"".join(
                random_bytes(size, seed=10_000 * k + i) for i in range(per_file)), (
                f"{files.where(n)} holds the wrong bytes")

        fhs = [handles.read(n) for n in names]
        base = nfiles * per_file
        reads = [(k, i, files.submit_read(fh, i * size, views[base + k * per_file + i]))
                 for i in reversed(range(per_file)) for k, fh in enumerate(fhs)]
        for k, i, future in reads:
            assert result_of(future) == size
            assert bytes(views[base + k * per_file + i]) == random_bytes(size, seed=10_000 * k + i), (
                f"file {k} block {i} read back wrong while other files were being read")
        for fh in fhs:
            handles.close(fh, sync=False)


def check_preallocates(factory: Factory) -> None:
    """open_write makes the file with at least ``nbytes`` before anything is written, and it
    stays after a close without sync."""
    with opened(factory) as files, open_handles(files) as handles:
        for k, nbytes in enumerate((0, BLOCK, 3 * MiB + BLOCK, 64 * MiB)):
            name = data_file(k)
            fh = handles.write(name, nbytes)
            size = stored_size(files, name)
            assert size is not None and size >= nbytes, (
                f"open_write({nbytes}) left {files.where(name)} of {size} bytes")
            handles.close(fh, sync=False)
            assert stored_size(files, name) == size, "a close without sync changed the file's size"


def check_unwritten_reads_zeros(factory: Factory) -> None:
    """A file opened for ``nbytes`` and closed with sync=True, never written, holds at least
    ``nbytes`` bytes, all zeros, through the store and through the backend."""
    with opened(factory) as files, open_handles(files) as handles, staging_pool(1) as pool:
        buf = pool.acquire()
        for k, nbytes in enumerate((0, BLOCK, 6 * MiB + BLOCK)):
            name = data_file(k)
            handles.close(handles.write(name, nbytes), sync=True)
            size = stored_size(files, name)
            assert size is not None and size >= nbytes, (
                f"open_write({nbytes}) then close left {files.where(name)} of {size} bytes")
            assert stored_bytes(files, name, 0, nbytes) == bytes(nbytes), "unwritten bytes are not 0"
            fh = handles.read(name)
            for start in range(0, nbytes, MiB):
                want = min(MiB, nbytes - start)
                buf.view[:want] = b"\xff" * want
                assert result_of(files.submit_read(fh, start, buf.view[:want])) == want
                assert bytes(buf.view[:want]) == bytes(want), f"unwritten bytes at {start} not 0"
            handles.close(fh, sync=False)
