"""The conformance suite every Store passes (the contract is ckptio/storage/store_contract.py).

Two ways to use it, as io_conformance.py does for backends:

* pytest: subclass ``StoreConformance`` and give it a ``store_factory`` fixture returning a
  callable ``make(key)`` that builds a store at a fresh, unused location for ``key``; the same
  key twice gives two handles of one location (as two processes would have). Optionally a
  ``refuse_removal`` fixture: ``refuse(store, name)``, a context manager in which removing
  ``name`` fails (a read-only filesystem, a denied DELETE); without it that check is skipped::

      class TestMyStore(StoreConformance):
          @pytest.fixture
          def store_factory(self, tmp_path):
              return lambda key: MyStore(tmp_path / key)

* plain functions: each ``check_*(make)`` runs one group of checks and raises AssertionError
  (or the store's own error) on a failure; ``run_all`` runs them all.

Data files go through the store's own backend by name (storage/files.StoreFiles: the store
turns a name into what its backend opens), with page-aligned buffers and BLOCK-multiple sizes,
so an O_DIRECT backend passes too.
Every check asserts a rule a broken store would fail: a store that lists foreign files, raises
on a missing file, shows a half-replaced manifest or lets two claims coexist fails here.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

from ckptio.alignment import BLOCK, is_aligned
from ckptio.errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CkptError,
    IncompleteCheckpointError,
    StorageIOError,
)
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.io.stage import StagingPool
from ckptio.options import MiB, Options
from ckptio.storage.files import Capabilities, StoreFiles
from ckptio.storage.steps import is_committed
from ckptio.storage.store_contract import Store, TreeStore, is_ours, new_save_id
from ckptio.testing import tree_conformance as tree

Factory = Callable[[str], Store]
Refuser = Callable[[Store, str], AbstractContextManager[Any]]
TIMEOUT = 60.0  # seconds a claim or request may take before a check gives up (a hang)
OPTIONS = Options(buffer_bytes=MiB, pool_bytes=2 * MiB)

__all__ = [
    "CHECKS", "Factory", "Refuser", "StoreConformance", "check_files_by_name",
    "check_read_file", "data_name", "read_file", "write_file",
    "check_commit_is_conditional", "check_commit_replaces_atomically",
    "check_commit_round_trip", "check_exclusive_serialises", "check_names_only_ours",
    "check_never_committed_is_not_found", "check_prepare", "check_protocol",
    "check_remove_never_raises", "check_remove_returns_failures", "check_sizes", "run_all",
]


# -- helpers ---------------------------------------------------------------------------------

def _pattern(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def data_name(index: int = 0, save_id: str | None = None) -> str:
    """A data file name as a ckptio save makes it (layout.data_file_name)."""
    return f"data-{save_id or new_save_id()}-r00000-{index:04d}.bin"


def write_file(store: Store, name: str, data: bytes) -> None:
    """Write ``data`` (a multiple of BLOCK bytes) as file ``name`` through the store's backend."""
    if not is_aligned(len(data)):
        raise ValueError(f"write_file needs a multiple of {BLOCK} bytes, got {len(data)}")
    files = StoreFiles(store, store.backend(OPTIONS))
    pool = StagingPool(1, max(MiB, len(data)))
    try:
        fh = files.open_write(name, len(data))
        try:
            if data:
                buf = pool.acquire()
                buf.view[:len(data)] = data
                done = files.submit_write(fh, 0, buf.view[:len(data)]).result(TIMEOUT)
                assert done == len(data), f"a write of {len(data)} bytes reported {done}"
                pool.release(buf)
        finally:
            files.close(fh, sync=True)
    finally:
        files.backend.shutdown()


def read_file(store: Store, name: str, nbytes: int) -> bytes:
    """Up to ``nbytes`` (a multiple of BLOCK) of file ``name``, through the store's backend."""
    files = StoreFiles(store, store.backend(OPTIONS))
    pool = StagingPool(1, max(MiB, nbytes))
    try:
        fh = files.open_read(name)
        try:
            buf = pool.acquire()
            got = files.submit_read(fh, 0, buf.view[:nbytes]).result(TIMEOUT)
            data = bytes(buf.view[:got])
            pool.release(buf)
            return data
        finally:
            files.close(fh, sync=False)
    finally:
        files.backend.shutdown()


