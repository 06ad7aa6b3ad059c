"""Faults from outside the process on a tiered CheckpointManager's slower tier and on restore:
a FUSE file system (ckptio.testing.faultfs) under the disk tier fails or stalls the drain's
write, fsync or rename, or a restore's read, while a user's training loop goes on, is killed
and restarted. What each test checks: the time bound, the error's class and what it names,
and that what the run holds afterwards agrees with the error (the failed step not listed as
committed, every other step loadable bit for bit, the user's own files untouched).

Skipped only where /dev/fuse is unusable.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio import Tier
from ckptio.storage.local import dirlock
from ckptio.testing.faultfs import fuse_unusable
from ckptio.testing.rank_processes import run_ranks

pytestmark = pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))

BOUND_S = 20.0  # every scenario here takes well under a second or two; a hang is a bug


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), value), "b": torch.arange(16.0) + value}


def _zeros() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4096), "b": torch.zeros(16)}


def _assert_state(got: dict[str, torch.Tensor], value: float) -> None:
    want = _state(value)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def _steps_in(directory: str | Path) -> list[int]:
    """The steps committed (a manifest present) in a run directory, read off the disk."""
    return sorted(int(name[5:]) for name in os.listdir(directory) if name.startswith("step-")
                  and os.path.exists(os.path.join(directory, name, "manifest.json")))


def _load_step(run: str | Path, step: int) -> dict[str, torch.Tensor]:
    state = _zeros()
    ckptio.load(os.path.join(run, f"step-{step}"), state)
    return state


# ------------------------------------------------------- a memory tier draining to a faulty disk


def test_a_failed_drain_of_a_step_kept_for_good_is_retried_not_dropped_from_memory(shm, fs):
    """Memory first, the disk tier keeps every 2nd step for good: the commit (rename) of step
    2's copy fails once with EIO. The error is raised once naming step 2's directory; the loop
    saves on. Before: the drain never tried step 2 again and the memory tier's retention dropped
    it, so the step the user asked to keep for good was nowhere. Now it is retried with the
    next step due, kept in memory until then (``status()`` says so), and lands on the disk bit
    for bit."""
    run = fs.mountpoint / "run"
    started = time.monotonic()
    mgr = ckptio.CheckpointManager(tiers=[Tier("shm://r", keep_last=2),
                                          Tier(str(run), keep_last=1, keep_every=2)])
    mgr.save(1, _state(1.0))
    assert mgr.drained(timeout=BOUND_S)
    fs.fail("rename", r"^/run/step-2/manifest\.json$")
    mgr.save(2, _state(2.0))
    with pytest.raises(ckptio.StorageIOError, match=r"/run/step-2.*Input/output error"):
        mgr.drained(timeout=BOUND_S)
    assert 2 not in _steps_in(run)
    assert mgr.status()[1]["retrying"] == [2]  # said, and kept in memory for it
    for step in range(3, 7):
        mgr.save(step, _state(float(step)))
        assert mgr.drained(timeout=BOUND_S)
    mgr.close()
    assert time.monotonic() - started < BOUND_S
    assert _steps_in(run) == [2, 4, 6]
    _assert_state(_load_step(run, 2), 2.0)
    _assert_state(_load_step(run, 6), 6.0)



def test_steps_kept_for_good_whose_copies_keep_failing_give_way_to_the_next_save(shm, fs,
                                                                                  caplog):
    """The disk tier keeps every 2nd step for good and every commit there fails (EIO): the
    memory tier, its budget three steps, keeps steps 2, 4 and 6 for the drain's next tries,
    then needs their room. The save goes on, each step given up named in a warning (before
    the give-way: every later save was refused for want of room); the memory tier keeps
    the two newest steps, the newest restorable bit for bit."""
    caplog.set_level("WARNING", logger="ckptio")
    fs.fail("rename", r"^/run/step-\d+/manifest\.json$", times=1000)
    state, nbytes = _state(0.0), 4096 * 4 + 16 * 4
    mgr = ckptio.CheckpointManager(tiers=[
        Tier("shm://r", keep_last=2, max_bytes=5 * nbytes + 4096 * 8),
        Tier(str(fs.mountpoint / "run"), keep_last=1, keep_every=2)])
    started = time.monotonic()
    for step in range(1, 10):
        mgr.save(step, _state(float(step)))
        with pytest.raises(ckptio.StorageIOError, match=r"/run/step-\d+"):
            mgr.drained(timeout=BOUND_S)
    given = [r.getMessage() for r in caplog.records if "is given up" in r.getMessage()]
    assert all(re.search(r"step \d+, kept for good in tier 1, whose copy there failed, is "
                         r"given up to make room in the first tier", m) for m in given), given
    steps = [int(re.findall(r"step (\d+),", m)[0]) for m in given]
    assert steps[:2] == [2, 4] and all(s % 2 == 0 for s in steps), steps
    assert mgr.status()[1]["retrying"] in ([], [8])
    mgr.close()
    assert time.monotonic() - started < BOUND_S
    assert _steps_in(os.path.join(shm, "r"))[-2:] == [8, 9]
    state = _zeros()
    with ckptio.CheckpointManager("shm://r") as again:
        assert again.restore(state) == 9
    _assert_state(state, 9.0)


def test_a_damaged_memory_copy_of_a_step_kept_for_good_is_not_tried_again(shm, tmp_path):
    """Step 2, which the disk tier keeps for good, is damaged in memory (a flipped byte) before
    its drain: the copy fails CorruptCheckpointError once, and the step is not kept for further
    tries (damage does not heal: it would hold memory and fail again at every step)."""
    with ckptio.CheckpointManager("shm://r", keep_last=2) as alone:
        for step in (1, 2):
            alone.save(step, _state(float(step)))
    data = next(p for p in Path(shm, "r", "step-2").iterdir() if p.name.startswith("data-"))
    with open(data, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    mgr = ckptio.CheckpointManager(tiers=[Tier("shm://r", keep_last=2),
                                          Tier(str(tmp_path / "disk"), keep_every=2)])
    with pytest.raises(ckptio.CorruptCheckpointError, match=r"step-2"):
        mgr.drained(timeout=BOUND_S)
    assert mgr.status()[1]["retrying"] == []
    mgr.save(3, _state(3.0))
    assert mgr.drained(timeout=BOUND_S)
    mgr.close()
    assert _steps_in(tmp_path / "disk") == [3]

KILLED_CHILD = r"""
import sys, time, torch, ckptio
from ckptio import Tier
run = sys.argv[1]
def state(v):
    return {"w": torch.full((4096,), v), "b": torch.arange(16.0) + v}
