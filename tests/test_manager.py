"""CheckpointManager: a directory of steps saved on an interval, kept by a retention policy and
restored newest-loadable-first.

Covers: save / steps / latest / path and which names count as steps; the interval policy; async
eager and lazy saves (retention only after the commit); keep_last, keep_every and both, and the
newest verified step kept; a failed save deleting nothing; falling back past a corrupted, an
incomplete and a damaged-manifest step (and not past a state mismatch); what a directory without
steps holds; a kill during retention (a real subprocess); two gloo ranks agreeing on all of it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import ckptio
from ckptio.storage.local.runlease import LEASE_NAME
from ckptio import (CheckpointNotFoundError, Checkpointer, CkptError, CorruptCheckpointError,
                    ManifestError, Options, SaveHandle, SaveResult, StateMismatchError,
                    StorageIOError)
from ckptio.managing.manager import CheckpointManager
from ckptio.testing.faults import inject
from ckptio.testing.rank_processes import run_ranks

import dist_cases as cases

MiB = 1 << 20
OPTS = Options(buffer_bytes=MiB, pool_bytes=4 * MiB)


def _state(step: int, numel: int = 256) -> dict:
    return {"w": torch.full((numel,), float(step)), "b": torch.arange(100) + step, "step": step}


def _blank(numel: int = 256) -> dict:
    return {"w": torch.zeros(numel), "b": torch.zeros(100, dtype=torch.int64), "step": -1}


def _manager(directory, **kwargs) -> CheckpointManager:
    return CheckpointManager(directory, options=OPTS, **kwargs)


def _saved(directory, steps, **kwargs) -> CheckpointManager:
    mgr = _manager(directory, keep_last=None, **kwargs)
    for step in steps:
        mgr.save(step, _state(step))
    return mgr


def _flip_tensor_byte(path: str, key: str = "w") -> None:
    """Flip one byte inside ``key``'s stored bytes (not padding: the checksum covers it)."""
    with open(os.path.join(path, "manifest.json"), "rb") as f:
        body = json.loads(f.read().split(b"\n", 1)[1])
    (entry,) = [t for t in body["tensors"] if t["key"] == key]
    with open(os.path.join(path, entry["file"]), "r+b") as f:
        f.seek(entry["offset"] + 3)
        byte = f.read(1)[0]
        f.seek(entry["offset"] + 3)
        f.write(bytes([byte ^ 0x10]))


def _hidden(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(".deleting-step-"))


# ------------------------------------------------------------------ saving and listing


def test_save_steps_latest_path_and_what_counts_as_a_step(tmp_path):
    d = tmp_path / "run"
    mgr = _manager(d, keep_last=None)
    assert mgr.steps() == [] and mgr.latest() is None and mgr.incomplete() == []
    for step in (0, 10, 20):
        result = mgr.save(step, _state(step))
        assert isinstance(result, SaveResult) and result.path == mgr.path(step)
    assert mgr.path(20) == os.path.join(str(d), "step-20")
    assert ckptio.load(mgr.path(10))["step"] == 10  # an ordinary checkpoint
    # not steps: other names, a non-canonical number, a file, a symlink; step-3 is incomplete
    for name in ("step-007", "step-x", "steps", "step-4.tmp"):
        (d / name).mkdir()
    (d / "step-5").write_text("a file")
    os.symlink(mgr.path(10), d / "step-15")
    (d / "step-3").mkdir()
    (d / "step-3" / "data-0-r00000-0000.bin").write_bytes(b"partial")
    assert mgr.steps() == [0, 10, 20] and mgr.latest() == 20 and mgr.incomplete() == [3]
    state = _blank()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the newest is whole: no fallback, no warning
        assert mgr.restore(state) == 20
    assert state["step"] == 20 and torch.equal(state["w"], torch.full((256,), 20.0))
    # a committed step is never saved over; an incomplete one is
    with pytest.raises(CkptError, match="step 20 already has a committed checkpoint"):
        mgr.save(20, _state(99))
    assert ckptio.load(mgr.path(20))["step"] == 20
    with pytest.raises(CkptError, match=r"step 3 is older than step\(s\) committed before it: \[10, 20\] in "):
        mgr.save(3, _state(3))  # restore() would pass it over: test_a_rollback_...
    (d / "step-30").mkdir()
    (d / "step-30" / "data-0-r00000-0000.bin").write_bytes(b"partial")
    mgr.save(30, _state(30))
    assert mgr.steps() == [0, 10, 20, 30] and mgr.incomplete() == [3]
    mgr.close()
    assert set(os.listdir(d)) == {"step-0", "step-10", "step-15", "step-20", "step-3", "step-30",
                                  "step-4.tmp", "step-5", "step-007", "step-x", "steps"}


