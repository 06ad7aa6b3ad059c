"""The IOBackend checks of refusals and edges: open_write never overwrites nor opens a name
twice, reads past the end give short counts, cached and direct handles read the same bytes,
a missing file is refused, and a failing request raises through its future, naming the file.

Call order: each ``check_*(factory)`` runs one group of checks and raises AssertionError (or
the backend's own error); io_conformance.py runs them all, or as pytest tests.

Owns: these checks. Does not own: their shared helpers (io_check_tools.py), the data and
lifecycle checks (io_checks_data.py, io_checks_lifecycle.py), the limits a check may be
skipped for (io_conformance.py).
"""

from __future__ import annotations

import pytest

from ckptio.alignment import BLOCK
from ckptio.errors import StorageIOError
from ckptio.options import MiB
from ckptio.testing.io_check_tools import (
    Factory,
    assert_names_file,
    data_file,
    open_handles,
    opened,
    random_bytes,
    result_of,
    staging_pool,
    stored_bytes,
    stored_size,
    write_whole,
)

__all__ = [
    "check_cached_reads",
    "check_errors_come_through_futures",
    "check_open_write_existing_fails",
    "check_open_write_twice_fails",
    "check_read_missing_fails",
    "check_read_past_end",
]


def check_open_write_existing_fails(factory: Factory) -> None:
    """open_write never overwrites: a name written and closed raises StorageIOError naming the
    file, which is left as it was."""
    name = data_file(0)
    data = random_bytes(2 * BLOCK, seed=3)
    with opened(factory) as files, open_handles(files) as handles, staging_pool(1) as pool:
        write_whole(files, name, data, pool.acquire())
        with pytest.raises(StorageIOError) as info:
            handles.write(name, BLOCK)
        assert_names_file(info.value, files, name)
        assert stored_bytes(files, name) == data, "the existing file was changed"


def check_open_write_twice_fails(factory: Factory) -> None:
    """A second open_write of a name whose first handle is still open raises StorageIOError
    naming the file; the first handle still writes it."""
    name = data_file(0)
    data = random_bytes(BLOCK, seed=4)
    with opened(factory) as files, open_handles(files) as handles, staging_pool(1) as pool:
        fh = handles.write(name, BLOCK)
        with pytest.raises(StorageIOError) as info:
            handles.write(name, BLOCK)
        assert_names_file(info.value, files, name)
        buf = pool.acquire()
        buf.view[:BLOCK] = data
        assert result_of(files.submit_write(fh, 0, buf.view[:BLOCK])) == BLOCK
        handles.close(fh, sync=True)
        assert stored_bytes(files, name) == data, "the first handle's write is not stored"