def _manifest(tag: str, nbytes: int) -> bytes:
    """Distinct manifest-like bytes: every byte depends on ``tag``, so a mix is detectable."""
    fill = _pattern(nbytes, zlib.crc32(tag.encode())).hex().encode()[:nbytes]
    return f'{{"tag": "{tag}", "fill": "'.encode() + fill + b'"}'


def _committed(store: Store, tag: str, nbytes: int = 256) -> bytes:
    manifest = _manifest(tag, nbytes)
    store.commit(manifest, new_save_id())
    return manifest


def _no_deletion_advice(error: BaseException) -> None:
    text = str(error).lower()
    for word in ("delete", "rm -", "remove it", "remove the"):
        assert word not in text, f"a message must never advise deleting: {error}"


# -- the checks ------------------------------------------------------------------------------

def check_protocol(make: Factory) -> None:
    """The store satisfies the Store protocol, names its location, says what it can do as a
    Capabilities record and keys its backend by a kind two handles of one location share."""
    store = make("protocol")
    assert isinstance(store, Store), f"{type(store).__name__} lacks Store methods"
    assert isinstance(store.location, str) and store.location, "Store.location: a non-empty str"
    caps = store.capabilities
    assert isinstance(caps, Capabilities), f"Store.capabilities: a Capabilities, got {caps!r}"
    for field in ("direct_io", "registered_buffers", "rename", "locking", "conditional_commit"):
        assert isinstance(getattr(caps, field), bool), f"Capabilities.{field}: a bool"
    assert caps.filesystem is None or isinstance(caps.filesystem, str)
    assert isinstance(store.backend_kind, str) and store.backend_kind
    assert make("protocol").backend_kind == store.backend_kind


def check_prepare(make: Factory) -> None:
    """prepare() makes an empty location (twice is fine): nothing committed, nothing listed."""
    store = make("prepare")
    store.prepare()
    store.prepare()
    assert store.names() == [], "a new location lists no file"
    assert not is_committed(store), "a new location has no committed manifest"
    with pytest.raises(CheckpointNotFoundError) as info:
        store.read_manifest()
    assert type(info.value) is CheckpointNotFoundError, "empty is not an interrupted save"
    assert store.location in str(info.value)
    _no_deletion_advice(info.value)


def check_never_committed_is_not_found(make: Factory) -> None:
    """read_manifest names what a location without a manifest holds: nothing at all
    (CheckpointNotFoundError), only a ckptio save's files (IncompleteCheckpointError), or only
    files that are not ckptio's (CheckpointNotFoundError). No message advises deleting."""
    never = make("never-used")
    with pytest.raises(CheckpointNotFoundError) as info:
        never.read_manifest()
    assert never.location in str(info.value)
    partial = make("partial")
    partial.prepare()
    write_file(partial, data_name(), _pattern(BLOCK, 1))
    with pytest.raises(IncompleteCheckpointError) as incomplete:
        partial.read_manifest()
    assert partial.location in str(incomplete.value)
    foreign = make("foreign")
    foreign.prepare()
    write_file(foreign, "notes.txt", _pattern(BLOCK, 2))
    with pytest.raises(CheckpointNotFoundError) as other:
        foreign.read_manifest()
    assert type(other.value) is CheckpointNotFoundError, "a foreign file is no partial save"
    assert "notes.txt" in str(other.value), f"the message says what is there: {other.value}"
    for error in (info.value, incomplete.value, other.value):
        _no_deletion_advice(error)


def check_commit_round_trip(make: Factory) -> None:
    """commit then read_manifest gives the same bytes, through another handle of the location
    too; the manifest counts as committed and is not among the save's files; a second commit
    replaces the first."""
    store = make("round-trip")
    store.prepare()
    first = _committed(store, "first", 3 * BLOCK + 17)
    assert store.read_manifest() == first
    again = make("round-trip")
    assert again.read_manifest() == first, "another handle of the location sees the commit"
    assert is_committed(again) and again.sizes([MANIFEST_NAME]) == {MANIFEST_NAME: len(first)}
    assert store.names() == [], f"a commit leaves no file of its own behind: {store.names()}"
    second = _committed(store, "second", 100)
    assert again.read_manifest() == second


