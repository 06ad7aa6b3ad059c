"""The POSIX backend against the shared IOBackend conformance suite (ckptio.testing.io_conformance),
in each direct_io mode: "auto" (O_DIRECT where accepted), "on" (O_DIRECT or fail) and "off"
(buffered). The same suite will run against the io_uring backend."""

from __future__ import annotations

import os

import pytest

from ckptio.testing import accepts_o_direct

from ckptio.io import create
from ckptio.io.posix import PosixBackend
from ckptio.testing.io_conformance import IOBackendConformance


def _accepts_o_direct(directory: str) -> bool:
    return accepts_o_direct(directory)


class TestPosixConformance(IOBackendConformance):
    @pytest.fixture
    def backend_factory(self, direct_io: str):
        return lambda: PosixBackend(depth=4, direct_io=direct_io)

    @pytest.fixture
    def expect_direct(self, direct_io: str, tmp_path: os.PathLike[str]) -> bool:
        if direct_io == "off":
            return False
        return _accepts_o_direct(os.fspath(tmp_path))


class TestPosixDepthOne(IOBackendConformance):
    """One worker thread: many requests in flight must still all complete (queued, not dropped)."""

    @pytest.fixture
    def backend_factory(self):
        return lambda: create("posix", depth=1, direct_io="auto")