def test_a_rollback_refuses_saves_below_the_steps_it_left(tmp_path):
    """restore(state, step=N) below newer committed steps (a rollback past a loss spike), then
    save(N + 1): refused, naming the newer steps and the fix. Saved, keep_last would drop it at
    once (it keeps the newest) and a restart would resume from the abandoned run's newest step,
    silently. Once they are removed the saves go on; steps a restore passed over as damaged
    do not count."""
    d = tmp_path / "run"
    with _manager(d, keep_last=5) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, _state(step))
    with _manager(d, keep_last=2) as mgr:
        assert mgr.restore(_blank(), step=20) == 20
        with pytest.raises(CkptError, match=r"step 21 is older than step\(s\) committed before it: "
                           r"\[30, 40\] in .*a restart would resume from step 40.*remove those newer"):
            mgr.save(21, _state(21))
        assert mgr.steps() == [10, 20, 30, 40]
        for step in (30, 40):
            shutil.rmtree(mgr.path(step))
        mgr.save(21, _state(21))
        mgr.save(22, _state(22))
        assert mgr.steps() == [20, 21, 22]  # 20: restored last
    _flip_tensor_byte(os.path.join(d, "step-22"))
    with _manager(d, keep_last=2) as mgr, pytest.warns(UserWarning, match="not a newer one"):
        assert mgr.restore(_blank()) == 21
        mgr.save(22, _state(22))  # replaces the damaged step 22
        mgr.save(23, _state(23))
        assert mgr.steps() == [21, 22, 23]  # 21: restored last


def test_interval_policy_and_force(tmp_path):
    mgr = _manager(tmp_path / "run", save_every=5, keep_last=None)
    assert [s for s in range(12) if mgr.should_save(s)] == [0, 5, 10]
    assert mgr.save(3, _state(3)) is None
    assert mgr.save(4, _state(4), asynchronous=True) is None
    assert not os.path.exists(mgr.path(3)) and not os.path.exists(mgr.path(4))
    assert isinstance(mgr.save(3, _state(3), force=True), SaveResult)
    assert isinstance(mgr.save(5, _state(5)), SaveResult)
    assert mgr.steps() == [3, 5]
    mgr.close()


@pytest.mark.parametrize("kwargs", [dict(keep_last=0), dict(keep_every=0), dict(save_every=0),
                                    dict(save_every=None), dict(keep_last=True),
                                    dict(options=OPTS, checkpointer=Checkpointer(OPTS))])
def test_bad_arguments_are_refused(tmp_path, kwargs):
    with pytest.raises(CkptError, match=next(iter(kwargs))):
        CheckpointManager(tmp_path, **kwargs)


@pytest.mark.parametrize("step", [-1, "3", True, 2.0])
def test_bad_steps_are_refused(tmp_path, step):
    mgr = _manager(tmp_path)
    for call in (mgr.should_save, mgr.path, lambda s: mgr.save(s, _state(1), force=True)):
        with pytest.raises(CkptError, match="step must be an integer"):
            call(step)
    assert os.listdir(tmp_path) in ([], [LEASE_NAME])  # the open manager's run lease only


# ------------------------------------------------------------------ async saves


def test_async_eager_retention_only_after_commit(tmp_path):
    ck = Checkpointer(OPTS)
    mgr = CheckpointManager(tmp_path / "run", keep_last=1, checkpointer=ck)
    mgr.save(1, _state(1))
    inject(ck, delay_s=0.1)  # every write slowed: the save is still running when checked
    state = _state(2, numel=MiB)  # 4 MiB: the last buffers are written after the call returns
    handle = mgr.save(2, state, asynchronous=True)
    assert isinstance(handle, SaveHandle) and not handle.done()
    assert mgr.steps() == [1] and mgr.incomplete() == [2]  # nothing deleted before the commit
    state["w"].fill_(-1.0)  # eager: a change after the call returned is not saved
    result = mgr.wait()
    assert isinstance(result, SaveResult) and result.path == mgr.path(2)
    assert mgr.steps() == [2] and not os.path.exists(mgr.path(1))
    assert torch.equal(ckptio.load(mgr.path(2))["w"], torch.full((MiB,), 2.0))
    # a save waited on directly: its retention runs at the next save, after the call returns
    mgr.save(3, _state(3), asynchronous=True).wait()
    assert mgr.steps() == [2, 3]
    mgr.save(4, _state(4), asynchronous=True)
    assert mgr.steps()[0] == 3
    mgr.close()  # waits for step 4, then its retention
    assert mgr.steps() == [4] and _hidden(tmp_path / "run") == []
    assert mgr.wait() is None
    ck.close()


