"""The Store checks of commits and claims: a location never committed is told apart from an
interrupted save, a commit reads back bitwise through another handle, replaces the manifest
atomically while readers read, is refused under a foreign or stale claim, and claims serialise.

Call order: each ``check_*(make)`` runs one group of checks and raises AssertionError (or the
store's own error); store_conformance.py runs them all, or as pytest tests.

Owns: these checks. Does not own: their helpers (store_check_tools.py), the file checks
(store_checks_files.py), the stores (ckptio/storage/).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ckptio.alignment import BLOCK
from ckptio.errors import (
    CheckpointLockedError,
    CheckpointNotFoundError,
    CkptError,
    IncompleteCheckpointError,
)
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.storage.steps import is_committed
from ckptio.storage.store_contract import Store, new_save_id
from ckptio.testing.store_check_tools import (
    TIMEOUT,
    Factory,
    assert_no_deletion_advice,
    commit_tagged,
    data_name,
    manifest_bytes,
    random_bytes,
    write_file,
)

__all__ = [
    "check_commit_is_conditional",
    "check_commit_replaces_atomically",
    "check_commit_round_trip",
    "check_exclusive_serialises",
    "check_never_committed_is_not_found",
]


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
    write_file(partial, data_name(), random_bytes(BLOCK, 1))
    with pytest.raises(IncompleteCheckpointError) as incomplete:
        partial.read_manifest()
    assert partial.location in str(incomplete.value)
    foreign = make("foreign")
    foreign.prepare()
    write_file(foreign, "notes.txt", random_bytes(BLOCK, 2))
    with pytest.raises(CheckpointNotFoundError) as other:
        foreign.read_manifest()
    assert type(other.value) is CheckpointNotFoundError, "a foreign file is no partial save"
    assert "notes.txt" in str(other.value), f"the message says what is there: {other.value}"
    for error in (info.value, incomplete.value, other.value):
        assert_no_deletion_advice(error)


def check_commit_round_trip(make: Factory) -> None:
    """commit then read_manifest gives the same bytes, through another handle of the location
    too; the manifest counts as committed and is not among the save's files; a second commit
    replaces the first."""
    store = make("round-trip")
    store.prepare()
    first = commit_tagged(store, "first", 3 * BLOCK + 17)
    assert store.read_manifest() == first
    again = make("round-trip")
    assert again.read_manifest() == first, "another handle of the location sees the commit"
    assert is_committed(again) and again.sizes([MANIFEST_NAME]) == {MANIFEST_NAME: len(first)}
    assert store.names() == [], f"a commit leaves no file of its own behind: {store.names()}"
    second = commit_tagged(store, "second", 100)
    assert again.read_manifest() == second


def check_commit_replaces_atomically(make: Factory, *, commits: int = 12,
                                     nbytes: int = 256 * 1024) -> None:
    """While commits alternate between two manifests of different sizes, a reader (another
    handle) sees exactly one of them at every read, never a mix, a truncation or an error."""
    writer, reader = make("atomic"), make("atomic")
    writer.prepare()
    versions = [manifest_bytes("old", nbytes), manifest_bytes("new", nbytes + 3 * BLOCK + 5)]
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
    commit_tagged(store, "before")
    claim = store.exclusive("raise")
    try:
        theirs = commit_tagged(other, "theirs")  # a writer that ignores the claim
        with pytest.raises(CheckpointLockedError) as info:
            store.commit(manifest_bytes("mine", 64), new_save_id(), claim)
        assert store.location in str(info.value)
        assert store.read_manifest() == theirs, "the refused commit replaced the manifest"
        assert store.names() == [], f"the refused commit left files: {store.names()}"
    finally:
        claim.release()
    claim = store.exclusive("raise")
    try:
        mine = manifest_bytes("mine", 64)
        store.commit(mine, new_save_id(), claim)
        assert other.read_manifest() == mine
    finally:
        claim.release()
    elsewhere = make("conditional-elsewhere")
    foreign_claim = elsewhere.exclusive("raise")
    try:
        with pytest.raises(CkptError):
            store.commit(manifest_bytes("wrong claim", 64), new_save_id(), foreign_claim)
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
