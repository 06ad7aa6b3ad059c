"""The conformance checks of a TreeStore (storage/store_contract.py): sub-locations and whole named files.

Part of the Store conformance suite (store_conformance.StoreConformance runs them; a store that
is only a Store skips them). Each ``check_tree_*(make)`` takes the suite's factory ``make(key)``
(a store at a fresh location per key) and raises AssertionError on a broken rule: a write seen
in part, a listing that misses a file or a sub-location, a removal that leaves something or
reaches a sibling, a move that loses a committed manifest or keeps the target's old files.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from ckptio.alignment import BLOCK
from ckptio.errors import CheckpointNotFoundError, CkptError, StorageIOError
from ckptio.storage.store_contract import Store, TreeStore, new_save_id

__all__ = ["TREE_CHECKS", "check_tree_child_and_entries", "check_tree_move_to",
           "check_tree_read_into", "check_tree_remove_tree", "check_tree_write_file", "tree"]

Factory = Callable[[str], Store]


def tree(make: Factory, key: str) -> TreeStore:
    """``make(key)`` as a TreeStore; skips the calling test for a store that is only a Store."""
    store = make(key)
    if not isinstance(store, TreeStore):
        pytest.skip(f"{type(store).__name__} is a Store, not a TreeStore")
    return store


def _bytes(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def check_tree_write_file(make: Factory) -> None:
    """write_file makes the location, writes the whole file (bytes or a memoryview), replaces
    it whole, and refuses a name that is not plain."""
    store = tree(make, "tree-write")
    first, second = _bytes(3 * BLOCK + 5, 1), _bytes(100, 2)
    store.write_file("held-r00001.json", first)
    assert store.read_file("held-r00001.json") == first
    store.write_file("held-r00001.json", memoryview(second))
    assert store.read_file("held-r00001.json") == second, "the old bytes are replaced whole"
    assert store.sizes(["held-r00001.json"]) == {"held-r00001.json": len(second)}
    assert make("tree-write").read_file("held-r00001.json") == second, "another handle sees it"
    store.write_file("empty.bin", b"")
    assert store.read_file("empty.bin") == b""
    with pytest.raises(CkptError):
        store.write_file("a/b.json", b"x")


def check_tree_read_into(make: Factory) -> None:
    """read_into fills a buffer from an offset, fewer bytes only at the file's end, and raises
    StorageIOError for a missing file."""
    store = tree(make, "tree-read-into")
    data = _bytes(2 * BLOCK + 100, 3)
    store.write_file("parity-g0-l0.bin", data)
    into = bytearray(len(data) + 50)
    assert store.read_into("parity-g0-l0.bin", memoryview(into)) == len(data)
    assert bytes(into[:len(data)]) == data
    part = bytearray(BLOCK)
    assert store.read_into("parity-g0-l0.bin", memoryview(part), BLOCK + 7) == BLOCK
    assert bytes(part) == data[BLOCK + 7:2 * BLOCK + 7]
    assert store.read_into("parity-g0-l0.bin", memoryview(part), len(data) - 10) == 10
    assert store.read_into("parity-g0-l0.bin", memoryview(bytearray(0))) == 0
    with pytest.raises(StorageIOError):
        store.read_into("missing.bin", memoryview(part))


def check_tree_child_and_entries(make: Factory) -> None:
    """A child is a store of the same kind beneath its parent; entries() lists files and
    sub-locations (whatever wrote them), [] where nothing is."""
    parent = tree(make, "tree-entries")
    assert parent.entries() == []
    parent.write_file("protected-r00000.json", b"{}")
    child = parent.child("step-5")
    assert isinstance(child, TreeStore) and child.location != parent.location
    assert child.backend_kind == parent.backend_kind
    child.child("copy-r00002").write_file("notes.txt", b"x")
    child.write_file("held-r00000.json", b"{}")
    assert parent.entries() == ["protected-r00000.json", "step-5"]
    assert child.entries() == ["copy-r00002", "held-r00000.json"]
    assert parent.child("step-5").child("copy-r00002").read_file("notes.txt") == b"x"
    assert parent.child("step-6").entries() == []
    with pytest.raises(CkptError):
        parent.child("../escape")


def check_tree_remove_tree(make: Factory) -> None:
    """remove_tree deletes a location with its files and sub-locations, and nothing beside it;
    a missing location is fine."""
    parent = tree(make, "tree-remove")
    doomed, kept = parent.child("step-1"), parent.child("step-2")
    doomed.write_file("a.json", b"a")
    doomed.child("copy-r00001").write_file("b.bin", _bytes(BLOCK, 4))
    kept.write_file("c.json", b"c")
    assert doomed.remove_tree() == []
    assert doomed.entries() == [] and parent.entries() == ["step-2"]
    assert kept.read_file("c.json") == b"c", "a sibling is untouched"
    assert parent.child("never").remove_tree() == [], "a missing location is fine"


def check_tree_move_to(make: Factory) -> None:
    """move_to gives the target this location's committed checkpoint and files (what the
    target held is gone), and leaves this location empty."""
    parent = tree(make, "tree-move")
    source, target = parent.child(".rebuild-step-3"), parent.child("step-3")
    data = _bytes(BLOCK, 5)
    source.write_file("data.bin", data)
    source.prepare()
    source.commit(b'{"moved": true}', new_save_id())
    target.write_file("stale.bin", b"old")
    source.move_to(target)
    assert target.read_manifest() == b'{"moved": true}'
    assert target.read_file("data.bin") == data
    assert "stale.bin" not in target.entries(), "what the target held is replaced"
    assert source.entries() == []
    with pytest.raises(CheckpointNotFoundError):
        source.read_manifest()


TREE_CHECKS: dict[str, Callable[[Factory], None]] = {
    "tree_write_file": check_tree_write_file,
    "tree_read_into": check_tree_read_into,
    "tree_child_and_entries": check_tree_child_and_entries,
    "tree_remove_tree": check_tree_remove_tree,
    "tree_move_to": check_tree_move_to,
}
