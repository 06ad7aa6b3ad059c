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

Owns: the list of checks, the limits a check may be skipped for, the pytest class. Does not
own: the checks (io_checks_data.py, io_checks_refusals.py, io_checks_lifecycle.py), their
helpers (io_check_tools.py), the backends (ckptio/io/), the stores and their naming
(ckptio/storage/), the Store checks (store_conformance.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import pytest

from ckptio.testing.io_check_tools import Factory, fresh_files
from ckptio.testing.io_checks_data import (
    check_many_in_flight,
    check_offsets_past_4gib,
    check_preallocates,
    check_protocol,
    check_roundtrip_many_offsets,
    check_several_files,
    check_unwritten_reads_zeros,
)
from ckptio.testing.io_checks_lifecycle import (
    check_close_sync_and_reopen,
    check_close_without_sync_keeps_data,
    check_picklable,
    check_register_buffers,
    check_shutdown_closes_fds,
    check_shutdown_then_reuse,
)
from ckptio.testing.io_checks_refusals import (
    check_cached_reads,
    check_errors_come_through_futures,
    check_open_write_existing_fails,
    check_open_write_twice_fails,
    check_read_missing_fails,
    check_read_past_end,
)

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


def check_limits(limits: Mapping[str, str]) -> None:
    """Every declared limit names a check in LIMITABLE and says why (ValueError otherwise)."""
    for check, why in limits.items():
        if check not in LIMITABLE:
            raise ValueError(f"limit {check!r}: only {sorted(LIMITABLE)} may be declared "
                             "unmeetable; every other check is the contract itself")
        if not isinstance(why, str) or not why.strip():
            raise ValueError(f"limit {check!r}: say why the implementation cannot meet it")


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
