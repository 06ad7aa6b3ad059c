"""The tools the IOBackend checks share: a factory of fresh StoreFiles, data file names as a
save makes them, random bytes, a staging pool per check, handles checked as they open and
closed if a check fails, and what the store itself holds (read past the backend under test).

Call order: a check opens a StoreFiles with ``opened(factory)``, its handles with
``open_handles(files)``, buffers from ``staging_pool``; it waits on each request with
``result_of`` (a bounded wait: a hang fails; speed is not checked).

Owns: these helpers. Does not own: the checks (io_checks_data.py, io_checks_refusals.py,
io_checks_lifecycle.py), the suite's entry points (io_conformance.py), the backends
(ckptio/io/), the stores (ckptio/storage/).
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from ckptio.io.backend_contract import FileHandle
from ckptio.io.buffers import Buffer
from ckptio.io.stage import StagingPool
from ckptio.options import MiB, Options
from ckptio.storage.files import StoreFiles
from ckptio.storage.store_contract import Store
from ckptio.testing.store_check_tools import data_name

Factory = Callable[[], StoreFiles]
TIMEOUT = 120.0  # seconds a single request may take before the check gives up (a hang, not speed)
SAVE_ID = "0123456789abcdef012"  # every location is fresh, so one save id serves every check

__all__ = [
    "SAVE_ID",
    "TIMEOUT",
    "Factory",
    "Handles",
    "assert_names_file",
    "data_file",
    "fresh_files",
    "open_handles",
    "opened",
    "random_bytes",
    "read_whole",
    "result_of",
    "staging_pool",
    "stored_bytes",
    "stored_size",
    "write_whole",
]


def fresh_files(make: Callable[[str], Store], options: Options) -> Factory:
    """A factory over ``make(key)`` (a store at the location for ``key``, as StoreConformance's
    store_factory): each call takes a new key, prepares the store and makes it a new backend."""
    keys = itertools.count()

    def factory() -> StoreFiles:
        store = make(f"io-{next(keys)}")
        store.prepare()
        return StoreFiles(store, store.backend(options))

    return factory


def random_bytes(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def data_file(index: int) -> str:
    """A data file name as a ckptio save makes it (stores may care: S3 lists only these)."""
    return data_name(index, SAVE_ID)


@contextlib.contextmanager
def staging_pool(nbuffers: int, buffer_bytes: int = MiB) -> Iterator[StagingPool]:
    """A fresh pool for one check. Not closed explicitly: views of its buffers may still be
    referenced by the check's locals (mmap.close() refuses then); it is freed with them."""
    yield StagingPool(nbuffers, buffer_bytes)


def result_of(future: Future[int]) -> int:
    return future.result(timeout=TIMEOUT)


@contextlib.contextmanager
def opened(factory: Factory) -> Iterator[StoreFiles]:
    files = factory()
    try:
        yield files
    finally:
        files.backend.shutdown()


def stored_bytes(files: StoreFiles, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
    """What the store itself (not the backend under test) holds."""
    return files.store.read_file(name, offset, nbytes)


def stored_size(files: StoreFiles, name: str) -> int | None:
    return files.store.sizes([name]).get(name)


def assert_names_file(error: BaseException, files: StoreFiles, name: str) -> None:
    where = files.where(name)
    assert where in str(error), f"the error must name the file ({where}): {error}"


class Handles:
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
def open_handles(files: StoreFiles, expect_direct: bool | None = None) -> Iterator[Handles]:
    handles = Handles(files, expect_direct)
    try:
        yield handles
    finally:
        handles.close_all()


def write_whole(files: StoreFiles, name: str, data: bytes, buf: Buffer) -> None:
    """File ``name`` holding ``data`` (at most one buffer), closed with sync=True."""
    with open_handles(files) as handles:
        fh = handles.write(name, len(data))
        buf.view[:len(data)] = data
        done = result_of(files.submit_write(fh, 0, buf.view[:len(data)]))
        assert done == len(data), f"a write of {len(data)} bytes reported {done}"
        handles.close(fh, sync=True)


def read_whole(files: StoreFiles, name: str, nbytes: int, buf: Buffer) -> bytes:
    """The first ``nbytes`` (at most one buffer) of ``name``, read through ``files``' backend."""
    with open_handles(files) as handles:
        fh = handles.read(name)
        buf.view[:nbytes] = b"\x00" * nbytes
        got = result_of(files.submit_read(fh, 0, buf.view[:nbytes]))
        handles.close(fh, sync=False)
    return bytes(buf.view[:got])
