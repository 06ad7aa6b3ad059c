"""Tiered CheckpointManager (``ckptio.CheckpointManager(tiers=[ckptio.Tier(...), ...])``): host
memory first (``shm://``, ``mem://``), drained in the background to a disk directory, restored
from the fastest verified copy.

Covers, with real models and AdamW compared bit for bit after a restore into freshly built ones:
round trips through each tier (shm alone, shm + disk every 2 / 3, mem:// first, async and lazy
saves, the first tier's interval, three tiers); memory lost (the shm directory removed) -> the
newest step the disk holds; a damaged copy in tier 0 -> the same step from tier 1, with a
warning; damaged everywhere -> an older step; nothing anywhere -> None (restore) /
CheckpointNotFoundError (a step asked for); issue 30's manager options (metrics and metadata
drained with their step, a preemption hook, the others on the first tier); a damaged memory copy
never propagated by the drain; a process killed (SIGKILL) during a drain (no step lost, the
drain resumes on start) and during a save into memory (the previous step restored); retention
per tier; a drain that falls behind skipping to the newest step; the memory budget; validation
errors; a drain error raised once; the ``ckptio status`` command; two gloo ranks saving and
restoring, and a resharded restore in one process from the disk tier.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
import warnings
from typing import Any

import pytest
import torch

import ckptio
from ckptio.storage.local.runlease import LEASE_NAME
from ckptio import (CheckpointNotFoundError, CkptError, CorruptCheckpointError, Tier,
                    UnsupportedPathError)
from ckptio.storage.select import checkpoint_path
from ckptio.testing.rank_processes import run_ranks

MiB = 1 << 20
OPTS = ckptio.Options(buffer_bytes=MiB, pool_bytes=4 * MiB)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ fixtures and helpers


def _build(seed: int = 0, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(),
                                torch.nn.Linear(width, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        loss = model(torch.randn(16, model[0].in_features)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(), "step": step})


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Same structure; tensors bitwise (dtype, shape, torch.equal on the bytes)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: dtype/shape"
        assert torch.equal(got.detach().reshape(-1).view(torch.uint8),
                           want.detach().reshape(-1).view(torch.uint8)), f"{where}: bytes differ"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(map(str, got)) == sorted(map(str, want)), (
            f"{where}: keys {list(got)} != {list(want)}")
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _fresh(width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    """A freshly built model (other weights) and an AdamW without state, to restore into."""
    model, opt = _build(seed=12345, width=width)
    return model, opt, {"model": model, "optim": opt, "step": -1}


def _assert_restored(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any],
                     want: dict[str, Any]) -> None:
    assert state["step"] == want["step"]
    _assert_same(_snapshot(model, opt, state["step"]), want)


def _train_and_save(mgr: Any, steps: range, model: torch.nn.Module,
                    opt: torch.optim.Optimizer, *, drain_each: bool = False,
                    **save_kwargs: Any) -> dict[int, dict[str, Any]]:
    """One training step then mgr.save per step -> the state saved at each step.
    ``drain_each``: wait for the drain after each save, so that tier 0's retention at the next
    commit never keeps a step only because the drain was still copying it."""
    saved = {}
    for step in steps:
        _train(model, opt)
        mgr.save(step, {"model": model, "optim": opt, "step": step}, **save_kwargs)
        saved[step] = _snapshot(model, opt, step)
        if drain_each:
            assert mgr.drained(timeout=60)
    return saved


def _tiered(*tiers: Tier, **kwargs: Any) -> Any:
    return ckptio.CheckpointManager(tiers=list(tiers), options=OPTS, **kwargs)



def test_a_rollback_from_the_disk_tier_refuses_saves_below_its_newer_steps(tmp_path, shm):
    """Memory tier first, disk tier second (the memory is empty after a restart): restore(state,
    step=20) from the disk, where 30 and 40 are committed, then save(21). Refused, naming the
    disk tier's newer steps: drained, the disk's keep_last would drop step 21 at once and a
    restart would resume from step 40, silently (the first tier alone holds nothing newer)."""
    disk = str(tmp_path / "disk")
    with _tiered(Tier(disk, keep_last=None)) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, {"w": torch.full((64,), float(step)), "step": step})
    state = {"w": torch.zeros(64), "step": -1}
    with _tiered(Tier("shm://roll", keep_last=2), Tier(disk, every=1, keep_last=2)) as mgr:
        assert mgr.restore(state, step=20) == 20 and state["step"] == 20
        with pytest.raises(CkptError, match=r"step 21 is older than step\(s\) committed before "
                           rf"it: \[30, 40\] in {re.escape(disk)}\..*resume from step 40"):
            mgr.save(21, {"w": torch.full((64,), 21.0), "step": 21})
        assert _steps_in(disk) == [10, 20, 30, 40]

def _steps_in(directory: str) -> list[int]:
    """Steps with a committed manifest in a local tier directory."""
    out = []
    for path in glob.glob(os.path.join(directory, "step-*")):
        if os.path.isfile(os.path.join(path, "manifest.json")):
            out.append(int(os.path.basename(path)[len("step-"):]))
    return sorted(out)


def _flip_middle(step_dir: str) -> None:
    """Flip a byte in the middle of the step's largest data file (inside a tensor's bytes)."""
    files = glob.glob(os.path.join(step_dir, "data-*.bin"))
    assert files, f"no data file in {step_dir}"
    path = max(files, key=os.path.getsize)
    middle = os.path.getsize(path) // 2
    with open(os.path.join(step_dir, "manifest.json"), "rb") as f:
        body = json.loads(f.read().split(b"\n", 1)[1])
    name = os.path.basename(path)
    assert any(t["file"] == name and t["offset"] <= middle < t["offset"] + t["nbytes"]
               for t in body["tensors"]), "the middle of the file is not inside a tensor"
    with open(path, "r+b") as f:
        f.seek(middle)
        byte = f.read(1)[0]
        f.seek(middle)
        f.write(bytes([byte ^ 0x5A]))


def _status_json(*locations: str) -> list[dict[str, Any]]:
    """`ckptio status --json` in a fresh process (the environment's CKPTIO_SHM_DIR)."""
    proc = subprocess.run([sys.executable, "-m", "ckptio", "status", *locations, "--json"],
                          check=False, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["schema"] == "ckptio.status/1"
    return out["tiers"]


def _run_child(script: str, tmp_path: Any, *args: str) -> subprocess.Popen[str]:
    path = tmp_path / "child.py"
    path.write_text(script)
    return subprocess.Popen([sys.executable, str(path), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(60)


# ------------------------------------------------------------------ round trips


def test_shm_tier_alone_round_trip(shm):
    model, opt = _build()
    mgr = _tiered(Tier("shm://solo", keep_last=2))
    assert type(mgr) is ckptio.CheckpointManager
    assert mgr.latest() is None and mgr.steps() == []
    saved = _train_and_save(mgr, range(1, 5), model, opt)
    mgr.close()
    where = os.path.join(shm, "solo")
    assert mgr.directory == where and mgr.path(4) == os.path.join(where, "step-4")
    assert _steps_in(where) == [3, 4] and mgr.steps() == [3, 4]

    fresh, fopt, state = _fresh()
    assert not torch.equal(fresh[0].weight, saved[4]["model"]["0.weight"])
    with _tiered(Tier("shm://solo", keep_last=2)) as again:  # a new manager: the files outlive it
        assert again.restore(state) == 4
        assert again.last_restore["tier"] == 0 and again.last_restore["location"] == "shm://solo"
    _assert_restored(fresh, fopt, state, saved[4])


@pytest.mark.parametrize("every", [2, 3])
def test_shm_and_disk_round_trip_then_memory_lost_restores_from_disk(shm, tmp_path, every):
    disk = str(tmp_path / "disk")
    tiers = [Tier("shm://run", keep_last=2), Tier(disk, every=every, keep_last=2)]
    model, opt = _build()
    mgr = _tiered(*tiers)
    saved = _train_and_save(mgr, range(1, 8), model, opt, drain_each=True)
    mgr.close()
    due = [s for s in range(1, 8) if s % every == 0]
    assert _steps_in(os.path.join(shm, "run")) == [6, 7]
    assert _steps_in(disk) == due[-2:]
    assert mgr.path(6, 1) == os.path.join(disk, "step-6")

    fresh, fopt, state = _fresh()
    with _tiered(*tiers) as again:
        assert again.steps() == sorted({6, 7, *due[-2:]})
        assert again.restore(state) == 7
        assert again.last_restore["tier"] == 0
    _assert_restored(fresh, fopt, state, saved[7])

    shutil.rmtree(shm)  # host memory lost (a reboot)
    fresh, fopt, state = _fresh()
    with _tiered(*tiers) as again:
        assert again.latest() == due[-1] == 6
        assert again.restore(state) == 6
        assert again.last_restore["tier"] == 1 and again.last_restore["location"] == disk
    _assert_restored(fresh, fopt, state, saved[6])


def test_mem_first_tier_in_process(tmp_path):
    mem = f"mem://tiers-{uuid.uuid4().hex}"
    disk = str(tmp_path / "disk")
    tiers = [Tier(mem, keep_last=2), Tier(disk, every=2, keep_last=None)]
    model, opt = _build()
    with _tiered(*tiers) as mgr:
        saved = _train_and_save(mgr, range(1, 6), model, opt, drain_each=True)
        assert _steps_in(disk) == [2, 4]
        assert mgr.steps() == [2, 4, 5]
        assert mgr.path(5).startswith("mem://")
        fresh, fopt, state = _fresh()
        assert mgr.restore(state) == 5 and mgr.last_restore["tier"] == 0
        _assert_restored(fresh, fopt, state, saved[5])
        fresh, fopt, state = _fresh()
        assert mgr.restore(state, step=2) == 2 and mgr.last_restore["tier"] == 1
        _assert_restored(fresh, fopt, state, saved[2])
    # the disk copy is an ordinary checkpoint
    ckptio.verify(os.path.join(disk, "step-4"))
    fresh, fopt, state = _fresh()
    ckptio.load(os.path.join(disk, "step-4"), state)
    _assert_restored(fresh, fopt, state, saved[4])


@pytest.mark.parametrize("mode", ["asynchronous", "lazy"])
def test_async_and_lazy_saves_through_the_tiers(shm, tmp_path, mode):
    """Saves returning before they are durable: each step reaches the drain once committed
    (at the next save, wait() or close()); what was saved is what the state was at save()."""
    disk = str(tmp_path / "disk")
    tiers = [Tier("shm://run", keep_last=2), Tier(disk, every=2, keep_last=None)]
    model, opt = _build()
    mgr = _tiered(*tiers)
    kwargs = {"lazy": True, "optimizers": [opt]} if mode == "lazy" else {"asynchronous": True}
    saved = _train_and_save(mgr, range(1, 7), model, opt, **kwargs)
    _train(model, opt, 2)  # training goes on after the last save returned
    mgr.wait()
    assert mgr.drained(timeout=60)
    skipped = mgr.status()[1]["skipped"]
    mgr.close()
    # the newest due step always lands; an older one may be skipped when the drain is behind
    # (it depends on timing), and then it is reported, never silently missing
    on_disk = _steps_in(disk)
    assert on_disk[-1] == 6 and sorted(on_disk + skipped) == [2, 4, 6]
    assert _steps_in(os.path.join(shm, "run"))[-2:] == [5, 6]
    fresh, fopt, state = _fresh()
    with _tiered(*tiers) as again:
        assert again.restore(state) == 6 and again.last_restore["tier"] == 0
        assert again.verify() > 0
    _assert_restored(fresh, fopt, state, saved[6])
    shutil.rmtree(shm)
    for step in [s for s in (6, 4) if s in on_disk]:
        fresh, fopt, state = _fresh()
        with _tiered(*tiers) as again:
            assert again.restore(state, step=step) == step and again.last_restore["tier"] == 1
        _assert_restored(fresh, fopt, state, saved[step])


def test_first_tier_interval_and_later_tiers_multiples(shm, tmp_path):
    disk = tmp_path / "disk"  # a PathLike location
    tiers = [Tier("shm://run", every=2, keep_last=None), Tier(disk, every=4, keep_last=None)]
    assert tiers[1].location == str(disk)
    model, opt = _build()
    with _tiered(*tiers) as mgr:
        state = {"model": model, "optim": opt, "step": 0}
        results = {}
        for step in range(1, 10):
            _train(model, opt)
            state["step"] = step
            results[step] = mgr.save(step, state)
            assert mgr.should_save(step) == (step % 2 == 0)
        assert all((results[s] is None) == (s % 2 == 1) for s in results)
        assert mgr.save(9, state, force=True) is not None  # force: saved anyway, not drained
        assert mgr.drained(timeout=60)
        assert mgr.steps() == [2, 4, 6, 8, 9]
    assert _steps_in(os.path.join(shm, "run")) == [2, 4, 6, 8, 9]
    assert _steps_in(str(disk)) == [4, 8]


# ------------------------------------------------------------------ damage


def _saved_in_two_tiers(shm: str, disk: str) -> tuple[list[Tier], dict[int, dict[str, Any]]]:
    tiers = [Tier("shm://run", keep_last=2), Tier(disk, every=2, keep_last=2)]
    model, opt = _build()
    with _tiered(*tiers) as mgr:
        saved = _train_and_save(mgr, range(1, 5), model, opt, drain_each=True)
    assert _steps_in(os.path.join(shm, "run")) == [3, 4] and _steps_in(disk) == [2, 4]
    return tiers, saved


def test_damaged_memory_copy_restores_the_same_step_from_disk(shm, tmp_path):
    disk = str(tmp_path / "disk")
    tiers, saved = _saved_in_two_tiers(shm, disk)
    _flip_middle(os.path.join(shm, "run", "step-4"))
    fresh, fopt, state = _fresh()
    with _tiered(*tiers) as mgr:
        with pytest.warns(UserWarning) as record:
            assert mgr.restore(state) == 4
        assert mgr.last_restore["tier"] == 1
    _assert_restored(fresh, fopt, state, saved[4])
    (message,) = [str(w.message) for w in record]
    assert f"restored step 4 from {disk}" in message
    assert "step 4 in shm://run" in message and "CorruptCheckpointError" in message


def test_damaged_in_every_tier_falls_back_to_an_older_step(shm, tmp_path):
    disk = str(tmp_path / "disk")
    tiers, saved = _saved_in_two_tiers(shm, disk)
    _flip_middle(os.path.join(shm, "run", "step-4"))
    _flip_middle(os.path.join(disk, "step-4"))
    fresh, fopt, state = _fresh()
    with _tiered(*tiers) as mgr:
        with pytest.warns(UserWarning) as record:
            assert mgr.restore(state) == 3
        assert mgr.last_restore["tier"] == 0
    _assert_restored(fresh, fopt, state, saved[3])
    (message,) = [str(w.message) for w in record]
    assert "step 4 in shm://run" in message and f"step 4 in {disk}" in message
    # damaged everywhere, every step: CorruptCheckpointError, not a silent start from 0
    for step_dir in (os.path.join(shm, "run", "step-3"), os.path.join(disk, "step-2")):
        _flip_middle(step_dir)
    with _tiered(*tiers) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CorruptCheckpointError, match="could be restored"):
            mgr.restore(_fresh()[2])


def test_nothing_anywhere_restores_none(shm, tmp_path):
    """As CheckpointManager.restore: None when no tier ever committed a step (with a warning
    naming incomplete ones); a step asked for by number, or verify(), still raise."""
    disk = str(tmp_path / "disk")
    tiers = [Tier("shm://run"), Tier(disk, every=2)]
    with _tiered(*tiers) as mgr, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.latest() is None and mgr.steps() == []
        assert mgr.restore(_fresh()[2]) is None
        with pytest.raises(CheckpointNotFoundError, match="step 7 is committed nowhere"):
            mgr.restore(_fresh()[2], step=7)
        with pytest.raises(CheckpointNotFoundError):
            mgr.verify()
    os.makedirs(os.path.join(shm, "run", "step-5"))  # an interrupted save: nothing committed
    with _tiered(*tiers) as mgr:
        assert mgr.incomplete() == [5]
        with pytest.warns(UserWarning, match=r"nothing to restore .*incomplete steps \[5\]"):
            assert mgr.restore(_fresh()[2]) is None
    os.makedirs(disk, exist_ok=True)
    torch.save({"w": torch.zeros(2)}, os.path.join(disk, "model.pt"))  # something else there
    with _tiered(*tiers) as mgr:
        with pytest.raises(CheckpointNotFoundError, match="committed nowhere|no committed step"):
            mgr.restore(_fresh()[2])


def test_issue_30_options_with_tiers(shm, tmp_path):
    """Metrics and metadata travel with their step (they are in its manifest) and are read from
    the fastest tier; preemption=True works through the first tier (a real SIGTERM to this
    process); keep_best / save_interval_s / mode / save_every, refused with tiers before issue
    44, apply to the first tier (at work: tests/test_one_manager.py); save_every and a first
    tier's own every that disagree are refused, naming both."""
    disk = str(tmp_path / "disk")
    for kwargs in (dict(keep_best=2, monitor="loss"), dict(save_interval_s=60.0),
                   dict(mode="max"), dict(save_every=2)):
        with _tiered(Tier("shm://run"), **kwargs) as mgr:
            assert isinstance(mgr, ckptio.CheckpointManager)
    with _tiered(Tier("shm://run"), Tier(disk, every=4), save_every=2) as mgr:
        assert mgr.save_every == 2 and mgr.tiers[0].every == 2
        assert [mgr.should_save(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    with pytest.raises(CkptError, match=r"save_every=2, tiers=.*every=3.*give one of them"):
        _tiered(Tier("shm://run", every=3), save_every=2)
    model, opt = _build()
    previous = signal.getsignal(signal.SIGTERM)
    with _tiered(Tier("shm://run", every=2), Tier(disk, every=2), preemption=True) as mgr:
        assert signal.getsignal(signal.SIGTERM) is not previous  # ours, until close()
        _train_and_save(mgr, range(1, 3), model, opt,
                        metrics={"loss": 0.5}, metadata={"config": {"lr": 0.01}})
        assert mgr.drained(timeout=60) and _steps_in(disk) == [2]
        shutil.rmtree(os.path.join(shm, "run", "step-2"))  # only the disk tier holds step 2
        assert mgr.metadata(2)["metadata"] == {"config": {"lr": 0.01}}
        assert ckptio.read_metadata(os.path.join(disk, "step-2"))["metrics"] == {"loss": 0.5}
        assert not mgr.should_save(3) and not mgr.reached_preemption(3)
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.should_save(5) and mgr.reached_preemption(5)  # not due by every=2: preempted
        mgr.save(5, {"model": model, "optim": opt, "step": 5})
    assert signal.getsignal(signal.SIGTERM) == previous
    with _tiered(Tier("shm://run"), Tier(disk, every=2)) as mgr:
        assert mgr.latest() == 5


def test_damaged_memory_copy_is_never_drained(shm, tmp_path):
    """A step damaged in memory before its drain: the copy checks every entry as it passes and
    commits nothing, removing what it wrote, and the error is raised by drained()."""
    disk = str(tmp_path / "disk")
    model, opt = _build()
    with _tiered(Tier("shm://run", keep_last=2)) as mgr:  # no disk tier yet
        _train_and_save(mgr, range(1, 5), model, opt)
    _flip_middle(os.path.join(shm, "run", "step-4"))
    mgr = _tiered(Tier("shm://run", keep_last=2), Tier(disk, every=2))  # resumes: step 4 due
    with pytest.raises(CorruptCheckpointError):
        mgr.drained(timeout=60)
    # nothing committed, no data file kept, and no empty step-4 left to list as incomplete
    assert not os.path.exists(os.path.join(disk, "step-4")), os.listdir(disk)
    assert _steps_in(disk) == []
    assert "CorruptCheckpointError" in mgr.status()[1]["error"]
    mgr.close()  # raised once already


def test_three_tiers_each_slower_one_fed_and_restored_from(shm, tmp_path):
    near, far = str(tmp_path / "near"), str(tmp_path / "far")
    tiers = [Tier("shm://run", keep_last=2), Tier(near, every=2, keep_last=None),
             Tier(far, every=4, keep_last=None)]
    model, opt = _build()
    with _tiered(*tiers) as mgr:
        saved = _train_and_save(mgr, range(1, 9), model, opt, drain_each=True)
        status = mgr.status()
    assert [t["committed"] for t in status] == [[7, 8], [2, 4, 6, 8], [4, 8]]
    assert [c["step"] for c in status[2]["copied"]] == [4, 8] and status[2]["skipped"] == []
    shutil.rmtree(shm)  # memory lost, and the near copy of step 8 damaged: the far one is used
    _flip_middle(os.path.join(near, "step-8"))
    fresh, fopt, state = _fresh()
    with _tiered(*tiers) as mgr:
        with pytest.warns(UserWarning, match=f"step 8 in {near}"):
            assert mgr.restore(state) == 8
        assert mgr.last_restore["tier"] == 2
    _assert_restored(fresh, fopt, state, saved[8])


# ------------------------------------------------------------------ kills

DRAIN_CHILD = r"""
import sys, time, torch, ckptio
disk, snaps = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # ~12.6 MB with its state
mgr = ckptio.CheckpointManager(
    tiers=[ckptio.Tier("shm://run", keep_last=2), ckptio.Tier(disk, every=2, keep_last=2)],
    options=ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20), drain_rate=2e6)
for step in (1, 2, 3):
    model(torch.randn(4, 512)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    mgr.save(step, {"model": model, "optim": opt, "step": step})
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step},
               f"{snaps}/step-{step}.pt")
print("saved", step, flush=True)
time.sleep(600)  # the drain of step 2 (about 6 s at 2 MB/s) is still running: killed here
"""


def test_kill_during_a_drain_loses_no_step_and_the_drain_resumes(shm, tmp_path):
    disk = str(tmp_path / "disk")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    proc = _run_child(DRAIN_CHILD, tmp_path, disk, str(snaps))
    try:
        line = proc.stdout.readline()
        assert line.strip() == "saved 3", f"child failed: {line!r} {proc.stderr.read()}"
        step2 = os.path.join(disk, "step-2")
        deadline = time.monotonic() + 60
        while not os.path.isdir(step2):  # the drain's copy of step 2 has started
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        assert not os.path.exists(os.path.join(step2, "manifest.json")), (
            "the drain finished before the kill: slow it down")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        _stop(proc)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(step2, "manifest.json"))

    tier0, tier1 = _status_json("shm://run", disk)
    assert tier0["committed"] == [2, 3] and tier0["copying"] == []
    assert tier1["committed"] == [] and tier1["copying"] == [{"step": 2, "from_tier": 0}]

    wants = {s: torch.load(snaps / f"step-{s}.pt") for s in (2, 3)}
    tiers = [Tier("shm://run", keep_last=2), Tier(disk, every=2, keep_last=2)]
    fresh = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 512))
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = {"model": fresh, "optim": fopt, "step": -1}
    with _tiered(*tiers) as mgr:  # the drain resumes on start: step 2 to the disk
        assert mgr.restore(state) == 3  # 0 steps lost: the child's last commit
        assert mgr.last_restore["tier"] == 0
        _assert_restored(fresh, fopt, state, wants[3])
        assert mgr.drained(timeout=120)
        assert _steps_in(disk) == [2]
        assert mgr.status()[1]["copied"][-1]["step"] == 2
    assert ckptio.verify(step2) > 0
    state = {"model": fresh, "optim": fopt, "step": -1}
    ckptio.load(step2, state)
    _assert_restored(fresh, fopt, state, wants[2])
    tier0, tier1 = _status_json("shm://run", disk)
    assert tier1["committed"] == [2] and tier1["copying"] == [] and tier1["incomplete"] == []


SAVE_CHILD = r"""
import os, signal, sys, time, torch, ckptio
from ckptio.testing.faults import inject
disk, snaps, phase = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # ~3 MB with its state: several buffers
# "write" kills at a backend write, which a mapped save into tmpfs never makes (it copies into
# the file's pages): that phase saves through the pool (tests/test_mapped_save.py kills mapped)
ck = ckptio.Checkpointer(ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20,
                                        use_profile=False,
                                        memory_mapped="off" if phase == "write" else "auto"))
mgr = ckptio.CheckpointManager(
    tiers=[ckptio.Tier("shm://run", keep_last=2), ckptio.Tier(disk, every=2)], checkpointer=ck)

def train():
    model(torch.randn(4, 256)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

train()
mgr.save(1, {"model": model, "optim": opt, "step": 1})
torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1},
           f"{snaps}/step-1.pt")

def die(*_args):
    open(f"{snaps}/killed", "w").write(phase)
    os.kill(os.getpid(), signal.SIGKILL)

if phase == "write":  # the 2nd buffer written into step 2's data file
    inject(ck, fail_write=2, match="step-2", error=lambda *a: die())
else:  # the commit: the manifest written, killed before its rename into place
    rename = os.rename
    def renaming(src, dst, *args, **kwargs):
        if str(dst).endswith(os.path.join("step-2", "manifest.json")):
            die()
        return rename(src, dst, *args, **kwargs)
    os.rename = renaming
train()
print("saving 2", flush=True)
mgr.save(2, {"model": model, "optim": opt, "step": 2})
print("saved 2", flush=True)
"""


@pytest.mark.parametrize("phase", ["write", "commit"])
def test_kill_during_a_save_into_memory_restores_the_previous_step(shm, tmp_path, phase):
    disk = str(tmp_path / "disk")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    proc = _run_child(SAVE_CHILD, tmp_path, disk, str(snaps), phase)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        _stop(proc)
    assert proc.returncode == -signal.SIGKILL, err
    assert (snaps / "killed").read_text() == phase
    assert "saving 2" in out and "saved 2" not in out
    step2 = os.path.join(shm, "run", "step-2")
    assert os.path.isdir(step2) and not os.path.exists(os.path.join(step2, "manifest.json"))
    if phase == "write":
        assert glob.glob(os.path.join(step2, "data-*.bin")), "killed before any data was written"
    else:
        assert glob.glob(os.path.join(step2, ".manifest-*.tmp")), "killed before the manifest"

    want = torch.load(snaps / "step-1.pt")
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256))
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = {"model": fresh, "optim": fopt, "step": -1}
    tiers = [Tier("shm://run", keep_last=2), Tier(disk, every=2)]
    with _tiered(*tiers) as mgr:
        assert mgr.steps() == [1] and mgr.incomplete() == [2]
        with pytest.warns(UserWarning, match=r"incomplete"):
            assert mgr.restore(state) == 1
        assert mgr.last_restore["tier"] == 0
        _assert_restored(fresh, fopt, state, want)
        mgr.save(2, state)  # the killed step is saved over
        assert mgr.drained(timeout=60)
        assert mgr.steps() == [1, 2] and mgr.incomplete() == []
    assert _steps_in(disk) == [2]