def check_commit_replaces_atomically(make: Factory, *, commits: int = 12,
                                     nbytes: int = 256 * 1024) -> None:
    """While commits alternate between two manifests of different sizes, a reader (another
    handle) sees exactly one of them at every read, never a mix, a truncation or an error."""
    writer, reader = make("atomic"), make("atomic")
    writer.prepare()
    versions = [_manifest("old", nbytes), _manifest("new", nbytes + 3 * BLOCK + 5)]
    writer.commit(versions[0], new_save_id())
    reads: list[int] = []  # one per read: 0 or 1 (the version seen), else the size of a mix
    errors: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set() or not reads:
            try:
                got = reader.read_manifest()
            except BaseException as exc:  # noqa: BLE001 - reported by the check below
                errors.append(exc)
                return
            reads.append(versions.index(got) if got in versions else -len(got) - 1)

    thread = threading.Thread(target=read, name="store-conformance-reader")
    thread.start()
    try:
        for i in range(commits):
            writer.commit(versions[(i + 1) % 2], new_save_id())
    finally:
        stop.set()
        thread.join(TIMEOUT)
    assert not errors, f"a read during commits failed: {errors[0]!r}"
    mixed = [-r - 1 for r in reads if r < 0]
    assert not mixed, f"{len(mixed)} of {len(reads)} reads saw neither manifest (sizes {mixed[:3]})"
    assert reader.read_manifest() == versions[commits % 2]
    assert writer.names() == [], "commits left files behind"


def check_commit_is_conditional(make: Factory) -> None:
    """With capabilities.conditional_commit: a commit under a claim is refused
    (CheckpointLockedError naming the location) when another handle committed since the claim
    was taken; the other commit stays, and nothing of the refused one is left. A commit under a
    claim taken after that succeeds; a claim of another location is refused (CkptError)."""
    store, other = make("conditional"), make("conditional")
    if not store.capabilities.conditional_commit:
        pytest.skip(f"{type(store).__name__} does not support conditional commits")
    store.prepare()
    _committed(store, "before")
    claim = store.exclusive("raise")
    try:
        theirs = _committed(other, "theirs")  # a writer that ignores the claim
        with pytest.raises(CheckpointLockedError) as info:
            store.commit(_manifest("mine", 64), new_save_id(), claim)
        assert store.location in str(info.value)
        assert store.read_manifest() == theirs, "the refused commit replaced the manifest"
        assert store.names() == [], f"the refused commit left files: {store.names()}"
    finally:
        claim.release()
    claim = store.exclusive("raise")
    try:
        mine = _manifest("mine", 64)
        store.commit(mine, new_save_id(), claim)
        assert other.read_manifest() == mine
    finally:
        claim.release()
    elsewhere = make("conditional-elsewhere")
    foreign_claim = elsewhere.exclusive("raise")
    try:
        with pytest.raises(CkptError):
            store.commit(_manifest("wrong claim", 64), new_save_id(), foreign_claim)
        assert store.read_manifest() == mine
    finally:
        foreign_claim.release()


def check_exclusive_serialises(make: Factory) -> None:
    """One claim per location across handles: a second "raise" claim is refused naming the
    location, a "wait" claim waits until the first is released; a released claim can be
    taken again; release() twice is harmless; other locations are not affected."""
    first, second = make("exclusive"), make("exclusive")
    claim = first.exclusive("raise")
    try:
        with pytest.raises(CheckpointLockedError) as info:
            second.exclusive("raise")
        assert first.location in str(info.value)
        make("exclusive-other").exclusive("raise").release()  # another location: free
        waited = _wait_for_claim(second, claim)
    finally:
        claim.release()
    assert waited.wait(TIMEOUT), "a 'wait' claim was not granted after the holder released"
    retaken = first.exclusive("raise")
    retaken.release()
    retaken.release()
    with pytest.raises(CkptError):
        first.exclusive("never")