mgr = ckptio.CheckpointManager(tiers=[Tier("shm://r", keep_last=2),
                                      Tier(run, keep_last=1, keep_every=2)])
for step in range(1, 5):
    mgr.save(step, state(float(step)))
    try:
        mgr.drained(timeout=20)
    except ckptio.CkptError as exc:
        print("drain failed", step, type(exc).__name__, exc, flush=True)
mgr.save(5, state(5.0))
print("saved 5", flush=True)
time.sleep(60)
"""


def test_a_kill_during_a_hung_drain_after_failed_ones_resumes_every_step_kept_for_good(shm, fs):
    """The disk tier's commits of step 2 keep failing (EIO on the rename), then step 5's copy
    hangs in fsync and the process is killed (SIGKILL). The restart restores step 5 from
    memory bit for bit; its drain removes the cut-short copy and copies step 2 (kept for good,
    held in memory all along; before: never copied again, as the disk held a newer step) and
    step 5; the next save frees the memory tier's older steps."""
    run = fs.mountpoint / "run"
    fs.fail("rename", r"^/run/step-2/manifest\.json$", times=1000)
    fs.stall("fsync", r"^/run/step-5/data-")
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(run)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [child.stdout.readline() for _ in range(4)]  # type: ignore[union-attr]
        # each try of step 2 failed, and was said once (the retries with steps 3 and 4)
        assert all(line.startswith(f"drain failed {n} StorageIOError committing the manifest "
                                   "of ") and "/run/step-2 failed" in line
                   for n, line in zip((2, 3, 4), lines)), (lines, child.stderr.read())  # type: ignore[union-attr]
        assert lines[3] == "saved 5\n", lines
        assert fs.wait_stalled(BOUND_S).startswith("/run/step-5/data-")
        child.kill()
        fs.release("eio")  # a process killed in a hung FUSE call exits once the call returns
        child.wait(BOUND_S)
    finally:
        if child.poll() is None:
            child.kill()
            fs.release("eio")
            child.wait()
    fs.clear()
    assert _steps_in(run) == [4]
    state = _zeros()
    with ckptio.CheckpointManager(tiers=[Tier("shm://r", keep_last=2),
                                         Tier(str(run), keep_last=1, keep_every=2)]) as mgr:
        assert mgr.restore(state) == 5 and mgr.last_restore["tier"] == 0
        _assert_state(state, 5.0)
        assert mgr.drained(timeout=BOUND_S)
        assert _steps_in(run) == [2, 4, 5]
        mgr.save(6, _state(6.0))
        assert mgr.drained(timeout=BOUND_S)
        assert _steps_in(os.path.join(shm, "r")) == [5, 6]
    assert time.monotonic() - started < BOUND_S
    # the run lease, removed while open at the close, may linger renamed for a moment (FUSE
    # answers the close after it returns): the file system's, not a file ckptio left
    left = sorted(n for n in os.listdir(run) if not n.startswith(dirlock.SILLY_NAMES))
    assert left == ["step-2", "step-4", "step-6"]
    for step in (2, 4, 6):
        _assert_state(_load_step(run, step), float(step))