# ------------------------------------------------------------------ retention, drain, budget


def test_retention_per_tier(shm, tmp_path):
    disk = str(tmp_path / "disk")
    model, opt = _build()
    mgr = _tiered(Tier("shm://run", keep_last=2), Tier(disk, every=2, keep_last=2, keep_every=4))
    _train_and_save(mgr, range(1, 11), model, opt, drain_each=True)
    mgr.close()
    assert _steps_in(os.path.join(shm, "run")) == [9, 10]
    assert _steps_in(disk) == [4, 8, 10]
    assert sorted(os.listdir(disk)) == ["step-10", "step-4", "step-8"]  # nothing hidden left
    assert sorted(os.listdir(os.path.join(shm, "run"))) == ["step-10", "step-9"]
    status = mgr.status()
    assert [t["committed"] for t in status] == [[9, 10], [4, 8, 10]]
    assert [c["step"] for c in status[1]["copied"]] == [2, 4, 6, 8, 10]
    assert status[1]["skipped"] == [] and status[1]["error"] is None
    with _tiered(Tier("shm://run", keep_last=2), Tier(disk, every=2)) as again:
        assert again.steps() == [4, 8, 9, 10]
        again.restore(_fresh()[2])
        assert again.last_restore == {**again.last_restore, "step": 10, "tier": 0}


