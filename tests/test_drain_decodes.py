"""The drain's copy does not decode again a manifest this process committed: the save hands its
record to the Checkpointer's memo (saving/commits.py), keyed by the store's location and the
exact bytes committed, and the copy takes it from there (docs/BENCH_LOOP.md section 19). A step
another process or manager committed, or bytes that differ, are decoded in full; the copied
bytes are checked against the record's checksums either way. The memo lets a record go once
the drain copies its step no more (Route.done): none outlives the drain (issue 68)."""

from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio import CorruptCheckpointError
from ckptio.format import manifest as manifest_format
from ckptio.format.manifest import MANIFEST_NAME
from ckptio.format.types import Manifest, TensorEntry
from ckptio.managing.copy import copy_checkpoint
from ckptio.managing.drain import Drain
from ckptio.options import MiB
from ckptio.resources import ReusedIOResources
from ckptio.saving.commits import COMMITS_KEPT, Commits
from ckptio.storage.local.local_store import LocalStore


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Where every manifest a load, verify or copy opens was decoded (loading/opening.py)."""
    calls: list[str] = []
    real = manifest_format.decode

    def counting(raw: bytes, where: str) -> Any:
        calls.append(where)
        return real(raw, where)
    monkeypatch.setattr(manifest_format, "decode", counting)
    return calls


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.arange(4096, dtype=torch.float32) + step, "b": torch.ones(33) * step,
            "step": step}


def _restored(directory: Path, step: int) -> None:
    with ckptio.CheckpointManager(directory) as again:
        state = {"w": torch.zeros(4096), "b": torch.zeros(33), "step": 0}
        assert again.restore(state) == step
    assert torch.equal(state["w"], _state(step)["w"]) and state["step"] == step


@pytest.mark.parametrize("asynchronous", [False, True])
def test_drained_saves_decode_no_manifest(tmp_path: Path, shm: str, decodes: list[str],
                                          asynchronous: bool) -> None:
    tiers = [ckptio.Tier("shm://run", keep_last=2),
             ckptio.Tier(str(tmp_path / "disk"), every=1, keep_last=2)]
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        for step in range(1, 6):
            mgr.save(step, _state(step), asynchronous=asynchronous)
            mgr.wait()
            assert mgr.drained(60)
    assert [w for w in decodes if w.startswith(shm)] == [], "the drain decoded its own steps"
    _restored(tmp_path / "disk", 5)


def _records_kept(commits: Commits) -> int:
    """The Manifest and TensorEntry objects ``commits`` keeps alive (followed from it, types,
    modules and functions left out)."""
    seen: set[int] = set()
    todo: list[object] = [commits]
    count = 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, type(os), type(_state))):
            continue
        seen.add(id(obj))
        count += isinstance(obj, (Manifest, TensorEntry))
        todo.extend(gc.get_referents(obj))
    return count


def test_no_record_outlives_the_drain(tmp_path: Path, shm: str, decodes: list[str]) -> None:
    """Two slower tiers copy from the memory tier (every step, every other step): once the
    drain is done with a step, the memo keeps nothing of it. Before: the last few records (a
    Manifest and an entry per chunk each) stayed alive between saves."""
    tiers = [ckptio.Tier("shm://run", keep_last=2),
             ckptio.Tier(str(tmp_path / "disk"), every=1, keep_last=2),
             ckptio.Tier(str(tmp_path / "every2"), every=2, keep_last=2)]
    ck = ckptio.Checkpointer()
    try:
        with ckptio.CheckpointManager(tiers=tiers, checkpointer=ck) as mgr:
            for step in range(1, 7):
                mgr.save(step, _state(step), asynchronous=True)
                mgr.wait()
                assert mgr.drained(60)
                assert _records_kept(ck.resources().commits) == 0, step
            copied = {row["tier"]: [c["step"] for c in row["copied"]]
                      for row in mgr.status()[1:]}
    finally:
        ck.close()
    assert copied == {1: [1, 2, 3, 4, 5, 6], 2: [2, 4, 6]}, copied
    assert [w for w in decodes if w.startswith(shm)] == [], "the drain decoded its own steps"
    _restored(tmp_path / "every2", 6)


class _Gated:
    """A drain Route whose ``holds`` waits for ``gate`` (the drain falls behind), each tier's
    first call setting ``entered[tier]``; every step is held already, so nothing is copied;
    ``done`` records the steps let go. ``open_tiers``: tiers whose calls do not wait."""

    def __init__(self, open_tiers: tuple[int, ...] = ()) -> None:
        self.entered = {k: threading.Event() for k in (1, 2)}
        self.gate = threading.Event()
        self.open_tiers = open_tiers
        self.done_steps: list[int] = []
        self.held: list[tuple[int, int]] = []  # (tier, step) asked, in order

    def holds(self, step: int, tier: int) -> bool:
        self.entered[tier].set()
        self.held.append((tier, step))
        if tier not in self.open_tiers:
            assert self.gate.wait(30)
        return True

    def done(self, step: int) -> None:
        self.done_steps.append(step)


def test_the_drain_lets_a_step_go_once_no_lane_wants_it() -> None:
    """Each step once: when skipped by every lane that wanted it, after its last copy, or at
    once when due nowhere (tier 2 is every other step)."""
    route = _Gated()
    options = ckptio.Options(buffer_bytes=MiB, pool_bytes=2 * MiB)
    drain = Drain(route, [1, 1, 2], options)  # type: ignore[arg-type]
    try:
        drain.submit(1)  # tier 1 only: its copy starts and waits
        assert route.entered[1].wait(30)
        drain.submit(2)  # due in tiers 1 and 2: tier 2's copy of it starts and waits
        assert route.entered[2].wait(30)
        drain.submit(3)  # tier 1 skips 2, which tier 2 is copying
        assert route.done_steps == []
        drain.submit(4)  # tier 1 skips 3 (wanted nowhere else), tier 2 wants 4 next
        assert route.done_steps == [3]
        drain.submit(5)  # tier 1 skips 4; tier 2 still wants it
        assert route.done_steps == [3]
        route.gate.set()
        assert drain.wait(30)
        assert sorted(route.done_steps) == [1, 2, 3, 4, 5], route.done_steps
    finally:
        route.gate.set()
        drain.close()
    assert drain.status()[1]["skipped"] == [2, 3, 4] and drain.status()[2]["skipped"] == []
    route = _Gated()
    route.gate.set()
    drain = Drain(route, [1, 2], options)  # type: ignore[arg-type]
    try:
        drain.submit(1)  # due nowhere
        assert route.done_steps == [1]
    finally:
        drain.close()


def test_a_step_another_manager_committed_is_decoded(tmp_path: Path, shm: str,
                                                     decodes: list[str]) -> None:
    """The resumed drain copies a step the first manager (its own Checkpointer) committed."""
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2)]) as first:
        first.save(2, _state(2))
    tiers = [ckptio.Tier("shm://run", keep_last=2),
             ckptio.Tier(str(tmp_path / "disk"), every=1, keep_last=2)]
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        assert mgr.drained(60)
    assert len([w for w in decodes if w.startswith(shm)]) == 1
    _restored(tmp_path / "disk", 2)


def _resources() -> ReusedIOResources:
    return ReusedIOResources(ckptio.Options(buffer_bytes=MiB, pool_bytes=2 * MiB,
                                            use_profile=False))


def test_the_copy_takes_the_record_only_for_the_same_bytes(tmp_path: Path,
                                                           decodes: list[str]) -> None:
    ck = ckptio.Checkpointer()
    try:
        ck.resources().commits.listen()  # as a manager with a drain does
        ck.save(_state(3), tmp_path / "src")
        source = LocalStore(tmp_path / "src")
        record = ck.resources().commits.known(source.location, source.read_manifest())
    finally:
        ck.close()
    assert record is not None
    resources = _resources()
    try:
        copy_checkpoint(resources, source, LocalStore(tmp_path / "a"), known=lambda _d: record)
        assert decodes == []
        copy_checkpoint(resources, source, LocalStore(tmp_path / "b"),  # other bytes: decoded
                        known=lambda d: record if d == b"other" else None)
        assert len(decodes) == 1
        entry = next(e for e in record.tensors if e.key == "w")
        with open(tmp_path / "src" / entry.file, "r+b") as f:  # a flipped byte still fails
            f.seek(entry.offset + 5)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CorruptCheckpointError, match="key 'w'"):
            copy_checkpoint(resources, source, LocalStore(tmp_path / "c"), known=lambda _d: record)
        assert len(decodes) == 1
    finally:
        resources.release()
    assert not os.path.exists(tmp_path / "c" / MANIFEST_NAME)
    assert torch.equal(ckptio.load(tmp_path / "a")["w"], _state(3)["w"])


def test_commits_keep_the_last_few_by_exact_bytes() -> None:
    commits, record = Commits(), object()
    commits.remember("/x/1", b"one", record)  # type: ignore[arg-type]
    assert commits.known("/x/1", b"one") is None, "nothing kept before a drain listens"
    commits.listen()
    commits.remember("/x/1", b"one", record)  # type: ignore[arg-type]
    assert commits.known("/x/1", b"one") is record
    assert commits.known("/x/1", b"one!") is None and commits.known("/x/2", b"one") is None
    for k in range(2, 2 + COMMITS_KEPT):
        commits.remember(f"/x/{k}", b"k", record)  # type: ignore[arg-type]
    assert commits.known("/x/1", b"one") is None, "the oldest is let go"


def test_a_slow_tier_holds_up_only_its_own_copies() -> None:
    """Each slower tier's copies run on a thread of their own: while tier 2's copy of step 1
    waits (an object store retrying through an outage), tier 1 copies every step submitted,
    none skipped (a new user's trial: the disk tier had skipped every step for the whole S3
    outage, its newest step left minutes old)."""
    route = _Gated(open_tiers=(1,))
    options = ckptio.Options(buffer_bytes=MiB, pool_bytes=2 * MiB)
    drain = Drain(route, [1, 1, 1], options)  # type: ignore[arg-type]
    try:
        for step in (1, 2, 3, 4):
            drain.submit(step)
            deadline = time.monotonic() + 30
            while (1, step) not in route.held and time.monotonic() < deadline:
                time.sleep(0.01)  # tier 1 reaches each step before the next is submitted
            assert route.entered[2].wait(30)  # tier 2 stuck on step 1 from the first
        assert [s for k, s in route.held if k == 1] == [1, 2, 3, 4]
        assert drain.status()[1]["skipped"] == []
        assert not drain.wait(0.1)  # tier 2 still copying
        route.gate.set()
        assert drain.wait(30)
    finally:
        route.gate.set()
        drain.close()
    assert drain.status()[2]["skipped"] == [2, 3]  # tier 2 went from 1 to the newest, 4
