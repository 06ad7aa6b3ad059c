"""Two jobs on one run directory (issue 63, item 7).

(1) A second job started on a run directory another live job holds is refused when its
    CheckpointManager is made, naming the holder's host and pid, nothing there touched (real
    processes, the training script's own code); ``take_over=True`` goes on with a warning; a
    holder killed with SIGKILL frees the run at once, even while a child it forked (a
    DataLoader worker's way) lingers.
(2) A manager never replaces a committed step, whoever held the lock: a save of step 12 that
    waited for the lock of ``run/step-12`` while another save committed there is refused
    (CheckpointLockedError), that checkpoint kept bitwise; on today's code it replaced it.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio import Checkpointer, CheckpointManager, Options
from ckptio.errors import CheckpointLockedError
from ckptio.storage.local.local_store import LocalStore
from ckptio.testing.cli_process import run_script
from ckptio.testing.faults import FsyncGate

from conftest import assert_same

DEADLINE_S = 60  # a guard against a hang, not a timing check
MiB = 1 << 20

JOB = textwrap.dedent("""
    import os, sys, time, torch, ckptio
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": opt, "step": 0}
    mgr = ckptio.CheckpointManager("run", save_every=1, keep_last=2)
    start = mgr.restore(state) or 0
    mgr.save(start + 1, state)
    if sys.argv[1] == "fork-and-die":  # a child inherits the lease's open file, then lingers
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        print("ready", flush=True)
        os._exit(0)
    print("ready", flush=True)
    time.sleep(60)  # a job still training
""")


def _job(cwd: Path, mode: str = "hold") -> subprocess.Popen[str]:
    child = subprocess.Popen([sys.executable, "-c", JOB, mode], cwd=cwd, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line.strip() == "ready", child.stderr.read() if child.stderr else line
    return child


def _second_job(cwd: Path, take_over: bool = False) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(f"""
        import torch, ckptio
        model = torch.nn.Linear(8, 8)
        state = {{"model": model, "optim": torch.optim.AdamW(model.parameters()), "step": 0}}
        try:
            mgr = ckptio.CheckpointManager("run", save_every=1, take_over={take_over})
        except ckptio.CkptError as exc:
            print("REFUSED", type(exc).__name__, exc)
        else:
            print("RESTORED", mgr.restore(state))
            mgr.close()
    """)
    script = cwd / f"second-job-{take_over}.py"
    script.write_text(code)
    # a fresh process forked from the warm forkserver (torch and ckptio imported there): a job
    # of its own, as `python script` would be, without an interpreter's start and imports
    return run_script(str(script), cwd=str(cwd), timeout=DEADLINE_S)


def _listing(run: Path) -> dict[str, float]:
    return {str(p.relative_to(run)): p.stat().st_mtime for p in run.rglob("*") if p.is_file()}


def test_a_second_job_on_a_live_run_is_refused_at_construction(tmp_path: Path) -> None:
    first = _job(tmp_path)
    try:
        before = _listing(tmp_path / "run")
        second = _second_job(tmp_path)
        assert second.stdout.startswith("REFUSED CheckpointLockedError"), second
        assert f"pid {first.pid}" in second.stdout and "in use by another job" in second.stdout
        assert "take_over=True" in second.stdout
        assert _listing(tmp_path / "run") == before  # nothing touched
        taken = _second_job(tmp_path, take_over=True)
        assert taken.stdout.strip() == "RESTORED 1", taken
        assert "taking over the run directory" in taken.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(DEADLINE_S)
    after = _second_job(tmp_path)  # the kernel let go with the killed holder
    assert after.stdout.strip() == "RESTORED 1", after


def test_a_child_the_holder_forked_does_not_keep_the_lease_after_the_holder(
        tmp_path: Path) -> None:
    """A job that forked a child (a DataLoader worker's way) and was killed: the child,
    lingering, held the lease's open file and so its lock, and a job restarted at once was
    refused ('yet the lease is still held: by processes that inherited it'). The child closes
    its copy when forked: the restarted job goes on while the child still runs."""
    first = _job(tmp_path, "fork-and-die")
    first.wait(DEADLINE_S)
    try:
        lingering = subprocess.run(["pgrep", "-f", "fork-and-die"], capture_output=True,
                                   text=True, check=False)
        assert lingering.stdout.strip(), "the forked child is gone: nothing tested"
        second = _second_job(tmp_path)
        assert second.stdout.strip() == "RESTORED 1", second
    finally:
        subprocess.run(["pkill", "-KILL", "-f", "fork-and-die"], check=False)


def test_one_process_may_make_a_second_manager_of_its_own_run(tmp_path: Path) -> None:
    """A process's own second manager is its own code's business (e.g. a restore helper)."""
    run = tmp_path / "run"
    with CheckpointManager(run, save_every=1) as a, CheckpointManager(run, save_every=1) as b:
        a.save(1, {"w": torch.ones(3)})
        assert b.restore({"w": torch.zeros(3)}) == 1


def test_a_tiered_manager_that_only_restored_drops_nothing_at_close(shm: str,
                                                                     tmp_path: Path) -> None:
    """A reader of a live run (an evaluation loop: a tiered manager that restores and never
    saves) closed: its close() ran the first tier's retention with its own keep_last, and
    deleted the training job's steps there (the base of its next delta, its drain's queue)."""
    tiers = [ckptio.Tier("shm://run", keep_last=3), ckptio.Tier(str(tmp_path / "disk"), every=4)]
    trainer = CheckpointManager(tiers=tiers, delta=ckptio.DeltaPolicy(full_every=4),
                                options=Options(buffer_bytes=MiB, pool_bytes=4 * MiB))
    state = {"frozen": torch.randn(64 << 10), "w": torch.zeros(1024)}
    for step in range(1, 9):
        state["w"][step] = step
        trainer.save(step, state)
    assert trainer.drained()
    kept = trainer.steps()
    assert kept[-3:] == [6, 7, 8]
    reader = CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=1),
                                      ckptio.Tier(str(tmp_path / "disk"), every=4)])
    got = {"frozen": torch.zeros(64 << 10), "w": torch.zeros(1024)}
    assert reader.restore(got) == 8
    reader.close()
    assert trainer.steps() == kept  # nothing of the training job's dropped
    state["w"][9] = 9
    trainer.save(9, state)
    trainer.close()
    assert_same(ckptio.load(trainer.path(9)), state)


def _hold_like_another_job(run: Path) -> int:
    """``run``'s lease locked as a live job elsewhere holds it -> the open file (close it)."""
    fd = os.open(run / ".ckptio-run.lease", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, json.dumps({"host": "elsewhere", "pid": 4321, "start": 1,
                              "since": "2026-11-28T00:00:00+0000"}).encode(), 0)
    return fd