def test_lazy_save_through_the_manager(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    mgr = _manager(tmp_path / "run", keep_last=1)
    mgr.save(1, {"model": model.state_dict()})
    model(torch.ones(4, 64)).sum().backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = mgr.save(2, {"model": model.state_dict()}, lazy=True, optimizers=[opt])
    assert isinstance(handle, SaveHandle)  # lazy implies asynchronous
    opt.step()  # waits for the capture, then changes the weights
    assert not torch.equal(model.weight, before["weight"])
    assert mgr.steps()[0] == 1  # retention has not run: step 2 may not be committed yet
    assert mgr.wait().path == mgr.path(2)
    assert mgr.steps() == [2]
    fresh = {"model": {k: torch.zeros_like(v) for k, v in before.items()}}
    assert mgr.restore(fresh) == 2
    assert all(torch.equal(fresh["model"][k], v) for k, v in before.items())
    mgr.close()


# ------------------------------------------------------------------ retention


@pytest.mark.parametrize("keep_last, keep_every, kept", [
    (2, None, [6, 7]),
    (None, 3, [1, 2, 3, 4, 5, 6, 7]),
    (1, 3, [3, 6, 7]),
    (2, 4, [4, 6, 7]),
])
def test_retention_policy(tmp_path, keep_last, keep_every, kept):
    d = tmp_path / "run"
    d.mkdir()
    (d / "notes.txt").write_text("not a step")
    (d / "step-0").mkdir()  # incomplete, older than every step: left alone
    (d / "step-0" / "data-x-r00000-0000.bin").write_bytes(b"partial")
    (d / "best").mkdir()
    mgr = _manager(d, keep_last=keep_last, keep_every=keep_every)
    for step in range(1, 8):
        mgr.save(step, _state(step))
        assert mgr.latest() == step  # the newest is never deleted
    mgr.close()
    assert mgr.steps() == kept and mgr.incomplete() == [0]
    assert (d / "notes.txt").read_text() == "not a step" and (d / "best").is_dir()
    assert _hidden(d) == []


def test_newest_verified_step_is_kept_until_a_newer_one_is_verified(tmp_path):
    mgr = _manager(tmp_path / "run", keep_last=2)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    _flip_tensor_byte(mgr.path(3))
    with pytest.warns(UserWarning, match="step 3"):
        assert mgr.restore(_blank()) == 2  # 2 is now the newest verified step
    mgr.save(4, _state(4))
    mgr.save(5, _state(5))
    assert mgr.steps() == [2, 4, 5]  # 3 (damaged) dropped, 2 kept beyond keep_last
    assert mgr.verify(5) > 0  # a newer verified step: 2 may go now
    mgr.save(6, _state(6))
    assert mgr.steps() == [5, 6]
    mgr.close()


def test_failed_async_save_deletes_nothing_and_its_error_is_raised_once(tmp_path):
    d = tmp_path / "run"
    _saved(d, [1, 2, 3]).close()
    ck = Checkpointer(OPTS)
    mgr = CheckpointManager(d, keep_last=1, checkpointer=ck)
    inject(ck, fail_write=1)
    handle = mgr.save(4, _state(4), asynchronous=True)
    with pytest.raises(StorageIOError, match="injected"):
        mgr.wait()
    assert handle.done() and mgr.steps() == [1, 2, 3]
    assert mgr.wait() is None  # raised once
    # waited on directly: the next save starts; nothing is deleted before it commits
    inject(ck, fail_write=1)
    with pytest.raises(StorageIOError, match="injected"):
        mgr.save(5, _state(5), asynchronous=True).wait()
    inject(ck, delay_s=0.1)
    handle = mgr.save(5, _state(5, numel=MiB), asynchronous=True)  # the failed step, again
    assert not handle.done() and mgr.steps() == [1, 2, 3]
    mgr.wait()
    assert mgr.steps() == [5]
    # an error nobody waited for: raised by the next save, which does not start
    inject(ck, fail_write=1)
    mgr.save(7, _state(7), asynchronous=True)
    with pytest.raises(StorageIOError, match="injected"):
        mgr.save(8, _state(8))
    assert mgr.steps() == [5] and not os.path.exists(mgr.path(8))
    mgr.close()  # nothing left to raise
    ck.close()


# ------------------------------------------------------------------ restoring


def test_restore_falls_back_past_a_corrupted_newest_step(tmp_path, caplog):
    """The fallback is told once: one warnings.warn (pointing at the caller), no log line that
    would print it a second time."""
    mgr = _saved(tmp_path / "run", [1, 2, 3])
    _flip_tensor_byte(mgr.path(3))
    state = _blank()
    with caplog.at_level(logging.DEBUG):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            assert mgr.restore(state) == 2
    (warning,) = record
    assert re.search(r"restored step 2 .*step 3: CorruptCheckpointError", str(warning.message))
    assert warning.filename == __file__  # stacklevel: the caller's line
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert state["step"] == 2 and torch.equal(state["w"], torch.full((256,), 2.0))
    assert torch.equal(state["b"], torch.arange(100) + 2)
    with pytest.raises(CorruptCheckpointError):
        mgr.restore(_blank(), step=3)  # exactly that step: no fallback
    # a step found damaged may be saved again: the atomic commit replaces it
    mgr.save(3, _state(30))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.restore(state) == 3
    assert state["step"] == 30
    with pytest.raises(CkptError, match="step 2 is older .*step 2 itself is committed"):
        mgr.save(2, _state(2))  # not found damaged (and below step 3): refused
    mgr.close()


def test_restore_falls_back_past_incomplete_and_damaged_manifest(tmp_path):
    mgr = _saved(tmp_path / "run", [1, 2, 3])
    os.remove(os.path.join(mgr.path(3), "manifest.json"))  # an interrupted save of step 3
    with open(os.path.join(mgr.path(2), "manifest.json"), "r+b") as f:
        f.seek(40)
        f.write(b"garbage")
    assert mgr.steps() == [1, 2] and mgr.incomplete() == [3]
    state = _blank()
    with pytest.warns(UserWarning) as record:
        assert mgr.restore(state) == 1
    (message,) = [str(w.message) for w in record]
    assert "step 3: incomplete" in message and "step 2: ManifestError" in message
    assert state["step"] == 1 and torch.equal(state["w"], torch.full((256,), 1.0))
    with pytest.raises(ManifestError):
        mgr.restore(_blank(), step=2)
    mgr.close()


def test_state_mismatch_is_raised_not_fallen_back_from(tmp_path):
    mgr = _saved(tmp_path / "run", [1, 2])
    _flip_tensor_byte(mgr.path(2))  # even with the newest damaged: the state is what is wrong
    state = _blank() | {"extra": torch.zeros(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(StateMismatchError, match="extra"):
            mgr.restore(state)
    mgr.close()


def test_every_step_damaged(tmp_path):
    mgr = _saved(tmp_path / "run", [1, 2])
    _flip_tensor_byte(mgr.path(1))
    _flip_tensor_byte(mgr.path(2), key="b")
    with pytest.raises(CorruptCheckpointError, match=r"step 2: .*step 1: ") as info:
        mgr.restore(_blank())
    assert str(tmp_path / "run") in str(info.value)
    # the state may hold a damaged copy's tensors read before the damage: said (a new user
    # caught the error, started fresh and trained a model partly filled from a checkpoint)
    assert "build it afresh before training from it (starting fresh included)" in str(info.value)
    mgr.close()


@pytest.mark.parametrize("holds", ["nothing", "empty", "other files"])
def test_nothing_to_restore_returns_none(tmp_path, holds, caplog):
    """Nothing ever saved there: restore() returns None (the loop starts from scratch), leaves
    the state alone, raises no warning but logs one line naming the directory (a typo shows);
    ``required=True`` raises instead, creating nothing; a tiered manager does the same
    (test_tiers)."""
    d = tmp_path / "run"
    if holds != "nothing":
        d.mkdir()
    if holds == "other files":
        (d / "events.out.tfevents").write_bytes(b"logs")
    mgr = _manager(d)
    state = _blank()
    with pytest.raises(CheckpointNotFoundError, match=r"required=True\): nothing to restore in "
                       rf"{re.escape(str(d))}: no step was ever committed there. Check the"):
        mgr.restore(state, required=True)
    assert d.exists() == (holds != "nothing")
    caplog.clear()
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="ckptio"):
        warnings.simplefilter("error")
        assert mgr.restore(state) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"ckptio: nothing to restore in {d}: no step was ever committed there; starting fresh "
        "(restore(state, required=True) raises instead)"]
    assert state["step"] == -1 and mgr.steps() == []
    mgr.save(1, _state(1))  # and the loop goes on from scratch
    assert mgr.restore(state) == 1
    mgr.close()


def test_only_incomplete_steps_restore_nothing_with_a_warning(tmp_path):
    """A job killed during its first save committed nothing: None, with a warning naming the
    incomplete step, which is left in place; a step that is committed but damaged is not
    'nothing' (test_every_step_damaged raises)."""
    mgr = _saved(tmp_path / "run", [1])
    os.unlink(os.path.join(mgr.path(1), "manifest.json"))  # as a kill before the commit leaves
    with pytest.warns(UserWarning, match=r"nothing to restore .*incomplete steps \[1\]"):
        assert mgr.restore(_blank()) is None
    assert mgr.incomplete() == [1]
    mgr.close()


@pytest.mark.parametrize("holds, expect", [
    ("ckptio", "is itself a ckptio checkpoint"),
    ("dcp", r"torch.distributed.checkpoint \(DCP\)"),
    ("torch", r"torch.save files \(model.pt\)"),
    ("named", r"ckptio checkpoints not named step-<N> \(best\)"),
])
def test_no_step_to_restore_says_what_is_there(tmp_path, holds, expect):
    """Something else is there: not 'nothing to restore' (starting from scratch would ignore
    it) but CheckpointNotFoundError saying what it is."""
    d = tmp_path / "run"
    d.mkdir()
    if holds == "ckptio":
        ckptio.save(_state(1), d, options=OPTS)
    elif holds == "dcp":
        (d / ".metadata").write_bytes(b"")
    elif holds == "torch":
        torch.save(_state(1), d / "model.pt")
    elif holds == "named":
        ckptio.save(_state(1), d / "best", options=OPTS)
    mgr = _manager(d)
    with pytest.raises(CheckpointNotFoundError, match=expect) as info:
        mgr.restore(_blank())
    assert str(d) in str(info.value)
    if holds == "ckptio":  # its own data files are not torch.save files to torch.load
        assert "torch.load" not in str(info.value) and ".bin" not in str(info.value)
    mgr.close()


# ------------------------------------------------------------------ a kill during retention

CHILD = r"""
import os, shutil, signal, sys
import torch
import ckptio
from ckptio.managing.manager import CheckpointManager

def killed_half_way(path, *args, **kwargs):
    os.unlink(os.path.join(path, sorted(os.listdir(path))[0]))  # a data file: half-deleted
    os.kill(os.getpid(), signal.SIGKILL)

shutil.rmtree = killed_half_way
mgr = CheckpointManager(sys.argv[1], keep_last=1,
                        options=ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20))
mgr.save(4, {"w": torch.full((256,), 4.0), "b": torch.arange(100) + 4, "step": 4})
mgr.close()  # joins the removal, which dies half-way
print("not killed")
"""


def test_kill_during_retention_never_lists_a_half_deleted_step(tmp_path):
    d = tmp_path / "run"
    _saved(d, [1, 2, 3]).close()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(d)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr + proc.stdout
    hidden = _hidden(d)
    assert len(hidden) == 3  # all renamed before any removal began
    sizes = sorted(len(os.listdir(d / name)) for name in hidden)
    assert sizes[0] == sizes[-1] - 1  # one of them half-deleted
    mgr = _manager(d, keep_last=1)
    assert mgr.steps() == [4] and mgr.incomplete() == []
    state = _blank()
    assert mgr.restore(state) == 4 and state["step"] == 4
    mgr.save(5, _state(5))  # the next retention finishes the leftovers
    mgr.close()
    assert _hidden(d) == [] and mgr.steps() == [4, 5]  # 4: restored, so kept as verified
    assert sorted(os.listdir(d)) == ["step-4", "step-5"]


# ------------------------------------------------------------------ many ranks


def test_two_ranks_agree_on_steps_retention_and_fallback(tmp_path):
    """Bodies in dist_cases.manager_ranks: saves (2 and 3 async), retention on rank 0 only,
    restore, restore past a step whose damage only rank 1 sees (rank 0 gets RankFailedError)."""
    out = run_ranks(2, cases.manager_ranks, str(tmp_path / "run"))
    for rank, got in enumerate(out):
        assert got["steps"] == [2, 3], (rank, got)
        assert got["restored"] == [3, 2], (rank, got)  # whole, then past the damaged step 3
        assert got["same"] == [True, True], (rank, got)
        (message,) = got["warnings"]
        assert "restored step 2" in message and "step 3: rank 1: CorruptCheckpointError" in message
    assert out[0]["hidden"] == ["step-1"] and out[1]["hidden"] == []  # only rank 0 deletes
    # damage on one rank, a mismatched state on the other: nobody falls back
    assert [got["mixed"] for got in out] == ["CorruptCheckpointError", "StateMismatchError"]
    assert sorted(os.listdir(tmp_path / "run")) == ["step-2", "step-3"]


def test_ranks_calling_different_manager_methods_are_told_they_are_out_of_step(tmp_path):
    """Rank 0 lists steps while rank 1 saves: rank 1 took rank 0's listing for its save's
    refusal (a CkptError quoting a listing); it now raises RankFailedError naming both calls
    and the fix, and the ranks, back in step, agree again."""
    out = run_ranks(2, cases.manager_out_of_step, str(tmp_path / "run"), timeout_s=90)
    assert out[0]["mixed"] == "[1]", out[0]
    said = out[1]["mixed"]
    assert said.startswith("RankFailedError") and "out of step" in said, said
    assert "refusal" in said and "_listings" in said, said
    assert "same order with the same arguments" in said, said
    assert [got["steps"] for got in out] == [[1], [1]]


def test_a_rank_killed_during_a_restore_is_named_with_the_step_it_restored(tmp_path):
    """The survivor of a rank killed mid-restore raised the manager's own exchange's error
    ("rank 1: no sign of life ...", no checkpoint named); it now raises the load's, naming the
    step's path and the rank."""
    root = str(tmp_path / "run")
    out = run_ranks(2, cases.manager_restore_killed, root, str(tmp_path / "mark"),
                    timeout_s=90, may_die=(1,), agent_store=True)
    said = out[0]
    assert said is not None and said.startswith("RankFailedError"), said
    assert f"load of {root}/step-1 failed on rank 1" in said, said


def test_an_exit_without_close_is_said(tmp_path):
    """A script that saves and exits without mgr.close(): its async saves are committed, and
    one warning at exit names the manager and that its last retention pass did not run (keep_last
    exceeded); the same script closing it says nothing."""
    code = ("import ckptio, torch, sys\n"
            "m = ckptio.CheckpointManager(sys.argv[1], keep_last=1)\n"
            "for s in (1, 2, 3):\n"
            "    m.save(s, {'w': torch.full((2,), float(s))}, asynchronous=True)\n"
            "if sys.argv[2] == 'close':\n"
            "    m.close()\n")
    for how in ("exit", "close"):
        run = tmp_path / how
        done = subprocess.run([sys.executable, "-c", code, str(run), how], capture_output=True,
                              text=True, timeout=120, check=True)
        said = "was not closed before exit: its saves in flight were waited for, but its last"
        assert (said in done.stderr) == (how == "exit"), done.stderr
        assert (f"CheckpointManager({run})" in done.stderr) == (how == "exit")
        assert ckptio.load(run / "step-3")["w"].tolist() == [3.0, 3.0]
    assert sorted(os.listdir(tmp_path / "close")) == ["step-3"]
    assert len(os.listdir(tmp_path / "exit")) > 1  # what the warning says: more than keep_last
    # a manager that never saved (a restore that found nothing, or refused) has nothing to say
    done = subprocess.run([sys.executable, "-c", "import ckptio, torch, sys\n"
                           "m = ckptio.CheckpointManager(sys.argv[1])\n"
                           "print(m.restore({'w': torch.zeros(2)}))\n", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "None" and "not closed" not in done.stderr, done.stderr


def test_tiers_given_positionally_are_a_ckpt_error_naming_tiers() -> None:
    """CheckpointManager([Tier, Tier]) (the tiers as the first argument) says to give them by
    name, instead of a raw TypeError from the path handling."""
    tiers = [ckptio.Tier("shm://positional"), ckptio.Tier("ckpts", every=10)]
    with pytest.raises(CkptError, match=r"CheckpointManager\(list of 2\): give tiers by name, "
                                        r"CheckpointManager\(tiers=\[\.\.\.\]\)"):
        CheckpointManager(tiers)
    with pytest.raises(CkptError, match="the first argument is the directory of the steps"):
        CheckpointManager(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_after_close_is_refused_naming_the_fix(tmp_path, asynchronous):
    """close() lets go of the run's lease, the drain and the protection: a save after it used
    to write the step unleased and, asynchronous, lose its error (the exit line said "its saves
    finished"). It is refused, nothing written; close() again is a no-op; a new manager saves."""
    run = tmp_path / "run"
    mgr = _manager(run, keep_last=2)
    mgr.save(1, _state(1), asynchronous=asynchronous)
    mgr.close()
    mgr.close()
    with pytest.raises(CkptError, match=r"step 2 was not saved: CheckpointManager\(.*run\) was "
                                        r"closed; make a new CheckpointManager"):
        mgr.save(2, _state(2), asynchronous=asynchronous)
    assert sorted(p for p in os.listdir(run) if p.startswith("step-")) == ["step-1"]
    with _manager(run, keep_last=2) as again:
        assert again.restore(_blank()) == 1
        again.save(2, _state(2), asynchronous=asynchronous)
    assert ckptio.load(run / "step-2")["step"] == 2


def test_an_emergency_save_after_ctrl_c_in_a_save_is_made(tmp_path, monkeypatch):
    """Ctrl-C lands while an async save copies the state (the usual ``except KeyboardInterrupt:
    mgr.save(step, state, force=True)``): the interrupted step is not committed, and the
    emergency save is made instead of being refused for the abandoned save before it."""
    from concurrent.futures import Future

    from ckptio.saving.handover import Handover

    real_take = Handover.take

    def interrupted_take(self):  # the signal lands in the capture the caller runs
        if self._given.result() is not None:
            def capture() -> None:
                raise KeyboardInterrupt
            self._given = Future()
            self._given.set_result(capture)
        return real_take(self)

    run = tmp_path / "run"
    mgr = _manager(run, keep_last=3)
    mgr.save(1, _state(1))
    monkeypatch.setattr(Handover, "take", interrupted_take)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, _state(2), asynchronous=True)
    monkeypatch.setattr(Handover, "take", real_take)
    mgr.save(3, _state(3), force=True)
    mgr.close()
    assert mgr.steps() == [1, 3] and ckptio.load(run / "step-3")["step"] == 3


@pytest.mark.parametrize("timeout", [-1, float("nan"), "5", True])
def test_a_timeout_that_is_not_seconds_is_refused_by_every_public_wait(tmp_path, timeout):
    """A negative or NaN limit gave up at once and blamed the storage; a string raised torch's
    or threading's TypeError. Every public wait refuses it by name; the manager stays open."""
    ck = Checkpointer()
    handle = ck.async_save(_state(1), str(tmp_path / "one"))
    mgr = CheckpointManager(str(tmp_path / "run"), checkpointer=ck)
    mgr.save(1, _state(1), asynchronous=True)
    calls = {"SaveHandle.wait": handle.wait, "Checkpointer.settle": ck.settle,
             "CheckpointManager.wait": mgr.wait, "CheckpointManager.drained": mgr.drained,
             "CheckpointManager.protected": mgr.protected, "CheckpointManager.close": mgr.close,
             "Checkpointer.close": ck.close}
    for name, call in calls.items():
        with pytest.raises(CkptError, match=rf"^{re.escape(name)}\(timeout=.*\): a number of "
                                            r"seconds >= 0, or None"):
            call(timeout=timeout)
    mgr.save(2, _state(2))  # not closed by the refused close()
    assert mgr.steps() == [1, 2] and handle.wait(timeout=60).nbytes > 0
    mgr.close()
    ck.close()