# ------------------------------------------------------------- a restore reading a faulty disk


def test_an_unreadable_newest_copy_is_restored_from_the_next_tier_holding_that_step(tmp_path, fs):
    """Two disk tiers, the first on the mount: every read of step 3's data file there fails
    (EIO). The restore loads step 3 from the second tier, bit for bit, with a warning naming
    the unreadable file (before: StorageIOError, though an intact copy of the step was at
    hand); the same fault with the step in no other tier still raises, naming the file."""
    run, slow = str(fs.mountpoint / "run"), str(tmp_path / "slow")
    tiers = [Tier(run, keep_last=3), Tier(slow, keep_last=3)]
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(float(step)))
            assert mgr.drained(timeout=BOUND_S)
    fs.fail("read", r"^/run/step-3/data-", times=1000)
    state, started = _zeros(), time.monotonic()
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        with pytest.warns(UserWarning, match=r"restored step 3 from .*slow.*step 3 in .*/run: "
                                             r"StorageIOError: reading .*/run/step-3/data-.*"
                                             r"Input/output error"):
            assert mgr.restore(state) == 3
        assert mgr.last_restore["tier"] == 1
    _assert_state(state, 3.0)
    with ckptio.CheckpointManager(run) as alone:  # no other copy: loud, never an older step
        with pytest.raises(ckptio.StorageIOError, match=r"restore again before using it \(once "
                                                        r"the storage reads, or restore\(state, "
                                                        r"step=N\) for an older step\): reading "
                                                        r".*/run/step-3/data-"):
            alone.restore(_zeros())
    assert time.monotonic() - started < BOUND_S


def ranks_save(rank: int, world: int, run: str, slow: str) -> list[int]:
    """Each of two ranks saves its own tensor at steps 1 and 2 into both tiers."""
    tiers = [Tier(run, keep_last=3), Tier(slow, keep_last=3)]
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        for step in (1, 2):
            mgr.save(step, {"mine": torch.full((4096,), float(10 * step + rank))})
            assert mgr.drained(timeout=BOUND_S)
        return mgr.steps()


