"""Local storage faults from the kernel (issue 63, items 3 and 4): a FUSE file system under the
checkpoint directory (ckptio.testing.faultfs) fails or stalls write, fsync, fsyncdir, rename and
read; what a user sees through the public API, the CLI and the checkpoints left behind.

Skipped only where /dev/fuse is unusable (the reason says so); .ci/run installs libfuse.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.testing.faultfs import fuse_unusable

pytestmark = pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((256,), value), "b": torch.arange(8.0) + value}


def _ls(run: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "ckptio", "ls", str(run)], capture_output=True,
                          text=True, timeout=120)
    return done.stdout + done.stderr


# ------------------------------------------------------------------------------- item 3


def test_a_failed_directory_fsync_after_the_rename_leaves_the_step_uncommitted(fs):
    """EIO on the step directory's fsync after the manifest's rename: the save raises, and what
    it says is what the run shows: the step is not committed (not listed by ``ckptio ls``, not
    loadable), and a retry of the same step through the manager commits it."""
    run = fs.mountpoint / "run"
    mgr = ckptio.CheckpointManager(run)
    mgr.save(1, _state(1.0), force=True)
    fs.fail("fsyncdir", r"/run/step-2$", after=("rename", r"/run/step-2/manifest\.json$"))
    with pytest.raises(ckptio.StorageIOError, match=r"(?s)step-2.*fsync of the directory.*"
                                                    r"taken back.*not committed"):
        mgr.save(2, _state(2.0), force=True)
    assert fs.fired() == [("fsyncdir", "/run/step-2", "eio")]
    assert mgr.steps() == [1]
    listing = _ls(run)
    # not committed: not listed, or (while the failed save's empty directory is still being
    # removed, which a loaded host can catch) listed as incomplete with nothing in it
    assert "1 committed" in listing and not re.search(r"\n  2 +committed", listing), listing
    assert not re.search(r"\n  2 +incomplete +[1-9]", listing), listing
    with pytest.raises(ckptio.CkptError):
        ckptio.load(run / "step-2")
    mgr.save(2, _state(3.0), force=True)  # the retry: not refused as committed
    mgr.close()
    assert torch.equal(ckptio.load(run / "step-2")["w"], _state(3.0)["w"])
    assert torch.equal(ckptio.load(run / "step-1")["w"], _state(1.0)["w"])


def test_a_failed_directory_fsync_over_a_checkpoint_puts_the_previous_one_back(fs):
    """ckptio.save over a committed checkpoint, the directory's fsync after the rename failing:
    the previous manifest is back and loads whole, as the error says."""
    path = fs.mountpoint / "ckpt"
    ckptio.save(_state(1.0), path)
    fs.fail("fsyncdir", r"^/ckpt$", after=("rename", r"^/ckpt/manifest\.json$"))
    with pytest.raises(ckptio.StorageIOError, match="previous checkpoint there, if any, is in"):
        ckptio.save(_state(2.0), path)
    assert fs.fired(), "the fault was not reached"
    assert torch.equal(ckptio.load(path)["w"], _state(1.0)["w"])
    assert ckptio.verify(path) > 0
    ckptio.save(_state(2.0), path)
    assert torch.equal(ckptio.load(path)["w"], _state(2.0)["w"])


# ------------------------------------------------------------------------------- item 4

WARN_S = 0.5  # Options.io_stall_warn_s for these tests (the default is 60 s)


def _stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "made no progress" in r.getMessage()]


def _wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("then", [None, "eio"])
def test_a_hung_fsync_is_said_and_wait_and_close_give_up_in_time(fs, caplog, then):
    """An fsync of a data file that does not return: warnings naming the rank, the file and
    the seconds, repeated; wait(timeout=) and close(timeout=) raise SaveTimeoutError in time,
    naming the step, the rank and the file; once the fsync returns (or fails) the save ends
    cleanly and the previous step is intact."""
    caplog.set_level("WARNING", logger="ckptio")
    run = fs.mountpoint / "run"
    mgr = ckptio.CheckpointManager(run, options=ckptio.Options(io_stall_warn_s=WARN_S))
    mgr.save(1, _state(1.0), force=True)
    fs.stall("fsync", r"/run/step-2/data-")
    mgr.save(2, _state(2.0), force=True, asynchronous=True)
    stalled = fs.wait_stalled(30)
    _wait_for(lambda: len(_stall_warnings(caplog)) >= 2, 10 * WARN_S + 10)
    said = _stall_warnings(caplog)
    assert all("rank 0" in m and "fsync" in m and "/run/step-2/data-" in m for m in said), said
    assert said[0] != said[1]  # the seconds waited grow
    started = time.monotonic()
    with pytest.raises(ckptio.SaveTimeoutError, match=r"(?s)step 2.*rank 0 has waited [\d.]+ s for "
                                                      r"the fsync of .*/step-2/data-"):
        mgr.wait(timeout=1.0)
    assert time.monotonic() - started < 5
    with pytest.raises(ckptio.CkptError, match="rank 0"):
        mgr.close(timeout=0.2)
    assert stalled.startswith("/run/step-2/data-")
    fs.release(then)
    if then is None:
        mgr.close()
        assert mgr.steps() == [1, 2]
        assert torch.equal(ckptio.load(run / "step-2")["w"], _state(2.0)["w"])
    else:
        with pytest.raises(ckptio.StorageIOError, match="step-2"):
            mgr.close()
        assert ckptio.CheckpointManager(run).steps() == [1]
    assert torch.equal(ckptio.load(run / "step-1")["w"], _state(1.0)["w"])
    # the end of the stall is said by the watch's thread at its next look (woken by the
    # save's end, which does not wait for it): within a moment, not before close() returns
    _wait_for(lambda: any("goes on" in r.getMessage() for r in caplog.records), 10)


def test_a_hung_commit_is_said_on_a_synchronous_save(fs, caplog):
    """ckptio.save whose manifest fsync hangs: the caller is blocked, the warning names the
    commit's file; released, the save commits."""
    caplog.set_level("WARNING", logger="ckptio")
    path = fs.mountpoint / "ckpt"
    fs.stall("fsync", r"^/ckpt/\.?[^/]*\.tmp$")
    ck = ckptio.Checkpointer(ckptio.Options(io_stall_warn_s=WARN_S))
    saving = threading.Thread(target=ck.save, args=(_state(1.0), path))
    saving.start()
    fs.wait_stalled(30)
    _wait_for(lambda: _stall_warnings(caplog), 10 * WARN_S + 10)
    assert "commit of" in _stall_warnings(caplog)[0] and "manifest.json" in _stall_warnings(caplog)[0]
    fs.release()
    saving.join(30)
    assert not saving.is_alive()
    assert torch.equal(ckptio.load(path)["w"], _state(1.0)["w"])
    ck.close()


