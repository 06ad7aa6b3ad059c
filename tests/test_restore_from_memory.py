"""A restore from the memory tier is the copy and its hash, nothing beside it: the staging that
later saves use is faulted in after the reads, not against them, and the restore's own work
does not grow with what the state does not hold (issue 66)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import CorruptCheckpointError
from ckptio.io import stage
from ckptio.io.stage import StagingPool
from ckptio.loading import direct_reads
from tests.conftest import assert_same


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {f"w{i}": torch.randn(64, 64, generator=gen) for i in range(8)}


def test_a_restore_from_memory_holds_the_staging_prefault_back_while_it_reads(
        shm: str, monkeypatch: Any) -> None:
    """CheckpointManager.restore prepares the staging of later saves first (its pages faulted
    in on the pool's own thread); a memory tier's reads need none of it, and on few cores that
    pre-fault beside them cost the fresh process's restore several copies of the state."""
    state = _state()
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=1)]) as mgr:
        mgr.save(1, state)
    reading = threading.Event()
    faults: list[bool] = []  # per buffer pre-faulted: whether the restore's reads were running
    populate, read = stage._populate, direct_reads.read

    def slow_populate(address: int, nbytes: int) -> None:
        faults.append(reading.is_set())
        time.sleep(0.01)  # a buffer's pre-fault lasts a while, as on a loaded VM
        populate(address, nbytes)

    def watched_read(*args: Any, **kwargs: Any) -> int:
        time.sleep(0.05)  # the buffer under way when the reads began ends first
        reading.set()
        time.sleep(0.1)  # a pre-fault left running would start buffers in here
        try:
            return read(*args, **kwargs)
        finally:
            reading.clear()

    monkeypatch.setattr(stage, "_populate", slow_populate)
    monkeypatch.setattr(direct_reads, "read", watched_read)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    ck = ckptio.Checkpointer()
    try:
        mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=1)],
                                       checkpointer=ck)
        assert mgr.restore(into) == 1
        pool = ck.resources().pool
        assert pool is not None
        pool.faulted()  # and the pre-fault goes on after the restore, to the last buffer
        assert pool.resident
        mgr.close()
    finally:
        ck.close()
    assert_same(into, state)
    assert faults and not any(faults), (
        f"{sum(faults)} staging buffers were pre-faulted while the restore read from memory")


def test_a_held_back_prefault_still_faults_the_buffer_an_acquire_waits_for() -> None:
    pool = StagingPool(4, 1 << 20, background=True)
    got: list[Any] = []
    with pool.held_back():
        taker = threading.Thread(target=lambda: got.extend(pool.acquire() for _ in range(4)))
        taker.start()
        taker.join(timeout=30)
        assert not taker.is_alive(), "an acquire inside held_back() waited forever"
    assert sorted(b.index for b in got) == [0, 1, 2, 3]
    for buffer in got:
        pool.release(buffer)
    pool.close()


def test_closing_a_held_back_pool_does_not_wait_for_the_hold() -> None:
    pool = StagingPool(64, 1 << 20, background=True)
    closed = threading.Event()
    with pool.held_back():
        closer = threading.Thread(target=lambda: (pool.close(), closed.set()))
        closer.start()
        closer.join(timeout=30)
        assert closed.is_set(), "close() waited for a held-back pre-fault"


def test_a_load_from_memory_faults_no_staging_in(shm: str, monkeypatch: Any) -> None:
    """A fresh Checkpointer's load of a small state from a memory store: its entries go
    straight into their tensors, so no staging pool is pre-faulted for it (a pool made early
    for a small load's staging is for stores that stage; here it only competed)."""
    state, path = _state(), f"{shm}/step"
    ckptio.save(state, path)
    populated: list[int] = []
    populate = stage._populate

    def counted(address: int, nbytes: int) -> None:
        populated.append(nbytes)
        populate(address, nbytes)

    monkeypatch.setattr(stage, "_populate", counted)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    ck = ckptio.Checkpointer()
    try:
        ck.load(path, into)
        pool = ck.resources().pool
        if pool is not None:
            pool.faulted()  # a background pre-fault, had one started, ends here
    finally:
        ck.close()
    assert_same(into, state)
    assert populated == [], f"{len(populated)} staging buffers were pre-faulted for the load"