def ranks_restore(rank: int, world: int, run: str, slow: str) -> dict[str, object]:
    state = {"mine": torch.zeros(4096)}
    with ckptio.CheckpointManager(tiers=[Tier(run, keep_last=3), Tier(slow, keep_last=3)]) as mgr:
        step = mgr.restore(state)
        return {"step": step, "tier": mgr.last_restore["tier"],
                "same": torch.equal(state["mine"], torch.full((4096,), float(10 * 2 + rank)))}


def test_two_ranks_one_of_whose_files_cannot_be_read_restore_that_step_from_the_next_tier(
        tmp_path, fs):
    """Two gloo ranks; rank 1's data file of step 2 in the first tier cannot be read (EIO):
    both ranks restore step 2 from the second tier together, each its own tensor bit for bit
    (rank 0, whose own read succeeded, follows: the ranks agree on the fallback)."""
    run, slow = str(fs.mountpoint / "run"), str(tmp_path / "slow")
    assert run_ranks(2, ranks_save, run, slow, timeout_s=120) == [[1, 2], [1, 2]]
    fs.fail("read", r"^/run/step-2/data-.*-r00001-", times=1000)
    out = run_ranks(2, ranks_restore, run, slow, timeout_s=120)
    assert out == [{"step": 2, "tier": 1, "same": True}] * 2, out
    assert fs.fired() and all("-r00001-" in path for _, path, _ in fs.fired())


def test_verify_of_a_run_names_the_step_whose_file_cannot_be_read(fs):
    """EIO on reading step 3's data file: ``ckptio verify RUN`` exits 1 naming step 3 and its
    file as not checkable and the other steps OK; ``ckptio ls`` still lists all three (the
    manifests read), and a restore of step 2 asked for by the user is bit for bit."""
    run = fs.mountpoint / "run"
    with ckptio.CheckpointManager(run, keep_last=3) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(float(step)))
    fs.fail("read", r"^/run/step-3/data-", times=1000)
    done = subprocess.run([sys.executable, "-m", "ckptio", "verify", str(run)],
                          capture_output=True, text=True, timeout=BOUND_S * 3)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"/run/step-3: CANNOT BE CHECKED: reading .*/run/step-3/data-.*"
                     r"Input/output error", done.stdout), done.stdout
    assert re.search(r"/run/step-2: OK", done.stdout) and "damaged: steps [3]" in done.stdout
    state = _zeros()
    with ckptio.CheckpointManager(run) as mgr:
        assert mgr.restore(state, step=2) == 2
    _assert_state(state, 2.0)


# ----------------------------------------------------------- a save cut short by a full disk


@pytest.mark.parametrize(("op", "pattern"), [("open", r"data-"), ("write", r"data-"),
                                              ("fsync", r"data-"), ("write", r"\.manifest-"),
                                              ("rename", r"manifest\.json$")])
def test_a_save_cut_short_by_a_full_disk_leaves_nothing_a_later_save_misreads(fs, op, pattern):
    """ENOSPC on one call of step 3's save (an async one, as a loop makes): wait() raises a
    StorageIOError naming step 3's file or directory and the fix (free space) within seconds
    (before: the manifest's rename named no fix); step 3 is listed neither
    committed nor incomplete and nothing of it stays (no data file, no manifest being
    committed); the next saves and their retention go on, and the user's own files in the run
    directory, one of them named like a step, are untouched."""
    run, backing = fs.mountpoint / "run", fs.backing / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    (run / "step-notes").mkdir()
    mgr = ckptio.CheckpointManager(run, keep_last=2)
    mgr.save(1, _state(1.0))
    mgr.save(2, _state(2.0))
    fs.fail(op, rf"^/run/step-3/{pattern}", error="enospc")
    started = time.monotonic()
    mgr.save(3, _state(3.0), asynchronous=True)
    with pytest.raises(ckptio.StorageIOError, match=r"/run/step-3.*No space left on device.*"
                                                    r"the disk is full: free space"):
        mgr.wait()
    assert time.monotonic() - started < BOUND_S
    assert [f[0] for f in fs.fired()] == [op]
    assert mgr.steps() == [1, 2]
    # the failed save's directory is gone (on FUSE its lock file, removed while open, lingers
    # renamed a moment: waited for within the bound)
    while mgr.incomplete() or "step-3" in os.listdir(backing):
        assert time.monotonic() - started < BOUND_S, os.listdir(backing)
        time.sleep(0.02)
    assert sorted(n for n in os.listdir(backing) if not n.startswith(".")) == [
        "notes.txt", "step-1", "step-2", "step-notes"]
    _assert_state(_load_step(run, 2), 2.0)
    for step in (3, 4):
        mgr.save(step, _state(float(step)))
    mgr.close()
    assert sorted(n for n in os.listdir(backing) if not n.startswith(".")) == [
        "notes.txt", "step-3", "step-4", "step-notes"]
    assert (run / "notes.txt").read_text() == "mine" and os.listdir(run / "step-notes") == []
    state = _zeros()
    with ckptio.CheckpointManager(run) as again:
        assert again.restore(state) == 4
    _assert_state(state, 4.0)


