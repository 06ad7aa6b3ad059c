"""The POSIX backend against the shared IOBackend conformance suite (ckptio.testing.io_conformance),
through a LocalStore by file name, in each direct_io mode: "auto" (O_DIRECT where accepted),
"on" (O_DIRECT or fail) and "off" (buffered), and with one worker thread. The same suite runs on
io_uring (test_io_uring.py), host memory (test_store.py) and S3 (s3/test_io_s3.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptio.options import MiB, Options
from ckptio.storage.local import LocalStore
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