def test_a_background_failure_raised_at_the_next_save_says_that_step_was_not_saved(fs):
    """An async save of step 3 fails (its fsync: EIO); the error surfaces at save(4), which
    says that step 4 was not saved (and why); a retry of step 4 commits."""
    run = fs.mountpoint / "run"
    mgr = ckptio.CheckpointManager(run)
    fs.fail("fsync", r"/run/step-3/data-")
    mgr.save(3, _state(3.0), force=True, asynchronous=True)
    with pytest.raises(ckptio.StorageIOError, match=r"(?s)^step 4 was not saved.*step 3.*"
                                                    r"Input/output error"):
        mgr.save(4, _state(4.0), force=True)
    assert mgr.steps() == []
    mgr.save(4, _state(4.0), force=True)
    mgr.close()
    assert mgr.steps() == [4]


def test_with_deltas_too_the_next_save_says_its_step_was_not_saved(fs):
    """A manager that settles the save in flight before the next one (deltas choose a base
    among committed steps; a memory tier's retention runs first) says the same: the step it
    did not save, then the failed one's error (before: that error alone, as if raised by the
    failed save's own wait; a new user's trial, with a memory tier)."""
    run = fs.mountpoint / "run"
    mgr = ckptio.CheckpointManager(run, delta=True)
    fs.fail("fsync", r"/run/step-3/data-")
    mgr.save(3, _state(3.0), force=True, asynchronous=True)
    with pytest.raises(ckptio.StorageIOError, match=r"(?s)^step 4 was not saved \(nothing of it "
                                                    r"was written\): the save of step 3 before "
                                                    r"it failed.*Input/output error"):
        mgr.save(4, _state(4.0), force=True)
    mgr.save(4, _state(4.0), force=True)
    mgr.close()
    assert mgr.steps() == [4]


def test_checkpointer_close_with_a_timeout_gives_up_and_frees_nothing(fs):
    """Checkpointer.close(timeout=) on an async save whose data fsync hangs: SaveTimeoutError
    naming the path, the rank and the file, in time; the save still owns its staging pool, so
    a later close() finishes it and the checkpoint loads."""
    path = fs.mountpoint / "ckpt"
    ck = ckptio.Checkpointer(ckptio.Options(io_stall_warn_s=WARN_S))
    fs.stall("fsync", r"^/ckpt/data-")
    handle = ck.async_save(_state(5.0), path)
    fs.wait_stalled(30)
    started = time.monotonic()
    with pytest.raises(ckptio.SaveTimeoutError, match=r"(?s)ckpt did not finish within 0.5 s: "
                                                      r"rank 0 has waited .* fsync of .*/data-"):
        ck.close(timeout=0.5)
    assert time.monotonic() - started < 5
    assert ck.staging_nbytes > 0 and not handle.done()
    fs.release()
    ck.close()
    assert handle.done() and torch.equal(ckptio.load(path)["w"], _state(5.0)["w"])



def _child_watch_alive(path: str, out: object) -> None:
    from ckptio.testing.faults import inject

    ck = ckptio.Checkpointer()
    inject(ck, delay_s=0.3)  # each write held: the save lasts while it is looked at
    handle = ck.async_save(_state(2.0), path)
    time.sleep(0.2)
    alive = any(t.name == "ckptio-stall-watch" and t.is_alive() for t in threading.enumerate())
    handle.wait()
    ck.close()
    out.put(alive)  # type: ignore[attr-defined]


def test_a_forked_child_s_saves_are_watched_too(tmp_path: Path) -> None:
    """The watch of saves' I/O is one thread per process: a child forked after the parent's
    saves started it gets its own (the parent's thread is not in the child)."""
    import multiprocessing as mp

    ckptio.save(_state(1.0), tmp_path / "parent")  # the parent's watch thread has run
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_child_watch_alive, args=(str(tmp_path / "child"), out))
    child.start()
    alive = out.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0 and alive is True