@pytest.mark.parametrize("holder", ["another job", "this process", "a job's first run"])
def test_a_manager_not_holding_a_slower_tiers_lease_leaves_its_incomplete_copies(
        tmp_path: Path, holder: str) -> None:
    """A reader of a live run (``take_over=True``, or a second manager of the training
    process) made while the job's drain copies a step into the slower tier: the reader took
    that tier for its own (a lease taken over, not held; or, in a job's first run, a slower
    tier the job never leased: it leased only the tiers that existed when it started) and
    removed the copy under way as a leftover of a killed drain: the job's drain failed."""
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    tiers = [ckptio.Tier(str(fast), keep_last=2), ckptio.Tier(str(slow), every=4)]
    trainer, fd = None, None
    if holder == "a job's first run":
        trainer = CheckpointManager(tiers=tiers)  # neither tier's directory exists yet
    first = CheckpointManager(tiers=tiers) if trainer is None else trainer
    for step in range(1, 5):
        first.save(step, {"w": torch.full((1024,), float(step))})
    assert first.drained()
    if trainer is None:
        first.close()
    if holder == "another job":
        fd = _hold_like_another_job(slow)
    elif holder == "this process":
        trainer = CheckpointManager(tiers=tiers)
    copying = slow / "step-8"  # that job's drain, copying step 8 now
    copying.mkdir()
    (copying / "data-1-r00000-0000.bin").write_bytes(bytes(4096))
    try:
        reader = CheckpointManager(tiers=tiers, take_over=True)
        with pytest.warns(UserWarning, match="step 8: incomplete"):
            assert reader.restore({"w": torch.zeros(1024)}) == 4
        reader.close()
        assert os.listdir(copying) == ["data-1-r00000-0000.bin"]
    finally:
        if trainer is not None:
            trainer.close()
        if fd is not None:
            os.close(fd)


