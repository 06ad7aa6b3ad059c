"""The redundancy's layout goes through the memory tier's TreeStore (redundancy/marks.py): its markers,
partner copies and parity pieces are read and written by store methods, so the same code serves
any TreeStore (a directory, host memory), and a store that is only a Store is refused with a
message naming it."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptio.errors import CkptError
from ckptio.options import Options
from ckptio.storage.store_contract import Exclusive, Store, TreeStore
from ckptio.storage.local.local_store import LocalStore
from ckptio.storage.memory.memory_store import MemoryStore
from ckptio.redundancy import marks, peers
from ckptio.redundancy.landing import drop_scratch


class _PlainStore:
    """A user's store with the Store methods only (no sub-locations)."""

    def __init__(self, inner: MemoryStore) -> None:
        self._inner = inner
        self.location = inner.location

    capabilities = property(lambda self: self._inner.capabilities)
    backend_kind = property(lambda self: self._inner.backend_kind)

    def prepare(self) -> None:
        self._inner.prepare()

    def exclusive(self, if_locked: str) -> Exclusive:
        return self._inner.exclusive(if_locked)

    def path_of(self, name: str) -> str:
        return self._inner.path_of(name)

    def backend(self, options: Options) -> Any:
        return self._inner.backend(options)

    def commit(self, manifest: bytes, save_id: str, held: Exclusive | None = None) -> None:
        self._inner.commit(manifest, save_id, held)

    def read_file(self, name: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        return self._inner.read_file(name, offset, nbytes)

    def read_manifest(self) -> bytes:
        return self._inner.read_manifest()

    def sizes(self, names: Iterable[str]) -> dict[str, int]:
        return self._inner.sizes(names)

    def names(self) -> list[str]:
        return self._inner.names()

    def remove(self, names: Iterable[str]) -> list[str]:
        return self._inner.remove(names)


@pytest.fixture(params=["local", "memory"])
def root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TreeStore]:
    if request.param == "local":
        yield LocalStore(str(tmp_path / "shm"))
        return
    store = MemoryStore(f"mem://redundancy-{secrets.token_hex(6)}")
    yield store
    store.remove_tree()


def test_a_store_that_is_only_a_store_is_refused_naming_it() -> None:
    plain = _PlainStore(MemoryStore(f"mem://plain-{secrets.token_hex(6)}"))
    assert isinstance(plain, Store) and not isinstance(plain, TreeStore)
    with pytest.raises(CkptError, match="TreeStore") as info:
        marks.tree_of(plain)  # type: ignore[arg-type]
    assert plain.location in str(info.value)


def test_markers_copies_and_parity_through_the_store(root: TreeStore) -> None:
    """What protect.py writes (peers.write_json / write_checkpoint / write_file) is what marks.py
    reads back: the protected steps per rank, the bytes held for others, the rank-local dirs;
    removing a step's protection leaves the others."""
    assert marks.protection(root) == {} and marks.held_nbytes(root, {1}, 0) == 0
    data = torch.arange(2 * 4096, dtype=torch.uint8)
    for step in (3, 5):
        held = marks.held(root, step)
        peers.write_checkpoint(held.child(marks.copy_name(1)), b'{"m": 1}',
                               [("data-a.bin", 4096), ("data-b.bin", 4096)], data)
        held.write_file(f"{marks.parity_name(0, 0)}.bin", b"p" * 64)
        peers.write_json(held, f"protected-{marks.rank_name(2)}.json", {"step": step, "how": "x"})
    root.child(marks.rank_name(2)).write_file("keep.json", b"{}")
    assert marks.protection(root) == {3: {"how": "x", "ranks": [2]}, 5: {"how": "x", "ranks": [2]}}
    assert marks.protected_steps(root, 2) == [3, 5] and marks.protected_steps(root, 1) == []
    copy = marks.held(root, 5).child(marks.copy_name(1))
    assert copy.read_manifest() == b'{"m": 1}', "a partner copy is a committed checkpoint"
    assert copy.read_file("data-b.bin") == bytes(data[4096:].numpy())
    manifest_nbytes = len(b'{"m": 1}')
    assert marks.held_nbytes(root, {1}, 0) == 2 * (2 * 4096 + manifest_nbytes + 64)
    assert marks.held_nbytes(root, set(), 1) == 0, "another local rank's pieces are not counted"
    assert list(marks.rank_dirs(root)) == [2]
    assert json.loads(marks.held(root, 3).read_file("protected-r00002.json"))["step"] == 3
    assert marks.held_steps(root)[3].remove_tree() == []
    assert list(marks.held_steps(root)) == [5] and marks.protected_steps(root, 2) == [5]


def test_the_scratch_directories_a_killed_restore_left_are_removed_and_nothing_else(
        root: TreeStore, caplog: pytest.LogCaptureFixture) -> None:
    """landing.drop_scratch (a manager's start with redundancy): this rank's
    ``.rebuild-step-N`` directories (marks.rebuild_dirs: that exact name) go with their files,
    each logged with its bytes; its committed step, the names ckptio does not make beside them
    and another rank's scratch stay."""
    mine, other = root.child(marks.rank_name(1)), root.child(marks.rank_name(2))
    for step, nbytes in ((3, 4096), (12, 100)):
        mine.child(marks.rebuild_name(step)).write_file("data-0.bin", b"x" * nbytes)
    peers.write_checkpoint(mine.child("step-3"), b'{"m": 1}', [("data-0.bin", 8)],
                           torch.zeros(8, dtype=torch.uint8))
    theirs = [".rebuild-step-03", ".rebuild-step-3.keep", ".rebuild-step-", "rebuild-step-3",
              ".rebuild-step-3x"]
    for name in theirs:
        mine.child(name).write_file("x", b"kept")
    other.child(marks.rebuild_name(3)).write_file("data-0.bin", b"y")
    assert sorted(marks.rebuild_dirs(mine)) == [3, 12]
    with caplog.at_level("WARNING", logger="ckptio"):
        removed = drop_scratch(root, 1)
    gone = [mine.child(marks.rebuild_name(s)).location for s in (12, 3)]
    assert sorted(removed) == sorted(gone)
    said = [r.getMessage() for r in caplog.records]
    assert f"ckptio: removed {gone[1]} (4096 bytes): the scratch directory of a restore of " \
        "rank 1 killed before its step was installed" in said, said
    assert any(f"removed {gone[0]} (100 bytes)" in m for m in said), said
    assert mine.entries() == sorted([*theirs, "step-3"])
    assert all(mine.child(name).read_file("x") == b"kept" for name in theirs)
    assert mine.child("step-3").read_manifest() == b'{"m": 1}'
    assert other.entries() == [marks.rebuild_name(3)]
    assert drop_scratch(root, 1) == [] and drop_scratch(root, 7) == []
