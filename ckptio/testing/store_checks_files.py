"""The Store checks of a location and its files: the protocol and capabilities, prepare,
names listing only a save's files, removal that returns failures instead of raising, exact
sizes, data files by name through the store's backend, and byte ranges read without the pool.

Call order: each ``check_*(make)`` runs one group of checks and raises AssertionError (or the
store's own error); store_conformance.py runs them all, or as pytest tests.

Owns: these checks. Does not own: their helpers (store_check_tools.py), the commit and claim
checks (store_checks_commit.py), the stores (ckptio/storage/).
"""

from __future__ import annotations

import pytest

from ckptio.alignment import BLOCK
from ckptio.errors import CheckpointNotFoundError, CkptError, StorageIOError
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.files import Capabilities
from ckptio.storage.steps import is_committed
from ckptio.storage.store_contract import Store, is_ours
from ckptio.testing.store_check_tools import (
    Factory,
    Refuser,
    assert_no_deletion_advice,
    commit_tagged,
    data_name,
    random_bytes,
    read_file,
    write_file,
)

__all__ = [
    "check_files_by_name",
    "check_names_only_ours",
    "check_prepare",
    "check_protocol",
    "check_read_file",
    "check_remove_never_raises",
    "check_remove_returns_failures",
    "check_sizes",
]


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
    assert_no_deletion_advice(info.value)


def check_names_only_ours(make: Factory) -> None:
    """names() lists exactly the files a ckptio save creates, sorted: not the manifest, not a
    claim's own files, not a user's files that only look alike."""
    store = make("names")
    store.prepare()
    ours = sorted([data_name(0), data_name(1)])
    for i, name in enumerate([*ours, "data-00000-of-00001.arrow", "data-notes.txt", "notes.txt"]):
        write_file(store, name, random_bytes(BLOCK, 10 + i))
    commit_tagged(store, "names")
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
    write_file(store, gone, random_bytes(BLOCK, 20))
    write_file(store, kept, random_bytes(BLOCK, 21))
    write_file(store, "mine.txt", random_bytes(BLOCK, 22))
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
    write_file(store, refused, random_bytes(BLOCK, 30))
    write_file(store, other, random_bytes(BLOCK, 31))
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
        write_file(store, name, random_bytes(size, 40 + i))
    manifest = commit_tagged(store, "sizes", 999)
    want = {**files, MANIFEST_NAME: len(manifest)}
    asked = (n for n in [*files, MANIFEST_NAME, data_name(9)])
    assert store.sizes(asked) == want
    assert store.sizes([]) == {}


def check_files_by_name(make: Factory) -> None:
    """The store's files (its backend, by name) write a data file and read it back bitwise,
    through another handle of the location too; names that are not plain are refused."""
    store = make("data")
    store.prepare()
    name, data = data_name(), random_bytes(5 * BLOCK, 50)
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
    name, data = data_name(), random_bytes(3 * BLOCK, 51)
    write_file(store, name, data)
    assert store.read_file(name) == data
    assert store.read_file(name, 100, 5000) == data[100:5100]
    assert store.read_file(name, BLOCK, 0) == b""
    with pytest.raises(StorageIOError):
        store.read_file(name, len(data) - 10, 20)
    with pytest.raises(StorageIOError):
        store.read_file(data_name())
