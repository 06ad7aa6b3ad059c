"""Kernel faults around a CheckpointManager (ckptio.testing.faultfs): a memory or local first
tier and a slower tier on the FUSE mount, whose calls hang or fail. What the user's waits
(wait / drained / protected / close with a timeout) do while a drain's copy or a save is
blocked in the kernel, and what a later manager restores, bit for bit.

Each hung call is released by a timer after a few seconds, so a wait that does not give up
in time fails its test rather than hanging it. Skipped only where /dev/fuse is unusable.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid

import pytest
import torch

import ckptio
from ckptio import Tier
from ckptio.testing.faultfs import FaultFS, fuse_unusable

pytestmark = pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))

RELEASE_S = 6.0  # a hung call is let go after this long: a wait still blocked then is a bug
GIVE_UP_S = 0.5  # the timeout the tests give wait / drained / close


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4096,), value), "b": torch.arange(16.0) + value}


def _release_later(fs: FaultFS, error: str | None) -> threading.Timer:
    timer = threading.Timer(RELEASE_S, fs.release, kwargs={"error": error})
    timer.start()
    return timer


def _restored(run: str) -> tuple[int | None, dict[str, torch.Tensor]]:
    """What a new manager on ``run`` restores (the next job's view)."""
    state = {"w": torch.zeros(4096), "b": torch.zeros(16)}
    with ckptio.CheckpointManager(run) as again:
        return again.restore(state), state


def _stall_warnings(caplog: pytest.LogCaptureFixture, within: float) -> list[str]:
    """The stall warnings logged, once there is one (or ``within`` seconds passed)."""
    deadline = time.monotonic() + within
    while True:
        said = [r.getMessage() for r in caplog.records if "made no progress" in r.getMessage()]
        if said or time.monotonic() > deadline:
            return said
        time.sleep(0.05)


def _assert_state(got: dict[str, torch.Tensor], value: float) -> None:
    want = _state(value)
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def test_close_with_a_timeout_gives_up_on_a_drain_hung_in_the_slower_tier(fs, caplog):
    """Memory first, the disk tier on the mount: the drain's fsync of step 2 hangs. It is
    warned about as a save's is, naming the file (before: nothing said); drained() says False
    in time; close(timeout=) raises SaveTimeoutError in time naming the step, the tier and its
    directory (before: it waited for the hung copy, however long); once the fsync fails,
    close() raises the copy's error and the disk keeps step 1 only, intact."""
    caplog.set_level("WARNING", logger="ckptio")
    run = str(fs.mountpoint / "run")
    mgr = ckptio.CheckpointManager(tiers=[Tier(f"mem://rtfuse-{uuid.uuid4().hex}", keep_last=2),
                                          Tier(run, every=1, keep_last=2)],
                                   options=ckptio.Options(io_stall_warn_s=0.2))
    mgr.save(1, _state(1.0))
    assert mgr.drained(timeout=30)
    fs.stall("fsync", r"^/run/step-2/data-")
    mgr.save(2, _state(2.0))
    assert fs.wait_stalled(10).startswith("/run/step-2/data-")
    timer = _release_later(fs, "eio")
    try:
        started = time.monotonic()
        assert mgr.drained(timeout=GIVE_UP_S) is False
        said = _stall_warnings(caplog, 3.0)
        assert said and all("fsync" in m and "/run/step-2/data-" in m for m in said), said
        with pytest.raises(ckptio.SaveTimeoutError,
                           match=r"close: the drain's copy of step 2 to tier 1 \(.*/run\) did "
                                 r"not finish within 0\.5 s.*close\(\) again"):
            mgr.close(timeout=GIVE_UP_S)
        assert time.monotonic() - started < RELEASE_S - 1
    finally:
        timer.cancel()
        fs.release("eio")
    with pytest.raises(ckptio.StorageIOError, match=r"/run/step-2/data-.*Input/output"):
        mgr.close()
    step, state = _restored(run)
    assert step == 1
    _assert_state(state, 1.0)


def test_drained_with_a_timeout_returns_while_the_first_tier_s_save_hangs(fs, tmp_path):
    """The first tier on the mount, its async save's fsync hung: drained(timeout=) and
    protected(timeout=) return False in time (before: they waited for the save without a
    limit); close gives up in time too; released, both tiers hold both steps."""
    run, slow = str(fs.mountpoint / "run"), str(tmp_path / "slow")
    mgr = ckptio.CheckpointManager(tiers=[Tier(run, keep_last=2), Tier(slow, every=1)])
    mgr.save(1, _state(1.0))
    fs.stall("fsync", r"^/run/step-2/data-")
    mgr.save(2, _state(2.0), asynchronous=True)
    fs.wait_stalled(10)
    timer = _release_later(fs, None)
    try:
        started = time.monotonic()
        assert mgr.drained(timeout=GIVE_UP_S) is False
        assert mgr.protected(timeout=GIVE_UP_S) is False  # step 2 is not even committed
        with pytest.raises(ckptio.SaveTimeoutError, match=r"step 2.*fsync of .*/run/step-2/"):
            mgr.close(timeout=GIVE_UP_S)
        assert time.monotonic() - started < RELEASE_S - 1
    finally:
        timer.cancel()
        fs.release()
    assert mgr.drained(timeout=30)
    mgr.close()
    for where in (run, slow):
        step, state = _restored(where)
        assert step == 2
        _assert_state(state, 2.0)


def test_a_preempted_wait_with_a_timeout_gives_up_on_a_hung_drain(fs):
    """Preempted (SIGTERM), wait() carries the newest step to the slower tier: with a timeout
    it raises SaveTimeoutError naming that copy once the time is up (before: it waited for the
    hung fsync without a limit); released, the step lands and a new manager restores it."""
    run = str(fs.mountpoint / "run")
    mgr = ckptio.CheckpointManager(tiers=[Tier(f"mem://rtfuse-{uuid.uuid4().hex}", keep_last=2),
                                          Tier(run, every=4, keep_last=2)], preemption=True)
    try:
        mgr.save(4, _state(4.0))
        assert mgr.drained(timeout=30)
        fs.stall("fsync", r"^/run/step-5/data-")
        signal.raise_signal(signal.SIGTERM)
        assert mgr.reached_preemption(5)
        mgr.save(5, _state(5.0))
        timer = _release_later(fs, None)
        try:
            started = time.monotonic()
            with pytest.raises(ckptio.SaveTimeoutError,
                               match=r"wait: the drain's copy of step 5 to tier 1"):
                mgr.wait(timeout=GIVE_UP_S)
            assert time.monotonic() - started < RELEASE_S - 1
        finally:
            timer.cancel()
            fs.release()
        mgr.wait()
    finally:
        mgr.close()
    step, state = _restored(run)
    assert step == 5
    _assert_state(state, 5.0)


def _model(value: float) -> dict[str, torch.Tensor]:
    """A state whose next steps differ a little (delta saves store the changed blocks)."""
    w = torch.randn(65536, generator=torch.Generator().manual_seed(0))
    w[:100] += value
    return {"w": w, "b": torch.arange(16.0) + value}


def test_a_delta_save_whose_base_read_fails_says_an_io_error_and_commits_nothing(fs):
    """A manager's delta save (zstd, base step 1) whose base manifest's read fails with EIO:
    StorageIOError naming the base's manifest (before: a plain CkptError whose advice was to
    restore the base), step 3 not committed; ckptio.load of a committed delta against that
    base says StorageIOError too (before: CorruptCheckpointError, for a checkpoint that is
    whole). Once the storage reads again, the retry commits and every step loads bit for bit."""
    run = fs.mountpoint / "run"
    opts = ckptio.Options(compression="zstd")
    mgr = ckptio.CheckpointManager(run, keep_last=None, options=opts,
                                   delta=ckptio.DeltaPolicy(full_every=4))
    mgr.save(1, _model(1.0))
    mgr.save(2, _model(2.0))
    assert '"bases":["step-1"]' in (run / "step-2" / "manifest.json").read_text()  # a delta
    fs.fail("read", r"^/run/step-1/manifest\.json$", times=100)
    with pytest.raises(ckptio.StorageIOError, match=r"base checkpoint step-1.*/run/step-1/"
                                                    r"manifest\.json.*Input/output error"):
        mgr.save(3, _model(3.0))
    with pytest.raises(ckptio.StorageIOError, match=r"step-2 is a delta of base checkpoint "
                                                    r"step-1.*Input/output error.*retry"):
        ckptio.load(run / "step-2")
    assert mgr.steps() == [1, 2]
    fs.clear()
    mgr.save(3, _model(3.0))
    mgr.close()
    for step in (1, 2, 3):
        _assert_state_of(ckptio.load(run / f"step-{step}"), _model(float(step)))


def _assert_state_of(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want)


def test_a_restore_stopped_by_an_io_error_says_the_state_is_partly_filled(fs):
    """A restore whose third data file's read fails (EIO) after two were loaded in place: the
    StorageIOError names the file and says the state may be partly overwritten (before: only
    the read that failed, while two tensors already held the step's values and the rest their
    old ones); restored again once the storage reads, the state is the step's, bit for bit."""
    run = fs.mountpoint / "run"
    small = ckptio.Options(max_file_bytes=1 << 20, buffer_bytes=1 << 20, pool_bytes=4 << 20)
    saved = {f"k{i}": torch.full((1 << 18,), float(i + 1)) for i in range(8)}  # a file each
    with ckptio.CheckpointManager(run, options=small) as mgr:
        mgr.save(1, saved)
    fs.fail("read", r"^/run/step-1/data-", nth=3, times=100)
    state = {k: torch.zeros_like(v) for k, v in saved.items()}
    with ckptio.CheckpointManager(run) as mgr:
        with pytest.raises(ckptio.StorageIOError, match=r"(?s)may hold some of that step's "
                                                        r"tensors.*restore again before using "
                                                        r"it.*/run/step-1/data-.*Input/output"):
            mgr.restore(state)
        assert any(state[k].abs().sum() > 0 for k in state)  # what the message warns of
        fs.clear()
        assert mgr.restore(state) == 1
    _assert_state_of(state, saved)