def _wait_for_claim(store: Store, held: Any) -> threading.Event:
    """Start a thread taking a "wait" claim on ``store`` (released at once once granted); check
    it is still waiting while ``held`` is held; -> set when granted."""
    granted = threading.Event()

    def take() -> None:
        store.exclusive("wait").release()
        granted.set()

    threading.Thread(target=take, name="store-conformance-waiter", daemon=True).start()
    time.sleep(0.3)
    assert not granted.is_set(), "a 'wait' claim was granted while another claim was held"
    return granted


def check_names_only_ours(make: Factory) -> None:
    """names() lists exactly the files a ckptio save creates, sorted: not the manifest, not a
    claim's own files, not a user's files that only look alike."""
    store = make("names")
    store.prepare()
    ours = sorted([data_name(0), data_name(1)])
    for i, name in enumerate([*ours, "data-00000-of-00001.arrow", "data-notes.txt", "notes.txt"]):
        write_file(store, name, _pattern(BLOCK, 10 + i))
    _committed(store, "names")
    claim = store.exclusive("raise")
    try:
        assert store.names() == ours, store.names()
        assert all(is_ours(name) for name in store.names())
    finally:
        claim.release()
    assert make("names").names() == ours


def check_remove_never_raises(make: Factory) -> None:
    """remove() deletes the named files only, tolerates missing ones and returns no failure;
    a name that is not a plain file name is a failure returned, not raised, and touches
    nothing."""
    store = make("remove")
    store.prepare()
    gone, kept = data_name(0), data_name(1)
    write_file(store, gone, _pattern(BLOCK, 20))
    write_file(store, kept, _pattern(BLOCK, 21))
    write_file(store, "mine.txt", _pattern(BLOCK, 22))
    assert store.remove([gone, data_name(2), gone]) == []
    assert store.sizes([gone, kept, "mine.txt"]) == {kept: BLOCK, "mine.txt": BLOCK}
    assert store.remove([]) == []
    failed = store.remove(["../" + kept, "a/" + kept])
    assert len(failed) == 2 and failed[0].startswith("../"), failed
    assert store.names() == [kept]


def check_remove_returns_failures(make: Factory, refuse: Refuser) -> None:
    """A removal that fails is returned as "name: why" (not raised), the others still happen,
    and the refused file stays."""
    store = make("remove-fails")
    store.prepare()
    refused, other = data_name(0), data_name(1)
    write_file(store, refused, _pattern(BLOCK, 30))
    write_file(store, other, _pattern(BLOCK, 31))
    with refuse(store, refused):
        failed = store.remove([refused, other])
    assert len(failed) == 1 and failed[0].startswith(f"{refused}: "), failed
    assert store.names() == [refused]


def check_sizes(make: Factory) -> None:
    """sizes() gives each present file's exact size (an empty file too, the manifest too);
    a missing file is absent; any iterable of names will do."""
    store = make("sizes")
    store.prepare()
    files = {data_name(i): size for i, size in enumerate((0, BLOCK, 3 * BLOCK))}
    for i, (name, size) in enumerate(files.items()):
        write_file(store, name, _pattern(size, 40 + i))
    manifest = _committed(store, "sizes", 999)
    want = {**files, MANIFEST_NAME: len(manifest)}
    asked = (n for n in [*files, MANIFEST_NAME, data_name(9)])
    assert store.sizes(asked) == want
    assert store.sizes([]) == {}


def check_files_by_name(make: Factory) -> None:
    """The store's files (its backend, by name) write a data file and read it back bitwise,
    through another handle of the location too; names that are not plain are refused."""
    store = make("data")
    store.prepare()
    name, data = data_name(), _pattern(5 * BLOCK, 50)
    write_file(store, name, data)
    again = make("data")
    assert again.path_of(name) == store.path_of(name)
    assert read_file(again, name, len(data)) == data
    assert store.sizes([name]) == {name: len(data)}
    assert store.path_of(name) != store.path_of(data_name())
    for bad in ("", ".", "..", "../x", "a/b"):
        with pytest.raises(CkptError):
            store.path_of(bad)