def check_read_past_end(factory: Factory) -> None:
    """Reading past the end of a file returns a short count (0 at or past the end), no error;
    also for a file whose size is not a multiple of BLOCK (a truncated data file: opened for
    BLOCK + 904 bytes, its first block written)."""
    short, odd = data_file(0), data_file(1)
    data = random_bytes(3 * BLOCK, seed=5)
    odd_data = random_bytes(BLOCK, seed=6) + bytes(904)
    with opened(factory) as files, open_handles(files) as handles, staging_pool(2) as pool:
        buf = pool.acquire()
        write_whole(files, short, data, buf)
        with open_handles(files) as writing:
            fh = writing.write(odd, len(odd_data))
            buf.view[:BLOCK] = odd_data[:BLOCK]
            assert result_of(files.submit_write(fh, 0, buf.view[:BLOCK])) == BLOCK
            writing.close(fh, sync=True)
        assert stored_size(files, odd) == len(odd_data), (
            f"open_write({len(odd_data)}) then close made a file of {stored_size(files, odd)} bytes")

        fh = handles.read(short)
        for offset, want, expect in [(0, 8 * BLOCK, 3 * BLOCK), (2 * BLOCK, 2 * BLOCK, BLOCK),
                                     (3 * BLOCK, BLOCK, 0), (100 * BLOCK, 2 * BLOCK, 0)]:
            buf.view[:want] = b"\x00" * want
            n = result_of(files.submit_read(fh, offset, buf.view[:want]))
            assert n == expect, f"read of {want} at {offset} in a {len(data)}-byte file gave {n}"
            assert bytes(buf.view[:n]) == data[offset:offset + n]
        handles.close(fh, sync=False)

        fh = handles.read(odd)
        for offset, want in [(0, 2 * BLOCK), (0, 4 * BLOCK), (BLOCK, BLOCK), (2 * BLOCK, BLOCK)]:
            n = result_of(files.submit_read(fh, offset, buf.view[:want]))
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
    name = data_file(0)
    data = random_bytes(2 * MiB + 3 * BLOCK, seed=11)
    with opened(factory) as files, open_handles(files) as handles, staging_pool(3, 4 * MiB) as pool:
        whole, direct_buf, cached_buf = pool.acquire(), pool.acquire(), pool.acquire()
        write_whole(files, name, data, whole)
        direct, cached = handles.read(name), handles.read(name, cached=True)
        for offset, want in [(MiB - BLOCK, 2 * BLOCK), (0, MiB), (2 * MiB, 8 * BLOCK), (0, 4 * MiB)]:
            expect = max(0, min(want, len(data) - offset))
            late = files.submit_read(direct, offset, direct_buf.view[:want])
            got = result_of(files.submit_read(cached, offset, cached_buf.view[:want]))
            assert got == expect, f"a cached read of {want} at {offset} gave {got}, not {expect}"
            assert result_of(late) == expect
            assert bytes(cached_buf.view[:got]) == data[offset:offset + got], (
                f"a cached read at {offset} gave other bytes than the file holds")
            assert bytes(direct_buf.view[:got]) == bytes(cached_buf.view[:got])
        handles.close(cached, sync=False)
        handles.close(direct, sync=False)


def check_read_missing_fails(factory: Factory) -> None:
    """open_read of a name never written raises StorageIOError naming the file; so does one
    written only at another location (locations do not share files)."""
    with opened(factory) as files, opened(factory) as other, staging_pool(1) as pool:
        with pytest.raises(StorageIOError) as info:
            files.open_read(data_file(0))
        assert_names_file(info.value, files, data_file(0))
        write_whole(other, data_file(1), random_bytes(BLOCK, seed=8), pool.acquire())
        assert files.store.sizes([data_file(1)]) == {}, "a file of another location is seen here"
        with pytest.raises(StorageIOError) as info:
            files.open_read(data_file(1))
        assert_names_file(info.value, files, data_file(1))


def check_errors_come_through_futures(factory: Factory) -> None:
    """A failing write or read is a StorageIOError naming the file, raised by the future; the
    handle stays usable for what it was opened for."""
    name = data_file(0)
    with opened(factory) as files, open_handles(files) as handles, staging_pool(1) as pool:
        buf = pool.acquire()
        buf.view[:2 * BLOCK] = random_bytes(2 * BLOCK, seed=11)
        fh = handles.write(name, 2 * BLOCK)
        future = files.submit_read(fh, 0, buf.view[2 * BLOCK:3 * BLOCK])  # a write-only handle
        with pytest.raises(StorageIOError) as info:
            result_of(future)
        assert_names_file(info.value, files, name)
        assert result_of(files.submit_write(fh, 0, buf.view[:2 * BLOCK])) == 2 * BLOCK
        handles.close(fh, sync=True)

        fh = handles.read(name)
        future = files.submit_write(fh, 0, buf.view[:BLOCK])  # a read-only handle
        with pytest.raises(StorageIOError) as info:
            result_of(future)
        assert_names_file(info.value, files, name)
        assert result_of(files.submit_read(fh, 0, buf.view[3 * BLOCK:4 * BLOCK])) == BLOCK
        assert bytes(buf.view[3 * BLOCK:4 * BLOCK]) == random_bytes(2 * BLOCK, seed=11)[:BLOCK]
        handles.close(fh, sync=False)
        assert stored_bytes(files, name) == random_bytes(2 * BLOCK, seed=11), "a refused write landed"