def test_retention_keeps_the_steps_the_drain_still_copies(shm, tmp_path):
    """Quick saves into memory while a slow drain copies: tier 0 never drops a step that is
    queued or being copied, so every due step that is not skipped lands on disk."""
    disk = str(tmp_path / "disk")
    model, opt = _build(width=1024)  # ~0.9 MB per step: 0.45 s a copy at 2 MB/s
    mgr = _tiered(Tier("shm://run", keep_last=1), Tier(disk, every=2, keep_last=None),
                  drain_rate=2e6)
    _train_and_save(mgr, range(1, 5), model, opt)
    pinned = set(mgr._drain.pinned())
    assert pinned and pinned <= set(_steps_in(os.path.join(shm, "run")))
    mgr.close()
    copied = [c["step"] for c in mgr.status()[1]["copied"]]
    assert _steps_in(disk) == copied and copied[-1] == 4


def test_a_drain_that_falls_behind_skips_to_the_newest_step(shm, tmp_path, caplog):
    disk = str(tmp_path / "disk")
    model, opt = _build(width=1024)  # ~0.5 MB a step: 1 s a copy at 0.5 MB/s
    mgr = _tiered(Tier("shm://run", keep_last=2), Tier(disk, every=1, keep_last=2),
                  drain_rate=5e5)
    with caplog.at_level(logging.INFO, logger="ckptio"):
        saved = _train_and_save(mgr, range(1, 7), model, opt)  # a few ms each
        status = mgr.status()[1]
        assert status["draining"] in (1, 2, 3, 4, 5) and status["queued"] == 6
        assert mgr.drained(timeout=60)
    status = mgr.status()[1]
    skipped, copied = status["skipped"], [c["step"] for c in status["copied"]]
    # step 1's copy was still running while 2..6 were saved: the queue kept only the newest
    assert skipped and skipped == sorted(skipped) and status["queued"] is None
    assert sorted(skipped + copied) == [1, 2, 3, 4, 5, 6] and copied[0] == 1 and copied[-1] == 6
    warned = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "skipped" in r.getMessage()]
    assert len(warned) == len(skipped)
    for step, line in zip(skipped, warned):
        assert f"the drain to tier 1 is behind: step {step} skipped" in line
    assert _steps_in(disk) == copied[-2:]  # the newest due step is on disk
    mgr.close()
    shutil.rmtree(shm)
    fresh, fopt, state = _fresh(width=1024)
    with _tiered(Tier("shm://run"), Tier(disk)) as again:
        assert again.restore(state) == 6 and again.last_restore["tier"] == 1
    _assert_restored(fresh, fopt, state, saved[6])