def test_a_run_directory_that_is_a_file_is_named_as_such_at_the_first_save(tmp_path: Path
                                                                            ) -> None:
    """A manager given a file's path: its first save said "cannot open the run lease
    <file>/.ckptio-run.lease: File exists"; it names the file as the run directory and the fix,
    writing nothing."""
    run = tmp_path / "model.pt"
    run.write_bytes(b"not a run")
    mgr = CheckpointManager(run)
    with pytest.raises(ckptio.StorageIOError, match=r"the run directory .*model\.pt exists and "
                                                    r"is not a directory: give the manager a "
                                                    r"directory"):
        mgr.save(1, {"w": torch.ones(3)}, force=True)
    mgr.close()
    assert run.read_bytes() == b"not a run" and sorted(os.listdir(tmp_path)) == ["model.pt"]


def test_a_lease_path_that_is_a_directory_names_the_fix(tmp_path: Path) -> None:
    """Something else at <run>/.ckptio-run.lease (a directory): the manager is refused naming
    the path and the fix, the committed step untouched."""
    run = tmp_path / "run"
    with CheckpointManager(run) as mgr:
        mgr.save(1, {"w": torch.ones(3)}, force=True)
    (run / ".ckptio-run.lease").mkdir()
    with pytest.raises(ckptio.StorageIOError, match=r"cannot open the run lease .*\.ckptio-run"
                                                    r"\.lease: Is a directory; .*remove what is "
                                                    r"at that path"):
        CheckpointManager(run)
    assert ckptio.load(run / "step-1")["w"].tolist() == [1.0] * 3


def test_a_manager_never_replaces_a_step_committed_while_it_waited(tmp_path: Path) -> None:
    run = tmp_path / "run"
    theirs = {"w": torch.arange(1000.0), "step": 12}
    other = Checkpointer(Options(buffer_bytes=MiB, pool_bytes=4 * MiB))
    reached, go = threading.Event(), threading.Event()
    other.resources().wrap_backend(LocalStore("."), lambda b: FsyncGate(b, reached, go))
    outcome: list[object] = []
    saver = threading.Thread(target=lambda: outcome.append(other.save(theirs, run / "step-12")))
    mgr = CheckpointManager(run, save_every=1)
    try:
        saver.start()
        assert reached.wait(DEADLINE_S)  # the other save holds run/step-12's lock
        mine: list[object] = []

        def save_mine() -> None:
            try:
                mine.append(mgr.save(12, {"w": torch.zeros(1000), "step": 12}))
            except ckptio.CkptError as exc:
                mine.append(exc)

        waiter = threading.Thread(target=save_mine)
        waiter.start()
        time.sleep(0.5)  # the manager's save is past its check and waits for the lock
        go.set()
        saver.join(DEADLINE_S)
        waiter.join(DEADLINE_S)
        assert isinstance(outcome[0], ckptio.SaveResult), outcome
        assert isinstance(mine[0], CheckpointLockedError), mine
        assert "committed by another save" in str(mine[0]) and "step-12" in str(mine[0])
    finally:
        go.set()
        other.close()
        mgr.close()
    assert_same(ckptio.load(run / "step-12"), theirs)  # theirs kept, bitwise


def test_overwrite_false_refuses_a_committed_checkpoint_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ckptio.save({"w": torch.ones(4)}, path)
    files = sorted(os.listdir(path))
    ck = Checkpointer()
    try:
        with pytest.raises(CheckpointLockedError, match=r"overwrite=False"):
            ck.save({"w": torch.zeros(4)}, path, overwrite=False)
    finally:
        ck.close()
    assert sorted(os.listdir(path)) == files
    assert torch.equal(ckptio.load(path)["w"], torch.ones(4))


def test_a_job_that_took_over_a_live_run_is_told_the_newer_steps_are_the_other_job_s(
        tmp_path: Path) -> None:
    """take_over=True while the first job still runs: that job keeps saving until its next
    save sees its lease lost; the new job's first save is then older than those steps. The
    refusal says whose they are and to stop that job, not the rollback advice (remove the
    newer steps) a new user followed in a trial."""
    def state() -> dict[str, Any]:
        return {"model": torch.nn.Linear(4, 4), "step": 0}

    first = CheckpointManager(tmp_path / "run", keep_last=5)
    first.save(1, state())
    first.save(2, state())
    second = CheckpointManager(tmp_path / "run", take_over=True)
    try:
        assert second.restore(state()) == 2
        first.save(3, state())
        first.save(4, state())
        with pytest.raises(ckptio.CkptError) as refused:
            second.save(3, state())
        message = str(refused.value)
        assert "took the run over (take_over=True) after restoring step 2" in message, message
        assert "stop that job" in message and "remove those newer steps" not in message
    finally:
        second.close()
        first.close()