def check_read_file(make: Factory) -> None:
    """read_file gives any byte range of a stored file without the staging pool (whole, a
    middle part, an empty one), and StorageIOError for a missing file or a range past its end."""
    store = make("small")
    store.prepare()
    name, data = data_name(), _pattern(3 * BLOCK, 51)
    write_file(store, name, data)
    assert store.read_file(name) == data
    assert store.read_file(name, 100, 5000) == data[100:5100]
    assert store.read_file(name, BLOCK, 0) == b""
    with pytest.raises(StorageIOError):
        store.read_file(name, len(data) - 10, 20)
    with pytest.raises(StorageIOError):
        store.read_file(data_name())


CHECKS: dict[str, Callable[[Factory], None]] = {
    "protocol": check_protocol,
    "prepare": check_prepare,
    "never_committed_is_not_found": check_never_committed_is_not_found,
    "commit_round_trip": check_commit_round_trip,
    "commit_replaces_atomically": check_commit_replaces_atomically,
    "commit_is_conditional": check_commit_is_conditional,
    "exclusive_serialises": check_exclusive_serialises,
    "names_only_ours": check_names_only_ours,
    "remove_never_raises": check_remove_never_raises,
    "sizes": check_sizes,
    "files_by_name": check_files_by_name,
    "read_file": check_read_file,
}


def run_all(make: Factory, refuse: Refuser | None = None) -> None:
    """Every check (the removal failure one only with ``refuse``; the TreeStore ones,
    tree_conformance.py, only for a TreeStore)."""
    for check in CHECKS.values():
        check(make)
    if isinstance(make("protocol"), TreeStore):
        for check in tree.TREE_CHECKS.values():
            check(make)
    if refuse is not None:
        check_remove_returns_failures(make, refuse)


# -- pytest ----------------------------------------------------------------------------------

class StoreConformance:
    """Subclass as ``TestSomething(StoreConformance)`` and provide ``store_factory``."""

    @pytest.fixture
    def store_factory(self) -> Factory:
        raise NotImplementedError("a conformance test class must define the store_factory fixture")

    @pytest.fixture
    def refuse_removal(self) -> Refuser | None:
        return None

    def test_protocol(self, store_factory: Factory) -> None:
        check_protocol(store_factory)

    def test_prepare(self, store_factory: Factory) -> None:
        check_prepare(store_factory)

    def test_never_committed_is_not_found(self, store_factory: Factory) -> None:
        check_never_committed_is_not_found(store_factory)

    def test_commit_round_trip(self, store_factory: Factory) -> None:
        check_commit_round_trip(store_factory)

    def test_commit_replaces_atomically(self, store_factory: Factory) -> None:
        check_commit_replaces_atomically(store_factory)

    def test_commit_is_conditional(self, store_factory: Factory) -> None:
        check_commit_is_conditional(store_factory)

    def test_exclusive_serialises(self, store_factory: Factory) -> None:
        check_exclusive_serialises(store_factory)

    def test_names_only_ours(self, store_factory: Factory) -> None:
        check_names_only_ours(store_factory)

    def test_remove_never_raises(self, store_factory: Factory) -> None:
        check_remove_never_raises(store_factory)

    def test_remove_returns_failures(self, store_factory: Factory,
                                     refuse_removal: Refuser | None) -> None:
        if refuse_removal is None:
            pytest.skip("no refuse_removal fixture: this store cannot be made to fail a removal")
        check_remove_returns_failures(store_factory, refuse_removal)

    def test_sizes(self, store_factory: Factory) -> None:
        check_sizes(store_factory)

    def test_read_file(self, store_factory: Factory) -> None:
        check_read_file(store_factory)

    def test_files_by_name(self, store_factory: Factory) -> None:
        check_files_by_name(store_factory)

    def test_tree_write_file(self, store_factory: Factory) -> None:
        tree.check_tree_write_file(store_factory)

    def test_tree_read_into(self, store_factory: Factory) -> None:
        tree.check_tree_read_into(store_factory)

    def test_tree_child_and_entries(self, store_factory: Factory) -> None:
        tree.check_tree_child_and_entries(store_factory)

    def test_tree_remove_tree(self, store_factory: Factory) -> None:
        tree.check_tree_remove_tree(store_factory)

    def test_tree_move_to(self, store_factory: Factory) -> None:
        tree.check_tree_move_to(store_factory)
