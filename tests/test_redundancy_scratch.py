"""A lost rank's scratch directory ``r<rank>/.rebuild-step-N`` (issue 66): where its step lands
from its peers (on tmpfs: the step's data file, allocated whole) before the rename installs it.
What a restore killed mid-receive leaves is removed at the next manager's start
(redundancy/landing.drop_scratch), nothing else, and so is one of a rank number that a job
restarted on fewer ranks no longer has, unless a live process leases that rank's directory
(landing.drop_scratch_beyond); a tmpfs too full for the step's file sends
the step through this process's memory (peers.landing_buffer's fallback), the restore bitwise.

Real gloo ranks on this machine, one rank per simulated host (tests/fetch_cases.py,
tests/regrow_cases.py for the restart on fewer ranks); the full
tmpfs is a real one, mounted by this process (root) over the lost host's memory directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ckptio.storage.local import runlease
from ckptio.testing.multihost import PREFIX
from ckptio.testing.rank_processes import run_ranks
from tests import regrow_cases
from tests.fetch_cases import restore_logged, save
from tests.redundancy_cases import host_dir, wipe_host

TIMEOUT = 240
MIB = 2  # each rank's state; the lost host's tmpfs below holds half of it


@pytest.fixture
def base(hosts_base: str) -> str:
    return hosts_base


def test_a_restore_killed_as_it_receives_leaves_a_scratch_directory_the_next_start_removes(
        base, tmp_path):
    """Parity(k=3) on 4 hosts, host 1 lost; rank 1 is SIGKILLed once the first chunk of its step
    has landed in ``r00001/.rebuild-step-1`` (its data file, the step's length, allocated).
    Before: that directory and its pages stayed until a restore of that same step on that rank
    replaced it (a job that never restores, or restores another step, kept it). Now the next
    manager's start removes it, logged with its location and bytes, as it removes rank 0's
    (beside its committed step), and nothing else: the names ckptio does not make stay; every
    rank restores step 1 bitwise (rank 0's step its own)."""
    disk = str(tmp_path / "disk")
    sizes = run_ranks(4, save, base, disk, "parity", MIB, timeout_s=TIMEOUT)
    wipe_host(base, 1)
    failed = run_ranks(4, restore_logged, base, disk, "parity", MIB, 1, may_die=(1,),
                       timeout_s=TIMEOUT)
    assert failed[1] is None and all(failed[r]["error"] for r in (0, 2, 3)), failed
    lost = os.path.join(host_dir(base, 1), "run", "r00001")
    scratch = os.path.join(lost, ".rebuild-step-1")
    assert sum(e.stat().st_size for e in os.scandir(scratch)) == sizes[1]
    theirs = [".rebuild-step-1.keep", ".rebuild-step-01", "notes.txt"]  # not ckptio's names
    for name in theirs:
        with open(os.path.join(lost, name), "w", encoding="utf-8") as f:
            f.write("the user's")
    survivor = os.path.join(host_dir(base, 0), "run", "r00000")
    os.makedirs(os.path.join(survivor, ".rebuild-step-7"))  # as a kill before a write leaves
    with open(os.path.join(survivor, ".rebuild-step-7", "data-00000.bin"), "wb") as f:
        f.write(bytes(4096))

    restored = run_ranks(4, restore_logged, base, disk, "parity", MIB, timeout_s=TIMEOUT)
    started = restored[1]["listed"]  # once its manager was made, before its restore
    assert ".rebuild-step-1" not in started and set(theirs) <= set(started), started
    assert ".rebuild-step-7" not in restored[0]["listed"], restored[0]["listed"]
    assert "step-1" in restored[0]["listed"], restored[0]["listed"]
    (said,) = [m for m in restored[1]["said"] if m.startswith("ckptio: removed ")]
    assert f"removed {scratch} ({sizes[1]} bytes): the scratch directory of a restore of " \
        "rank 1 killed before its step was installed" in said, said
    (said,) = [m for m in restored[0]["said"] if m.startswith("ckptio: removed ")]
    assert f"removed {survivor}/.rebuild-step-7 (4096 bytes)" in said, said
    assert not [m for r in (2, 3) for m in restored[r]["said"] if "removed" in m], restored
    assert all(r["step"] == 1 and r["bitwise"] and r["error"] is None for r in restored), restored
    assert [r["how"]["source"] for r in restored] == ["own", "parity", "own", "own"]
    for name in theirs:
        with open(os.path.join(lost, name), encoding="utf-8") as f:
            assert f.read() == "the user's", name
    assert not os.path.exists(scratch) and os.path.isdir(os.path.join(lost, "step-1"))


def _plant(directory: str, name: str, nbytes: int) -> str:
    """``directory/name/data-00000.bin`` of ``nbytes`` bytes -> ``directory/name``."""
    os.makedirs(os.path.join(directory, name))
    with open(os.path.join(directory, name, "data-00000.bin"), "wb") as f:
        f.write(bytes(nbytes))
    return os.path.join(directory, name)


def test_a_restart_on_fewer_ranks_removes_the_scratch_of_ranks_it_no_longer_has(base, tmp_path):
    """Partners(1), 6 ranks on 2 hosts (3 each) restarted as 4 ranks (2 each: host 1 runs
    ranks 2 and 3). Host 1's memory holds old rank 5's steps (pieces the restart reshards) and
    ``r00005/.rebuild-step-2`` (a restore of rank 5 killed before its install, its data file's
    pages on tmpfs), and ``r00004/.rebuild-step-3``, whose directory's run lease a live process
    holds (this one: as a job of more ranks restoring there would); host 0's
    ``r00007/.rebuild-step-1`` (an earlier job of 8 ranks). Before: no rank of the 4-rank job
    removed any (each rank drops its own only), so their pages leaked until someone deleted
    them. Now each host's first rank (ranks 0 and 2, never 1 or 3) removes rank 5's and rank
    7's at its start, logged as a rank's own is, and nothing else (another name, old rank 5's
    steps, its stale lease); rank 4's stays, with a warning naming why; every rank restores
    step 3 bitwise, resharded."""
    disk = str(tmp_path / "disk")
    run_ranks(6, regrow_cases.train, base, disk, "partners-1", 3, 3, timeout_s=TIMEOUT)
    old = os.path.join(host_dir(base, 1), "run", "r00005")
    scratch = _plant(old, ".rebuild-step-2", 12288)
    theirs = _plant(old, ".rebuild-step-2.keep", 4096)  # not a name ckptio makes
    with open(os.path.join(old, runlease.LEASE_NAME), "w", encoding="utf-8") as f:
        f.write('{"host": "old", "pid": 1}')  # old rank 5's, killed: its flock went with it
    earlier = _plant(os.path.join(host_dir(base, 0), "run", "r00007"), ".rebuild-step-1", 8192)
    leased = os.path.join(host_dir(base, 1), "run", "r00004")
    held = _plant(leased, ".rebuild-step-3", 4096)
    lease = runlease.take(leased, False, create=False)
    assert lease is not None and lease.fd is not None
    try:
        restored = run_ranks(4, regrow_cases.restore_said, base, disk, "partners-1", 2,
                             timeout_s=TIMEOUT)
    finally:
        lease.release()
    for rank, r in enumerate(restored):
        assert r["error"] is None and r["bitwise"], (rank, r)
        assert (r["step"], r["how"]["source"]) == (3, "resharded"), r["how"]
    assert not os.path.exists(scratch) and not os.path.exists(earlier)
    assert os.path.isfile(os.path.join(theirs, "data-00000.bin"))
    assert {"step-2", "step-3"} <= set(os.listdir(old)), os.listdir(old)
    removed = sorted((rank, m) for rank, r in enumerate(restored) for m in r["said"]
                     if m.startswith("ckptio: removed "))
    assert removed == [
        (0, f"ckptio: removed {earlier} (8192 bytes): the scratch directory of a restore of "
            "rank 7 killed before its step was installed"),
        (2, f"ckptio: removed {scratch} (12288 bytes): the scratch directory of a restore of "
            "rank 5 killed before its step was installed")], removed
    assert os.path.isfile(os.path.join(held, "data-00000.bin"))
    left = [(rank, m) for rank, r in enumerate(restored) for m in r["said"] if "are left" in m]
    assert len(left) == 1 and left[0][0] == 2, left
    assert left[0][1].startswith(
        f"ckptio: the scratch directories of restores in {leased} (a rank this job of 4 ranks "
        "does not have) are left: a live process holds its run lease"), left
    for rank in range(6):
        mine = os.path.join(host_dir(base, rank // 3), "run", f"r{rank:05d}")
        assert {"step-2", "step-3"} <= set(os.listdir(mine)), (rank, os.listdir(mine))


@contextmanager
def _small_tmpfs(where: str, size: str) -> Iterator[None]:
    """``where`` a tmpfs of its own of ``size`` bytes (mounted by this process: root), unmounted
    after; its source named as multihost.py names its mounts, so that a killed run's is swept
    (multihost.sweep_stale). Skips where it cannot be mounted."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    source = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:6]}-h1"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", source,
                           where], capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield
    finally:
        if subprocess.run(["umount", where], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", where], capture_output=True, check=False)


def test_a_lost_rank_whose_tmpfs_is_too_full_for_its_step_receives_it_into_memory(
        base, tmp_path):
    """Parity(k=3) on 4 hosts, host 1 lost and replaced by a host whose memory (a tmpfs of its
    own, half a step) cannot hold its step: the step's file cannot be allocated in its scratch
    directory (posix_fallocate: ENOSPC, from the kernel), so the step is received into this
    process's memory instead, with a warning naming that directory and why; it is checked and
    loaded from there, bitwise. Its write into the tier after the load fails as well (the
    tmpfs is as full): close() raises it once, naming the tier and the fix, and no scratch
    directory is left holding the tmpfs's pages."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save, base, disk, "parity", MIB, timeout_s=TIMEOUT)
    wipe_host(base, 1)
    with _small_tmpfs(host_dir(base, 1), f"{MIB // 2}m"):
        restored = run_ranks(4, restore_logged, base, disk, "parity", MIB, timeout_s=TIMEOUT)
        mine = os.path.join(host_dir(base, 1), "run", "r00001")
        left = os.listdir(mine) if os.path.isdir(mine) else []
    assert all(r["step"] == 1 and r["bitwise"] and r["error"] is None for r in restored), restored
    assert [r["how"]["source"] for r in restored] == ["own", "parity", "own", "own"]
    scratch = os.path.join(host_dir(base, 1), "run", "r00001", ".rebuild-step-1")
    (said,) = [m for m in restored[1]["said"] if "cannot land in place" in m]
    assert said.startswith(f"ckptio: {scratch}: ") and "No space left on device" in said, said
    closed = restored[1]["closed"]
    assert closed and closed.startswith("StorageIOError: step 1, restored from peers and "
                                        "loaded, could not be written"), closed
    assert "No space left on device" in closed and "free space there" in closed, closed
    assert [r["closed"] for i, r in enumerate(restored) if i != 1] == [None] * 3, restored
    assert not [n for n in left if n.startswith(".rebuild-")], left