def test_a_failed_save_s_directory_goes_though_its_lock_file_lingers_renamed(fs, monkeypatch):
    """The manifest's rename of step 3 fails (ENOSPC) while another process has the step's
    lock file open (a backup tool, a `tail`): on FUSE, as on NFS, the lock file the failed save
    removes lingers renamed (.fuse_hidden...) until closed. The save waits for it (briefly)
    and removes its empty directory (before: the directory stayed, an incomplete step 3 in
    every listing)."""
    # the wait is for a moment; under CI's load the closing timer below may fire late
    monkeypatch.setattr(dirlock, "SILLY_WAIT_S", BOUND_S)
    run, backing = fs.mountpoint / "run", fs.backing / "run"
    mgr = ckptio.CheckpointManager(run, keep_last=2)
    mgr.save(1, _state(1.0))
    fs.stall("rename", r"^/run/step-3/manifest\.json$")
    mgr.save(3, _state(3.0), asynchronous=True)
    fs.wait_stalled(BOUND_S)
    held = os.open(run / "step-3" / ".ckptio.lock", os.O_RDONLY)
    threading.Timer(0.2, os.close, args=(held,)).start()
    fs.release("enospc")
    with pytest.raises(ckptio.StorageIOError, match=r"/run/step-3.*No space left"):
        mgr.wait()
    deadline = time.monotonic() + 3
    while "step-3" in os.listdir(backing) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "step-3" not in os.listdir(backing), os.listdir(backing / "step-3")
    assert mgr.incomplete() == [] and mgr.steps() == [1]
    mgr.close()


def _server_pids(mountpoint: Path) -> list[int]:
    """The FUSE fault server serving ``mountpoint`` (its command line names it)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            argv = Path("/proc", entry, "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"faultfs_server" in a for a in argv) and str(mountpoint).encode() in argv:
            pids.append(int(entry))
    return pids


def test_a_run_whose_file_system_died_fails_its_save_and_closes_with_no_os_error(fs):
    """The file system under the run dies (its FUSE server killed, as an NFS server lost):
    the next save raises StorageIOError naming the step's file; close() then lets go of the run
    lease with a warning (before: OSError, Transport endpoint is not connected, out of
    close())."""
    run = fs.mountpoint / "run"
    mgr = ckptio.CheckpointManager(run, keep_last=2)
    mgr.save(1, _state(1.0))
    (server,) = _server_pids(fs.mountpoint)
    os.kill(server, signal.SIGKILL)
    try:
        started = time.monotonic()
        with pytest.raises(ckptio.StorageIOError, match=r"/run/step-2/.*not connected"):
            mgr.save(2, _state(2.0))
        mgr.close()
        assert time.monotonic() - started < BOUND_S
    finally:
        subprocess.run(["umount", "-l", str(fs.mountpoint)], capture_output=True, check=False)
