"""A new user's plain training loop checkpointed through the guides' CheckpointManager
(README, docs/guides/async.md, tiers.md, resume.md, docs/MANAGER.md): what they met."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import ckptio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL_TMPFS_CHILD = r"""
import os, sys, torch, ckptio
shm = sys.argv[1]
state = {"w": torch.randn(256 * 1024)}                 # a 1 MiB step: three do not fit
mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=1)])
mgr.restore(state)
mgr.prepare(state, wait=True)                          # as docs/guides/tiers.md says
slots = os.path.join(shm, "run", ".ckptio-slots")
short = [n for n in os.listdir(slots)
         if os.stat(os.path.join(slots, n)).st_blocks * 512 < os.path.getsize(os.path.join(slots, n))]
print(short)
for step in range(1, 5):
    state["w"].add_(1)
    mgr.save(step, state, asynchronous=True)
    mgr.wait()
mgr.close()
print(mgr.steps())
"""


def _in_small_tmpfs(tmp_path, size: str, child: str) -> subprocess.CompletedProcess[str]:
    mount = tmp_path / "shm"
    mount.mkdir()
    probe = ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("needs unshare(1) and a user namespace to mount a small tmpfs")
    script = (f"mount -t tmpfs -o size={size} tmpfs {mount} && "
              f"{sys.executable} -c \"$CHILD\" {mount}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": ROOT, "CHILD": child,
                               "CKPTIO_SHM_DIR": str(mount)})


def test_prepare_on_a_tmpfs_too_small_for_its_slots_leaves_none_half_made(tmp_path) -> None:
    """prepare() makes files ahead for a memory tier's first saves; on a tmpfs with room for
    two of them (and for keep_last=1's steps), the third's allocation fails: no slot is left
    with pages missing (a save taking it failed with "No space left on device"), and every
    save commits."""
    done = _in_small_tmpfs(tmp_path, "2600k", FULL_TMPFS_CHILD)
    assert done.returncode == 0, done.stderr
    short, steps = done.stdout.splitlines()
    assert short == "[]", done.stdout
    assert steps == "[4]", done.stdout


SECOND_JOB_CHILD = r"""
import sys, torch, ckptio
mgr = ckptio.CheckpointManager(sys.argv[1], save_every=1)   # the run directory is not there yet
print("made", flush=True)
sys.stdin.readline()                                         # meanwhile another job saved there
try:
    mgr.save(1, {"w": torch.zeros(4)})
except ckptio.CheckpointLockedError as exc:
    print(exc, flush=True)
"""

HOLDER_CHILD = r"""
import sys, torch, ckptio
mgr = ckptio.CheckpointManager(sys.argv[1], save_every=1)
mgr.save(1, {"w": torch.ones(4)})
print("held", flush=True)
sys.stdin.readline()
mgr.close()
"""


def test_the_same_script_twice_at_once_the_second_is_told_its_save_not_its_making(
        tmp_path) -> None:
    """Two runs of one script started together on a new directory: both managers are made
    (nothing there yet); the second's first save is refused, saying that save was not made
    (not that the manager was not made), and its exit says nothing of an unclosed manager
    (it never saved); the first job's step is intact."""
    run = str(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": ROOT}
    late = subprocess.Popen([sys.executable, "-c", SECOND_JOB_CHILD, run], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert late.stdout.readline() == "made\n", late.stderr.read()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER_CHILD, run], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == "held\n"
        out, err = late.communicate("go\n", timeout=60)
    finally:
        holder.communicate("\n", timeout=60)
        late.kill()
    assert "is in use by another job" in out, (out, err)
    assert "the first save of this CheckpointManager was not made" in out, out
    assert "take_over=True" in out and ".ckptio-run.lease" in out, out
    assert "was not closed before exit" not in err, err
    assert holder.returncode == 0 and sorted(os.listdir(run)) == ["step-1"]


READ_ONLY_CHILD = r"""
import sys, torch, ckptio
state = {"w": torch.zeros(4)}
mgr = ckptio.CheckpointManager(sys.argv[1], save_every=1)
print(mgr.restore(state), flush=True)
try:
    mgr.save(3, state, asynchronous=True)
    mgr.close()
except ckptio.CkptError as exc:
    print(type(exc).__name__, exc, flush=True)
"""


def test_a_read_only_run_directory_restores_and_its_save_says_why_and_the_fix(
        tmp_path) -> None:
    """The run directory mounted read-only (a bind mount): restore loads its newest step, the
    save raises a CkptError naming the step's directory, the read-only filesystem and the fix;
    the committed steps are intact."""
    run = tmp_path / "run"
    for step in (1, 2):
        ckptio.save({"w": torch.full((4,), float(step))}, str(run / f"step-{step}"))
    probe = ["unshare", "-rm", "true"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("needs unshare(1) and a user namespace for a read-only bind mount")
    script = (f"mount --bind {run} {run} && mount -o remount,bind,ro {run} && "
              f"{sys.executable} -c \"$CHILD\" {run}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, "CHILD": READ_ONLY_CHILD})
    assert done.returncode == 0, done.stderr
    restored, said = done.stdout.splitlines()
    assert restored == "2", done.stdout
    assert said.startswith("StorageIOError") and str(run / "step-3") in said, said
    assert "read-only" in said and "save elsewhere" in said, said
    assert sorted(os.listdir(run)) == ["step-1", "step-2"]


def test_a_mistyped_memory_tier_is_offered_the_one_spelled_alike_as_shm(
        tmp_path, monkeypatch) -> None:
    """A run restarted with its memory tier's name mistyped: the warning offers the memory
    tier spelled alike that holds steps as the user writes it (shm://NAME), not the
    directory under $CKPTIO_SHM_DIR."""
    monkeypatch.setenv("CKPTIO_SHM_DIR", str(tmp_path / "shm"))
    state = {"w": torch.zeros(4)}
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-run")]) as mgr:
        mgr.save(1, state)
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-rnu")]) as mgr:
        with pytest.warns(UserWarning, match="did you mean") as said:
            assert mgr.restore(state) is None
    message = str(said[0].message)
    assert "did you mean shm://gpt-run? It holds committed steps (the newest: step 1)" in \
        message, message
    assert str(tmp_path) not in message, message


def test_a_run_directory_below_a_file_names_the_file_in_the_way(tmp_path,
                                                                monkeypatch) -> None:
    """A disk tier's path whose parent is a file (a typo, a file named like the run): the
    error names that file, not the run directory as "exists and is not a directory"."""
    monkeypatch.setenv("CKPTIO_SHM_DIR", str(tmp_path / "shm"))
    (tmp_path / "ckpt").write_text("notes")
    run = str(tmp_path / "ckpt" / "run")
    with pytest.raises(ckptio.CkptError) as raised:
        ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run"), ckptio.Tier(run, every=10)])
    said = str(raised.value)
    assert f"{tmp_path / 'ckpt'} is a file, not a directory" in said, said
    assert "exists and is not a directory" not in said, said
    assert (tmp_path / "ckpt").read_text() == "notes"


def test_a_plain_dataloader_in_the_state_is_refused_with_what_resumes_one(tmp_path) -> None:
    """docs/guides/resume.md puts the data loader in the state; a plain torch DataLoader has
    no state_dict(): the save is refused naming the key and a loader that has one (not
    allow_pickle=True, which would pickle its dataset and resume nothing); nothing is
    committed, and the manager's next save of a right state goes ahead."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)))
    with ckptio.CheckpointManager(str(tmp_path / "run"), save_every=1) as mgr:
        with pytest.raises(ckptio.UnsupportedStateError) as raised:
            mgr.save(1, {"w": torch.zeros(2), "loader": loader})
        said = str(raised.value)
        assert "'loader'" in said and "StatefulDataLoader" in said, said
        assert "allow_pickle" not in said, said
        assert mgr.steps() == []
        mgr.save(1, {"w": torch.zeros(2)})
        assert mgr.steps() == [1]


def test_a_changed_models_warnings_through_restore_name_the_users_line(tmp_path) -> None:
    """restore(state, strict=False) after a parameter's shape changed: every warning it gives
    (the keys left as built, the shape that differs) names the user's line, not a ckptio
    module (a fixed stacklevel, right for ckptio.load, named managing/level.py)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with ckptio.CheckpointManager(str(tmp_path / "run"), save_every=1) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
    grown = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    state = {"model": grown, "optim": torch.optim.AdamW(grown.parameters())}
    with ckptio.CheckpointManager(str(tmp_path / "run"), save_every=1) as mgr:
        with pytest.warns(UserWarning) as said:
            assert mgr.restore(state, strict=False) == 1
    assert any("shape" in str(w.message) for w in said), [str(w.message) for w in said]
    assert [w.filename for w in said] == [__file__] * len(said), [w.filename for w in said]