def test_a_restore_reads_one_manifest_and_opens_one_step_however_many_the_tier_holds(
        shm: str, monkeypatch: Any) -> None:
    """The restore's fixed work: one manifest decoded and the one step's data files opened,
    not one per step the tier keeps (the listing only names them)."""
    from ckptio.format import manifest
    from ckptio.io.posix import PosixBackend

    state = _state()
    tier = ckptio.Tier("shm://run", keep_last=6)
    with ckptio.CheckpointManager(tiers=[tier]) as mgr:
        for step in range(1, 7):
            mgr.save(step, state)
    decoded: list[str] = []
    opened: list[str] = []
    decode, open_read = manifest.decode, PosixBackend.open_read

    def counted_decode(data: bytes, where: str) -> Any:
        decoded.append(where)
        return decode(data, where)

    def counted_open(self: PosixBackend, path: str, *, cached: bool = False) -> Any:
        opened.append(path)
        return open_read(self, path, cached=cached)

    monkeypatch.setattr(manifest, "decode", counted_decode)
    monkeypatch.setattr(PosixBackend, "open_read", counted_open)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    with ckptio.CheckpointManager(tiers=[tier]) as mgr:
        assert mgr.restore(into) == 6
    assert_same(into, state)
    assert len(decoded) == 1 and "step-6" in decoded[0], decoded
    assert opened and all("step-6" in path for path in opened), opened
    assert len(opened) == len(set(opened)), f"a data file was opened twice: {opened}"


def _saved_mapped(shm: str, tiers: list[ckptio.Tier],
                  checkpointer: ckptio.Checkpointer | None = None
                  ) -> tuple[ckptio.CheckpointManager, Any]:
    """A manager whose memory tier's newest step was written through mappings its memory
    tier's root keeps (the tier's slots: from the third save on), and the state saved there."""
    state = _state()
    mgr = ckptio.CheckpointManager(tiers=tiers, checkpointer=checkpointer)
    for step in range(1, 5):
        for v in state.values():
            v.add_(1)
        mgr.save(step, state)
        assert mgr.drained(timeout=60)  # a slower tier has the step before it is damaged
    return mgr, {k: v.clone() for k, v in state.items()}


def _count_reads(monkeypatch: Any) -> list[str]:
    from ckptio.io import posix

    reads: list[str] = []
    pread_each = posix._pread_each

    def counted(fh: Any, *args: Any) -> int:
        reads.append(fh.path)
        return pread_each(fh, *args)

    monkeypatch.setattr(posix, "_pread_each", counted)
    return reads


def test_a_restore_in_the_saving_process_copies_out_of_its_mapping(
        shm: str, monkeypatch: Any) -> None:
    """A rollback (restore in the process that saved): the memory tier's files are still
    mapped here, so the load copies out of those pages, hashing each block as it lands: no
    read() into the tensors, no mapping made anew; bitwise."""
    mgr, saved = _saved_mapped(shm, [ckptio.Tier("shm://run", keep_last=1)])
    try:
        reads = _count_reads(monkeypatch)
        into = {k: torch.zeros_like(v) for k, v in saved.items()}
        assert mgr.restore(into) == 4
    finally:
        mgr.close()
    assert_same(into, saved)
    assert reads == [], f"the restore read the mapped files again: {reads}"


def test_a_rollback_leaves_the_staging_as_the_saves_sized_it(shm: str, monkeypatch: Any,
                                                             caplog: Any) -> None:
    """A restore in the process whose manager saved: the staging is the one its saves made, so
    the restore plans no save of the state and drops, makes and faults in no pool beside its
    copy (before, it sized the pool for async saves of the state: dropped the saves' pool and
    faulted a new one of the state's size in, inside the restore's call)."""
    from ckptio.saving import save_session

    ck = ckptio.Checkpointer(ckptio.Options(pool_bytes=2 << 20, buffer_bytes=1 << 20))
    gen = torch.Generator().manual_seed(7)
    saved = {f"w{i}": torch.randn(256, 1024, generator=gen) for i in range(8)}  # 8 MiB: > pool
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=1)], checkpointer=ck)
    try:
        for step in range(1, 4):
            mgr.save(step, saved)
        made: list[str] = []
        monkeypatch.setattr(StagingPool, "__init__", _counting(StagingPool.__init__, made, "made"))
        monkeypatch.setattr(StagingPool, "close", _counting(StagingPool.close, made, "closed"))
        monkeypatch.setattr(save_session, "planned_files",
                            _counting(save_session.planned_files, made, "planned"))
        before = ck.staging_nbytes
        into = {k: torch.zeros_like(v) for k, v in saved.items()}
        with caplog.at_level(logging.INFO, logger="ckptio"):
            assert mgr.restore(into) == 3
        assert made == [] and ck.staging_nbytes == before, made
        assert "restored step 3" in caplog.text and "nothing to restore" not in caplog.text
        assert_same(into, saved)
    finally:
        mgr.close()
        ck.close()


