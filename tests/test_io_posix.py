"""The POSIX backend against the shared IOBackend conformance suite (ckptio.testing.io_conformance),
through a LocalStore by file name, in each direct_io mode: "auto" (O_DIRECT where accepted),
"on" (O_DIRECT or fail) and "off" (buffered), and with one worker thread. The same suite runs on
io_uring (test_io_uring.py), host memory (test_store.py) and S3 (s3/test_io_s3.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptio.options import MiB, Options
from ckptio.storage.local.local_store import LocalStore
from ckptio.testing import accepts_o_direct
from ckptio.testing.io_conformance import (
    Factory,
    IOBackendConformance,
    check_limits,
    fresh_files,
)


def local_files(directory: Path, **options: object) -> Factory:
    """Fresh LocalStores under ``directory``, each with a new backend made for ``options``."""
    made = Options(buffer_bytes=MiB, pool_bytes=2 * MiB, **options)  # type: ignore[arg-type]
    return fresh_files(lambda key: LocalStore(directory / key), made)


class TestPosixConformance(IOBackendConformance):
    @pytest.fixture
    def files_factory(self, direct_io: str, tmp_path: Path) -> Factory:
        return local_files(tmp_path, io_backend="posix", io_depth=4, direct_io=direct_io)

    @pytest.fixture
    def expect_direct(self, direct_io: str, tmp_path: Path) -> bool:
        return direct_io != "off" and accepts_o_direct(os.fspath(tmp_path))


class TestPosixDepthOne(IOBackendConformance):
    """One worker thread: many requests in flight must still all complete (queued, not dropped)."""

    @pytest.fixture
    def files_factory(self, tmp_path: Path) -> Factory:
        return local_files(tmp_path, io_backend="posix", io_depth=1, direct_io="auto")


def test_the_store_makes_the_backend_its_options_name(tmp_path: Path) -> None:
    files = local_files(tmp_path, io_backend="posix", io_depth=1, direct_io="off")()
    assert files.backend.name == "posix"
    files.backend.shutdown()


def test_only_limitable_checks_may_be_declared_unmeetable() -> None:
    """A limit names a check in LIMITABLE and says why; the contract's other checks cannot be
    skipped (a typo fails loudly instead of skipping nothing)."""
    check_limits({"preallocates": "objects appear only whole"})
    for bad in ({"roundtrip_many_offsets": "too hard"}, {"preallocate": "typo"},
                {"preallocates": " "}):
        with pytest.raises(ValueError):
            check_limits(bad)


def _batch_file(tmp_path: Path) -> tuple[str, bytes]:
    data = os.urandom(3 * MiB + 123)
    path = str(tmp_path / "batch.bin")
    with open(path, "wb") as f:
        f.write(data)
    return path, data


@pytest.mark.parametrize("batched", [True, False])
def test_submit_reads_fills_each_read_in_order_and_reports_its_parts(tmp_path: Path,
                                                                     batched: bool) -> None:
    """BatchReads through StoreFiles: the POSIX backend's batches, and the one-read-per-entry
    fallback for a backend without them (a wrapper hiding the method)."""
    from ckptio.io.posix import PosixBackend
    from ckptio.storage.files import StoreFiles

    path, data = _batch_file(tmp_path)
    backend = PosixBackend(depth=2, direct_io="off")

    class _Plain:  # only IOBackend's methods: no submit_reads
        def __getattr__(self, name: str):
            if name == "submit_reads":
                raise AttributeError(name)
            return getattr(backend, name)

    files = StoreFiles(LocalStore(tmp_path), backend if batched else _Plain())  # type: ignore[arg-type]
    wants = [(0, 5), (4096, 2 * MiB + 1), (3 * MiB, 500)]  # the last runs past the end
    intos = [memoryview(bytearray(n)) for _o, n in wants]
    calls: list[tuple[int, int, bool]] = []
    fh = files.open_read("batch.bin", cached=True)
    try:
        got = files.submit_reads(fh, [(o, v) for (o, _n), v in zip(wants, intos)],
                                 lambda i, filled, last: calls.append((i, filled, last))).result()
    finally:
        files.close(fh, sync=False)
        backend.shutdown()
    assert got == 5 + 2 * MiB + 1 + 123
    for (offset, n), into in zip(wants, intos):
        assert bytes(into[:len(data) - offset]) == data[offset:offset + n][:n]
    finals = [c for c in calls if c[2]]  # one per read; the fallback's as they complete
    assert sorted(finals) == [(0, 5, True), (1, 2 * MiB + 1, True), (2, 123, True)]
    if batched:  # in order, each filled count growing, a part at most READ_CHUNK
        assert finals == sorted(finals)
        assert [c[1] for c in calls if c[0] == 1] == [MiB, 2 * MiB, 2 * MiB + 1]


def test_an_error_raised_by_each_fails_the_batch(tmp_path: Path) -> None:
    from ckptio.io.posix import PosixBackend
    from ckptio.storage.files import StoreFiles

    path, _data = _batch_file(tmp_path)
    backend = PosixBackend(depth=1, direct_io="off")
    files = StoreFiles(LocalStore(tmp_path), backend)
    seen: list[int] = []

    def each(i: int, filled: int, last: bool) -> None:
        seen.append(i)
        raise ValueError("bad bytes")

    fh = files.open_read("batch.bin", cached=True)
    try:
        with pytest.raises(ValueError, match="bad bytes"):
            files.submit_reads(fh, [(0, memoryview(bytearray(10))),
                                    (10, memoryview(bytearray(10)))], each).result()
    finally:
        files.close(fh, sync=False)
        backend.shutdown()
    assert seen == [0], "the batch went on after its callback failed"
