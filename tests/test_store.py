"""The storage contract (ckptio/storage/store_contract.py) on both of its implementations.

(1) The Store conformance suite (ckptio/testing/store_conformance.py) on LocalStore (a
    directory) and MemoryStore (host memory): prepare, commit round trip, atomic replacement
    under a concurrent reader, never-committed locations named as what they hold, conditional
    commit, exclusive claims, names() only ckptio's, remove() never raising, sizes(), path_of
    and the store's backend.
(2) MemoryBackend against the IOBackend conformance suite, through MemoryStores by name (the
    store's read_file and sizes are the suite's independent reader).
(3) The store-generic steps (storage/steps.py) over a MemoryStore: the rules of the local
    commit protocol hold on a store that is not a directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from ckptio.storage.select import store_for
from ckptio.errors import StorageIOError, UnsupportedPathError
from ckptio.alignment import BLOCK
from ckptio.options import Options
from ckptio.storage import steps
from ckptio.storage.store_contract import Store
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.memory.host_memory import HOST
from ckptio.storage.memory.memory_store import MemoryBackend, MemoryStore
from ckptio.testing.io_conformance import Factory, IOBackendConformance, fresh_files, run_all
from ckptio.testing.store_conformance import (
    StoreConformance,
    data_name,
    read_file,
    write_file,
)

# -- (1) the Store conformance suite ------------------------------------------------------------

class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store_factory(self, tmp_path):
        return lambda key: LocalStore(tmp_path / key)

    @pytest.fixture
    def refuse_removal(self, monkeypatch):
        @contextlib.contextmanager
        def refuse(store: Store, name: str) -> Iterator[None]:
            real = os.unlink

            def unlink(target: Any, *args: Any, **kwargs: Any) -> None:
                if os.path.basename(os.fspath(target)) == name:
                    raise OSError(errno.EROFS, "Read-only file system", os.fspath(target))
                real(target, *args, **kwargs)

            monkeypatch.setattr(os, "unlink", unlink)
            try:
                yield
            finally:
                monkeypatch.setattr(os, "unlink", real)

        return refuse


def _memory_root() -> str:
    return f"mem://test-{secrets.token_hex(6)}"


def _forget_under(root: str) -> None:
    with HOST.lock:
        for path in [p for p in HOST.files if p.startswith(root + "/")]:
            del HOST.files[path]
        for location in [loc for loc in HOST.locations if loc.startswith(root + "/")]:
            HOST.locations.discard(location)


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store_factory(self):
        root = _memory_root()
        yield lambda key: MemoryStore(f"{root}/{key}")
        _forget_under(root)


def test_local_store_messages_keep_the_path_as_given(tmp_path):
    """Errors name the directory as the caller wrote it, and URLs are refused before any store
    is made."""
    store = store_for(tmp_path / "ckpt")
    assert isinstance(store, LocalStore) and store.location == str(tmp_path / "ckpt")
    with pytest.raises(UnsupportedPathError):
        store_for("hdfs://bucket/ckpt")
    assert type(store_for("s3://bucket/run/step-1/")).__name__ == "S3Store"
    assert store_for("s3://bucket/run/step-1/").location == "s3://bucket/run/step-1"


def test_memory_store_refuses_other_locations():
    with pytest.raises(StorageIOError):
        MemoryStore("/tmp/not-memory")
    with pytest.raises(StorageIOError):
        MemoryBackend().open_read("/etc/hostname")


# -- (2) MemoryBackend against the IOBackend conformance suite --------------------------------

class TestMemoryBackendIO(IOBackendConformance):
    """The suite through MemoryStores by name: the store itself (read_file, sizes) is the
    independent reader, so nothing of the suite is patched."""

    limits: ClassVar[dict[str, str]] = {
        "offsets_past_4gib": "a memory file is dense: 5 GiB of RAM for a check of 32-bit "
                             "offset truncation, which Python's integers cannot do",
    }

    @pytest.fixture
    def files_factory(self) -> Iterator[Factory]:
        root = _memory_root()
        yield fresh_files(lambda key: MemoryStore(f"{root}/{key}"), Options(io_depth=2))
        _forget_under(root)

    @pytest.fixture
    def expect_direct(self) -> bool:
        return False


def test_run_all_runs_the_suite_as_plain_functions() -> None:
    """run_all: every check but the declared limits, which it returns."""
    root = _memory_root()
    try:
        factory = fresh_files(lambda key: MemoryStore(f"{root}/{key}"), Options())
        skipped = run_all(factory, limits=TestMemoryBackendIO.limits, expect_direct=False)
        assert skipped == TestMemoryBackendIO.limits
    finally:
        _forget_under(root)


# -- (3) the store-generic steps over a store that is not a directory --------------------------

@pytest.fixture
def memory_store():
    root = _memory_root()
    yield MemoryStore(f"{root}/ckpt")
    _forget_under(root)


def _manifest_naming(names: list[str]) -> bytes:
    return ('{"files": [' + ", ".join(f'{{"name": "{n}"}}' for n in names) + "]}").encode()


def test_cleanup_keeps_what_the_committed_manifest_names(memory_store):
    old, new, stray = data_name(0), data_name(1), data_name(2)
    memory_store.prepare()
    for name in (old, new, stray):
        write_file(memory_store, name, b"\0" * BLOCK)
    memory_store.commit(_manifest_naming([new]), "0" * 19)
    removed = steps.remove_unreferenced(memory_store, keep=set())  # told to keep nothing
    assert sorted(removed) == sorted([old, stray])
    assert memory_store.names() == [new]
    assert read_file(memory_store, new, BLOCK) == b"\0" * BLOCK


def test_failed_attempt_removes_its_files_unless_committed(memory_store):
    mine = [data_name(0), data_name(1)]
    with pytest.raises(RuntimeError), steps.attempt(memory_store, mine):
        write_file(memory_store, mine[0], b"\1" * BLOCK)
        raise RuntimeError("the save failed")
    assert memory_store.names() == []
    with pytest.raises(RuntimeError), steps.attempt(memory_store, mine):
        write_file(memory_store, mine[1], b"\2" * BLOCK)
        memory_store.commit(_manifest_naming(mine[1:]), "1" * 19)
        raise RuntimeError("failed after its commit")
    assert memory_store.names() == [mine[1]], "a committed save's files must stay"


def test_check_files_names_the_missing_or_truncated_file(memory_store):
    from ckptio.errors import CorruptCheckpointError
    from ckptio.format.types import FileInfo

    name = data_name()
    memory_store.prepare()
    write_file(memory_store, name, b"\3" * BLOCK)
    record = SimpleNamespace(files=(FileInfo(name, BLOCK, 0),))
    steps.check_files(memory_store, record)  # type: ignore[arg-type]
    for files, word in [((FileInfo(name, 2 * BLOCK, 0),), "truncated"),
                        ((FileInfo(data_name(), 1, 0),), "missing")]:
        with pytest.raises(CorruptCheckpointError) as info:
            steps.check_files(memory_store, SimpleNamespace(files=files))  # type: ignore[arg-type]
        assert word in str(info.value) and memory_store.location in str(info.value)
