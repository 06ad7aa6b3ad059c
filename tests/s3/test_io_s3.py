"""S3Backend against the shared IOBackend conformance suite (ckptio.testing.io_conformance),
through S3Stores by name against the real SeaweedFS server (tests/s3/conftest.py): each factory
call a fresh prefix under the test's own, the store's ranged GETs and HEADs the independent
reader. Parts are 5 MiB (the suite's writes are at most 1 MiB), so most writes take the
assembly path and files over 5 MiB are multipart uploads. TestS3BackendSplitReads runs the suite
again with reads of a buffer split into 256 KiB ranged GETs (Options.s3_read_bytes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest

from ckptio.storage.s3.settings import S3Settings
from ckptio.options import MiB, Options
from ckptio.storage.s3.store import S3Store
from ckptio.testing.io_conformance import Factory, IOBackendConformance, fresh_files

OPTIONS = Options(buffer_bytes=MiB, pool_bytes=2 * MiB)
SPLIT = Options(buffer_bytes=MiB, pool_bytes=2 * MiB, s3_read_bytes=256 * 1024)


class TestS3BackendIO(IOBackendConformance):
    limits: ClassVar[dict[str, str]] = {
        "offsets_past_4gib": "an upload's parts are fixed by the size given to open_write "
                             "(writes past it are refused) and the object is uploaded whole: "
                             "5 GiB of mostly zeros to check 32-bit offset truncation",
        "preallocates": "S3 makes an object visible only when its upload completes "
                        "(close(sync=True)): there is nothing to size before",
        "open_write_twice_fails": "open_write refuses an existing object (HEAD); one whose "
                                  "upload is still open does not exist yet. Names are unique "
                                  "to one save, so a save never opens one twice",
        "close_without_sync_keeps_data": "close(sync=False) aborts the multipart upload, so a "
                                         "failed save leaves nothing behind",
        "shutdown_closes_fds": "the sockets are the process's shared boto3 client's "
                               "(s3client.client), kept for the next request by design; the "
                               "backend owns only its threads (shutdown_then_reuse checks them)",
    }

    options: ClassVar[Options] = OPTIONS

    @pytest.fixture
    def files_factory(self, s3_env: str) -> Iterator[Factory]:
        settings = S3Settings.of(Options())
        made: list[S3Store] = []

        def make(key: str) -> S3Store:
            made.append(S3Store(f"{s3_env}/{key}", settings))
            return made[-1]

        yield fresh_files(make, self.options)
        for store in made:  # objects and open uploads alike (every name is ckptio's)
            assert store.remove(store.names()) == []

    @pytest.fixture
    def expect_direct(self) -> bool:
        return False


class TestS3BackendSplitReads(TestS3BackendIO):
    """The suite with every read larger than 256 KiB made of 256 KiB GETs side by side."""

    options: ClassVar[Options] = SPLIT


def test_a_backend_starts_all_its_threads_before_its_first_request(s3_env: str) -> None:
    """One read on a backend of 6 GET threads (and 3 upload threads for one write): every
    thread of the pool is running once the first request is submitted, not one per request as
    requests come (each start then waited for a core the first requests held)."""
    import dataclasses
    import threading

    from ckptio.storage.s3.backend import S3Backend

    def alive(prefix: str) -> int:
        return sum(t.name.startswith(prefix + "_") for t in threading.enumerate())

    before = {p: alive(p) for p in ("ckptio-s3", "ckptio-s3-get")}  # other tests' backends

    def running(prefix: str) -> int:
        return alive(prefix) - before[prefix]

    settings = dataclasses.replace(S3Settings.of(Options()), concurrency=3, read_concurrency=6)
    backend = S3Backend(settings, 5 * MiB)
    url = f"{s3_env}/threads"
    try:
        fh = backend.open_write(url, 4096)
        assert backend.submit_write(fh, 0, memoryview(b"x" * 4096)).result() == 4096
        assert running("ckptio-s3") == 3
        backend.close(fh, sync=True)
        into = memoryview(bytearray(4096))
        assert backend.submit_read(backend.open_read(url), 0, into).result() == 4096
        assert running("ckptio-s3-get") == 6 and bytes(into) == b"x" * 4096
    finally:
        backend.shutdown()
    assert running("ckptio-s3") == running("ckptio-s3-get") == 0