def test_memory_budget_refuses_a_save_before_writing(shm, caplog):
    model, opt = _build(width=512)
    state = {"model": model, "optim": opt, "step": 0}
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values()) * 3
    with _tiered(Tier("shm://tight", keep_last=2, max_bytes=int(nbytes * 1.5))) as mgr:
        with caplog.at_level(logging.WARNING, logger="ckptio"):
            saved = _train_and_save(mgr, range(1, 2), model, opt)
        # said at the first save: the budget holds fewer steps than keep_last + 1
        assert "holds fewer than keep_last=2 steps" in caplog.text, caplog.text
        _train(model, opt)
        state["step"] = 2
        with pytest.raises(CkptError, match="max_bytes") as caught:
            mgr.save(2, state)
        assert "keep_last" in str(caught.value)
        assert "0.00 GiB" not in str(caught.value)  # a small step's size is said in MiB
        assert f"max_bytes={int(nbytes * 1.5) / (1 << 20):.1f} MiB" in str(caught.value)
        assert sorted(os.listdir(os.path.join(shm, "tight"))) == [LEASE_NAME, "step-1"]  # nothing of step 2
        assert mgr.steps() == [1]
        fresh, fopt, restored = _fresh(width=512)
        assert mgr.restore(restored) == 1
        _assert_restored(fresh, fopt, restored, saved[1])
    # a first save already beyond the budget (its size estimated from the state): nothing at all
    with _tiered(Tier("shm://tiny", max_bytes=nbytes // 2)) as mgr:
        with pytest.raises(CkptError, match="max_bytes"):
            mgr.save(1, state)
        assert not os.path.exists(os.path.join(shm, "tiny", "step-1"))
        assert mgr.steps() == []


def _tier_nbytes(directory: str) -> int:
    """Bytes of every file under ``directory``: its steps, its lease and its slots, but not a
    dropped step's files still being removed (a background removal's, gone moments later)."""
    total = 0
    for d, _, names in os.walk(directory):
        if ".deleting-" in os.path.relpath(d, directory):
            continue
        for name in names:
            try:
                total += os.path.getsize(os.path.join(d, name))
            except FileNotFoundError:  # renamed meanwhile (a manifest committed, a slot taken)
                continue
    return total


@pytest.mark.parametrize("lazy", [False, True])
def test_async_saves_in_a_budget_of_keep_last_plus_one_steps_go_on(shm, caplog, lazy):
    """max_bytes for keep_last=1 step plus the one being saved (and a margin): asynchronous
    and lazy saves go on step after step, and from the third on the tier's files (the slots
    its saves reuse included) stay within max_bytes. The old code checked the room before the
    retention of the save in flight, so the third save was refused, counting a step about to
    be dropped (a new user's trial), and the slots made ahead were not bounded by it."""
    model, opt = _build(width=512)
    state = {"model": model, "optim": opt, "step": 0}
    nbytes = sum(v.numel() * v.element_size() for v in model.state_dict().values()) * 3
    budget = int(nbytes * 2.6)
    tier = os.path.join(shm, "budget")
    kwargs: dict[str, Any] = {"lazy": True, "optimizers": [opt]} if lazy else {
        "asynchronous": True}
    with caplog.at_level(logging.WARNING, logger="ckptio"), \
            _tiered(Tier("shm://budget", keep_last=1, max_bytes=budget)) as mgr:
        mgr.restore(state)
        for step in range(1, 7):
            _train(model, opt)
            state["step"] = step
            mgr.save(step, state, **kwargs)
            if step >= 3:
                assert _tier_nbytes(tier) <= budget, (step, _tier_nbytes(tier), budget)
        mgr.wait()
        assert mgr.steps() == [6]
    assert "holds fewer than keep_last" not in caplog.text


# ------------------------------------------------------------------ validation


def test_validation_errors(shm, tmp_path):
    disk = str(tmp_path / "disk")
    with pytest.raises(CkptError, match="use a multiple of 2"):
        ckptio.CheckpointManager(tiers=[Tier("shm://a", every=2), Tier(disk, every=3)])
    with pytest.raises(CkptError, match="same place"):
        ckptio.CheckpointManager(tiers=[Tier(disk), Tier(f"file://{disk}", every=2)])
    with pytest.raises(CkptError, match="same place"):
        ckptio.CheckpointManager(tiers=[Tier("shm://a"), Tier(os.path.join(shm, "a"))])
    with pytest.raises(CkptError, match="per ckptio.Tier"):
        ckptio.CheckpointManager(tiers=[Tier("shm://a"), Tier(disk)], keep_last=3)
    with pytest.raises(CkptError, match="not both"):
        ckptio.CheckpointManager(disk, tiers=[Tier("shm://a")])
    with pytest.raises(CkptError, match="give the directory of the steps, or tiers="):
        ckptio.CheckpointManager()
    with pytest.raises(CkptError, match="list of ckptio.Tier"):
        ckptio.CheckpointManager(tiers=[])
    with pytest.raises(CkptError, match="is not a ckptio.Tier"):
        ckptio.CheckpointManager(tiers=["shm://a"])
    with pytest.raises(CkptError, match="drain_rate"):
        ckptio.CheckpointManager(tiers=[Tier("shm://a")], drain_rate=0)
    for bad in ({"every": 0}, {"keep_last": 0}, {"max_bytes": -1}, {"every": True}):
        with pytest.raises(CkptError, match="must be an integer >= 1"):
            Tier("shm://a", **bad)
    for location in ("shm://../x", "shm://", "shm://a/../../x", "shm:///"):
        with pytest.raises(UnsupportedPathError, match="shm://NAME"):
            checkpoint_path(location)
        with pytest.raises(UnsupportedPathError):
            ckptio.CheckpointManager(tiers=[Tier(location)])
    assert checkpoint_path("shm://run/step-3") == os.path.join(shm, "run", "step-3")
    assert not os.path.exists(shm)  # nothing made by refused managers


# ------------------------------------------------------------------ drain errors


def test_a_drain_error_is_raised_once_and_saves_keep_working(shm, tmp_path, caplog):
    parent = tmp_path / "parent"
    disk = str(parent / "disk")
    model, opt = _build()
    mgr = _tiered(Tier("shm://run", keep_last=2), Tier(disk, every=2))
    parent.write_text("a regular file, not a directory")  # tier 1 unwritable from now on
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        _train_and_save(mgr, range(1, 3), model, opt)  # step 2 fails to drain
        with pytest.raises(CkptError) as caught:
            mgr.drained(timeout=60)
    assert isinstance(caught.value, ckptio.StorageIOError)
    assert os.path.join(disk, "step-2") in str(caught.value)
    assert [r.getMessage() for r in caplog.records if "drain of step" in r.getMessage()] == [
        f"ckptio: the drain of step 2 to tier 1 failed: StorageIOError: {caught.value}"]
    assert mgr.drained(timeout=60) is True  # raised once
    assert mgr.drained(timeout=60) is True
    # (mgr.status() lists every tier, and tier 1 cannot be listed now: the drain's own view)
    assert "step 2: StorageIOError" in mgr._drain.status()[1]["error"]
    # tier 0 keeps working; the next failure (step 4) is a new error, raised once by close()
    saved = _train_and_save(mgr, range(3, 6), model, opt)
    assert _steps_in(os.path.join(shm, "run")) == [4, 5]
    with pytest.raises(ckptio.StorageIOError, match="step-4"):
        mgr.close()
    fresh, fopt, state = _fresh()
    with _tiered(Tier("shm://run", keep_last=2)) as again:
        assert again.restore(state) == 5 and again.last_restore["tier"] == 0
    _assert_restored(fresh, fopt, state, saved[5])


def test_close_raises_the_drain_error(shm, tmp_path):
    parent = tmp_path / "parent"
    mgr = _tiered(Tier("shm://run"), Tier(str(parent / "disk"), every=1))
    parent.write_text("x")
    model, opt = _build()
    _train_and_save(mgr, range(1, 3), model, opt)
    with pytest.raises(ckptio.StorageIOError):
        mgr.close()
    assert _steps_in(os.path.join(shm, "run")) == [1, 2]


# ------------------------------------------------------------------ the status command


def test_status_command_lists_committed_and_copying_steps(shm, tmp_path, capsys):
    disk = str(tmp_path / "disk")
    model, opt = _build()
    with _tiered(Tier("shm://run", keep_last=2), Tier(disk, every=2)) as mgr:
        _train_and_save(mgr, range(1, 6), model, opt)
    # a copy of step 5 cut short: its files, no manifest (as a killed drain leaves it)
    os.makedirs(os.path.join(disk, "step-5"))
    for name in glob.glob(os.path.join(shm, "run", "step-5", "data-*")):
        shutil.copy(name, os.path.join(disk, "step-5"))
    os.makedirs(os.path.join(disk, "step-7"))  # an interrupted save nobody else holds

    proc = subprocess.run([sys.executable, "-m", "ckptio", "status", "shm://run", disk],
                          check=False, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("tier 0  shm://run") and "committed 4 5" in lines[0]
    assert lines[1].startswith(f"tier 1  {disk}") and "committed 2 4" in lines[1]
    assert "copying 5 (committed in tier 0)" in lines[1] and "incomplete 7" in lines[1]

    from ckptio.cli import main

    assert main(["status", "shm://run", disk, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == "ckptio.status/1"
    assert out["tiers"] == [
        {"tier": 0, "location": "shm://run", "committed": [4, 5], "copying": [],
         "incomplete": [], "bases": {}},  # bases (issue 28): full steps only here
        {"tier": 1, "location": disk, "committed": [2, 4], "bases": {},
         "copying": [{"step": 5, "from_tier": 0}], "incomplete": [7]}]
    assert main(["status", "shm://../x"]) == 2
    assert "shm://NAME" in capsys.readouterr().err
    # a mistyped directory is not an empty run: said, with the name it may mean, exit 2
    assert main(["status", disk + "k"]) == 2
    said = capsys.readouterr().out
    assert "no such directory" in said and "did you mean disk?" in said, said
    assert not os.path.exists(disk + "k")
    # a tier that cannot be read (nothing answers at the endpoint): its row says why, the
    # others are listed, exit status 2
    env = {**os.environ, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y"}
    proc = subprocess.run([sys.executable, "-m", "ckptio", "status", "shm://run",
                           "s3://bucket/run"], check=False, capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stdout.splitlines()
    assert "committed 4 5" in lines[0] and "unreadable" in lines[1]
    # without boto3 (the s3 extra; a machine with the base install) the row names the package
    why = "127.0.0.1:9" if importlib.util.find_spec("boto3") else "pip install boto3"
    assert why in lines[1], lines[1]


# ------------------------------------------------------------------ many ranks

ROWS, COLS = 48, 16


def _rank_state(rank: int, world: int, step: int, blank: bool = False) -> dict[str, Any]:
    """Row blocks of one tensor (TensorShard), a replicated tensor, a per-rank value."""
    g = torch.Generator().manual_seed(7)
    full = torch.randn(ROWS, COLS, generator=g) + step
    rows = ROWS // world
    piece = full[rank * rows:(rank + 1) * rows].clone()
    shard = ckptio.TensorShard(torch.zeros_like(piece) if blank else piece, (ROWS, COLS),
                               (rank * rows, 0))
    bias = torch.zeros(COLS) if blank else torch.arange(COLS, dtype=torch.float32) * step
    mine = torch.zeros(4) if blank else torch.full((4,), float(rank * 100 + step))
    return {"model": {"w": shard, "b": bias}, "mine": mine, "step": -1 if blank else step}


def ranks_tiers(rank: int, world: int, shm_root: str, disk: str) -> dict[str, Any]:
    os.environ["CKPTIO_SHM_DIR"] = shm_root  # the forkserver's environment is not the test's
    tiers = [Tier("shm://ranks", keep_last=2), Tier(disk, every=2, keep_last=2)]
    mgr = ckptio.CheckpointManager(tiers=tiers, options=OPTS)
    for step in range(1, 6):
        mgr.save(step, _rank_state(rank, world, step))
    mgr.close()
    again = ckptio.CheckpointManager(tiers=tiers, options=OPTS)
    state = _rank_state(rank, world, 0, blank=True)
    restored = again.restore(state)
    want = _rank_state(rank, world, restored)
    same = (torch.equal(state["model"]["w"].local, want["model"]["w"].local)
            and torch.equal(state["model"]["b"], want["model"]["b"])
            and torch.equal(state["mine"], want["mine"]) and state["step"] == restored)
    steps = again.steps()
    again.close()
    return {"restored": restored, "tier": again.last_restore["tier"], "same": same,
            "steps": steps}


def test_two_ranks_save_and_restore_then_reshard_from_disk(shm, tmp_path):
    disk = str(tmp_path / "disk")
    out = run_ranks(2, ranks_tiers, shm, disk, timeout_s=180)
    for rank, got in enumerate(out):
        assert got == {"restored": 5, "tier": 0, "same": True, "steps": [2, 4, 5]}, (rank, got)
    assert _steps_in(os.path.join(shm, "ranks")) == [4, 5] and _steps_in(disk) == [2, 4]
    with open(os.path.join(disk, "step-4", "manifest.json"), "rb") as f:
        manifest = json.loads(f.read().split(b"\n", 1)[1])
    assert manifest["world_size"] == 2

    shutil.rmtree(shm)  # memory lost: one process restores from the disk, resharded
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(7)) + 4
    state = {"model": {"w": torch.zeros(ROWS, COLS), "b": torch.zeros(COLS)},
             "mine": torch.zeros(4), "step": -1}
    with _tiered(Tier("shm://ranks", keep_last=2), Tier(disk, every=2)) as mgr:
        assert mgr.restore(state, per_rank_from=1) == 4
        assert mgr.last_restore["tier"] == 1
    assert torch.equal(state["model"]["w"], full)
    assert torch.equal(state["model"]["b"], torch.arange(COLS, dtype=torch.float32) * 4)
    assert torch.equal(state["mine"], torch.full((4,), 104.0)) and state["step"] == 4


_DRAIN_KILLED = """
import sys, torch, ckptio
fast, slow = sys.argv[1], sys.argv[2]
mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier(fast, keep_last=2), ckptio.Tier(slow, keep_last=2)],
                               drain_rate=1 << 20)
state = {"w": torch.ones(1 << 20)}
mgr.save(1, state)
mgr.save(2, state)
print("saved", flush=True)
sys.stdin.read()
"""


def test_a_drain_copy_cut_short_by_a_kill_does_not_stay_behind(tmp_path) -> None:
    """A job killed while its drain copies step 1 (step 2 queued behind it), restarted: the next
    start copies step 2 (the newest due), and the interrupted copy of step 1, which no copy
    completes and retention never removed (incomplete), is removed at that start (this manager
    holds the slower tier's run lease), not left in the slower tier forever (one full-size
    orphan per kill)."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with subprocess.Popen([sys.executable, "-c", _DRAIN_KILLED, fast, slow],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "saved"
            deadline = time.monotonic() + 30
            while not glob.glob(os.path.join(slow, "step-1", "data-*")):  # the copy has begun
                assert time.monotonic() < deadline, "the drain never started"
                time.sleep(0.05)
        finally:
            child.kill()
    with ckptio.CheckpointManager(tiers=[Tier(fast, keep_last=2), Tier(slow, keep_last=2)]) as mgr:
        assert mgr.restore({"w": torch.zeros(1 << 20)}) == 2
        mgr.save(3, {"w": torch.ones(1 << 20)})
        mgr.save(4, {"w": torch.ones(1 << 20)})
    left = sorted(os.listdir(slow))
    assert "step-1" not in left, left


def test_a_restore_while_the_resumed_drain_runs_retention_fails_no_copy(tmp_path, monkeypatch):
    """A manager made over a slower tier lacking the newest due step resumes the drain at once;
    its restore() then starts the tier's background thread (the slots made ahead) while the
    drain thread's retention of that tier joins it. The thread was published before it was
    started: the retention joined a thread not started yet, so the copy failed with a
    RuntimeError (not a CkptError) raised by drained() and close()."""
    fast, slow = str(tmp_path / "fast"), str(tmp_path / "slow")
    with ckptio.CheckpointManager(fast, keep_last=2) as first:
        for step in range(1, 5):
            first.save(step, {"w": torch.full((4096,), float(step))})
    real_start = threading.Thread.start
    slots_threads = []

    def start_late(thread: threading.Thread) -> None:  # the training thread preempted there
        if thread.name == "ckptio-slots":
            slots_threads.append(thread)
        if len(slots_threads) == 2 and thread is slots_threads[1]:  # the slower tier's
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(slow, "step-4", "manifest.json")):
                assert time.monotonic() < deadline, "the drain never copied step 4"
                time.sleep(0.01)
            time.sleep(0.3)  # the drain's retention of the slower tier runs meanwhile
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_late)
    mgr = ckptio.CheckpointManager(tiers=[Tier(fast, keep_last=2), Tier(slow, every=2)],
                                   drain_rate=32 << 10)  # the copy of step 4 takes ~0.5 s
    state = {"w": torch.zeros(4096)}
    assert mgr.restore(state) == 4
    assert mgr.drained(timeout=60)
    mgr.close()
    assert _steps_in(slow) == [4]