def _counting(fn: Any, calls: list[str], name: str) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)
    return counted


def _flip_in_newest(root: str) -> str:
    import glob
    import os

    (step,) = glob.glob(os.path.join(root, "step-4"))
    path = max(glob.glob(os.path.join(step, "data-*.bin")), key=os.path.getsize)
    with open(path, "r+b") as f:  # through the file: the mapping shares its pages
        f.seek(1000)
        byte = f.read(1)[0]
        f.seek(1000)
        f.write(bytes([byte ^ 0x5A]))
    return path


def test_a_flipped_byte_in_a_mapped_memory_copy_falls_back_to_disk(
        shm: str, tmp_path: Any, monkeypatch: Any) -> None:
    """The copy out of the mapping is checked as it lands: a byte flipped in the memory
    tier's file is caught, the restore says so and loads the same step from disk."""
    import os
    import warnings

    disk = str(tmp_path / "disk")
    tiers = [ckptio.Tier("shm://run", keep_last=1), ckptio.Tier(disk, keep_last=1)]
    mgr, saved = _saved_mapped(shm, tiers)
    try:
        flipped = _flip_in_newest(os.path.join(shm, "run"))
        reads = _count_reads(monkeypatch)
        into = {k: torch.zeros_like(v) for k, v in saved.items()}
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert mgr.restore(into) == 4
        assert mgr.last_restore is not None and mgr.last_restore["tier"] == 1
    finally:
        mgr.close()
    assert_same(into, saved)
    assert not any(p.startswith(shm) for p in reads), reads  # memory: copied, not read
    text = " ".join(str(w.message) for w in record)
    assert "CorruptCheckpointError" in text and "step 4 in shm://run" in text, text
    assert f"restored step 4 from {disk}" in text and flipped in text, text


def test_a_flipped_byte_in_a_mapped_file_names_it(shm: str, monkeypatch: Any) -> None:
    """With no other copy: CorruptCheckpointError naming the key and the data file."""
    import os

    ck = ckptio.Checkpointer()  # the manager's: its loads copy out of the tier's mappings
    mgr, saved = _saved_mapped(shm, [ckptio.Tier("shm://run", keep_last=1)], ck)
    try:
        flipped = _flip_in_newest(os.path.join(shm, "run"))
        reads = _count_reads(monkeypatch)
        into = {k: torch.zeros_like(v) for k, v in saved.items()}
        with pytest.raises(CorruptCheckpointError) as raised:
            ck.load(os.path.dirname(flipped), into)
    finally:
        mgr.close()
        ck.close()
    assert reads == []
    assert flipped in str(raised.value) and "checksum mismatch" in str(raised.value)


def test_a_fresh_process_imports_the_manager_with_no_collection() -> None:
    """A restarted job's first ``ckptio.CheckpointManager`` imports most of ckptio; the
    collections those allocations trigger would each walk torch's whole heap (a fixed cost of
    every restore in a fresh process). The import runs with the collector paused."""
    import subprocess
    import sys

    from benchmarks import REPO_ROOT, worker_env

    code = ("import gc, torch, ckptio\n"
            "runs = []\n"
            "gc.callbacks.append(lambda phase, info: runs.append(info['generation'])"
            " if phase == 'start' else None)\n"
            "ckptio.CheckpointManager\n"
            "gc.callbacks.clear()\n"
            "print(len(runs), runs.count(2), gc.isenabled())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    runs, full, enabled = done.stdout.split()
    # at most the young generation's, due once the collector is on again
    assert int(runs) <= 1 and full == "0" and enabled == "True", (
        f"{runs} collections ({full} full) during the manager's import; gc on after: {enabled}")
