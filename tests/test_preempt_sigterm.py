"""A real SIGTERM to a training process with a memory tier and a disk tier (issue 45,
"preemption inside the grace period"): the step the loop is in when the signal lands is
committed in memory (shm://, $CKPTIO_SHM_DIR under /dev/shm) and on disk before the process
exits 0, both copies verify, and a fresh process restores it bitwise (model, AdamW, RNG) from
either tier.

The training child is a fresh process that builds its model and optimizer and runs real AdamW
steps in the loop docs/MANAGER.md shows (save asynchronously at every step into memory,
``if mgr.reached_preemption(step): break``, close()). It stops in the middle of one step until
the test has sent SIGTERM, so the step at the signal is known exactly. Two disk tiers:
``every=1000``, so the step at the signal is not due there by its number (only the preemption
drain puts it there), and ``every=2`` with ``drain_rate=1`` byte/s, so a paced copy of an
earlier step is running when the signal lands (only a rate lifted for the copy already running
lets the process end).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio.testing.cli_process import run_script
from tests.conftest import assert_same

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STOP_AT = 5  # the step the SIGTERM lands in (odd: not due on the every=2 disk tier)

COMMON = r"""
import json, random, sys, torch, ckptio
from ckptio import Tier

disk, every, rate = sys.argv[1], int(sys.argv[2]), sys.argv[3]
OPTS = ckptio.Options(buffer_bytes=1 << 20, pool_bytes=4 << 20)


def build(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def snapshot(model, opt, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
"""

TRAIN = COMMON + r"""
ref, stop_at = sys.argv[4], int(sys.argv[5])
model, opt = build(0)
mgr = ckptio.CheckpointManager(
    tiers=[Tier("shm://run", keep_last=2), Tier(disk, every=every, keep_last=2)],
    preemption=True, drain_rate=None if rate == "none" else float(rate), options=OPTS)
state = {"model": model, "optim": opt, "rng": ckptio.RNGState(), "step": 0}
start = mgr.restore(state) or 0
for step in range(start + 1, 1_000_000):
    loss = model(torch.randn(32, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == stop_at:
        print("in step", step, flush=True)
        sys.stdin.readline()  # SIGTERM lands here, in the middle of this step
    state["step"] = step
    mgr.save(step, state, asynchronous=True)
    if mgr.reached_preemption(step):
        break
mgr.close()  # the save in flight committed, the step drained to disk
torch.save(snapshot(model, opt, step), ref)  # the RNG untouched since the save
print("preempted at", step, flush=True)
"""

RESTORE = COMMON + r"""
out, which = sys.argv[4], sys.argv[5]
model, opt = build(12345)  # other weights, AdamW without state
if which == "memory":
    mgr = ckptio.CheckpointManager(
        tiers=[Tier("shm://run", keep_last=2), Tier(disk, every=every, keep_last=2)],
        options=OPTS)
else:  # the disk tier alone, as a job on another host reads it
    mgr = ckptio.CheckpointManager(disk, keep_last=2, options=OPTS)
state = {"model": model, "optim": opt, "rng": ckptio.RNGState(), "step": -1}
step = mgr.restore(state)
tier = (mgr.last_restore or {}).get("tier", 0)
mgr.close()
torch.save({**snapshot(model, opt, state["step"]), "restored": step, "tier": tier}, out)
"""


def _env() -> dict[str, str]:
    path = [REPO, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def _script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)



def _train_until_sigterm(tmp_path: Path, disk: str, every: int, rate: str) -> tuple[int, str]:
    """Run the training child, SIGTERM it in the middle of step STOP_AT -> (its exit code,
    its output)."""
    cmd = [sys.executable, _script(tmp_path, "train.py", TRAIN), disk, str(every), rate,
           str(tmp_path / "ref.pt"), str(STOP_AT)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"in step {STOP_AT}", line + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        try:
            out, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail("the preempted child did not exit within 180 s: its final drain never "
                        "finished (paced at drain_rate, or never waited for)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    return proc.returncode, line + out + err


def _restore(tmp_path: Path, disk: str, every: int, which: str) -> dict[str, Any]:
    out = tmp_path / f"restored-{which}.pt"
    # a fresh process forked from the warm forkserver (torch and ckptio imported there), as
    # `python restore.py ...` runs, without an interpreter's start and imports
    done = run_script(_script(tmp_path, "restore.py", RESTORE), disk, str(every), "none",
                      str(out), which, cwd=REPO, env=_env(), timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("every,rate", [(1000, "none"), (2, "1")],
                         ids=["not-due-on-disk", "paced-copy-running"])
def test_sigterm_makes_the_step_durable_in_memory_and_on_disk(shm, tmp_path, every, rate):
    """SIGTERM in the middle of step 5: the loop saves step 5 and breaks; close() returns once
    step 5 is committed in memory and on disk; the child exits 0; both copies verify; fresh
    processes restore step 5 bitwise from memory and, with memory gone, from disk."""
    disk = str(tmp_path / "disk")
    code, output = _train_until_sigterm(tmp_path, disk, every, rate)
    assert code == 0, output
    assert f"preempted at {STOP_AT}" in output, output
    memory_copy = os.path.join(shm, "run", f"step-{STOP_AT}")
    disk_copy = os.path.join(disk, f"step-{STOP_AT}")
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2)]) as memory:
        assert STOP_AT in memory.steps(), f"step {STOP_AT} not committed in memory"
    with ckptio.CheckpointManager(disk, keep_last=2) as on_disk:
        assert on_disk.latest() == STOP_AT, (
            f"step {STOP_AT} not committed on disk (it holds {on_disk.steps()}): the "
            "preempted step was not drained before the process exited")
        assert on_disk.incomplete() == []
    assert ckptio.verify(memory_copy) > 0 and ckptio.verify(disk_copy) > 0
    want = torch.load(tmp_path / "ref.pt", weights_only=False)
    for which, tier in (("memory", 0), ("disk", 0)):
        if which == "disk":
            os.rename(os.path.join(shm, "run"), os.path.join(shm, "gone"))  # memory lost
        got = _restore(tmp_path, disk, every, which)
        assert got.pop("restored") == STOP_AT and got.pop("tier") == tier, which
        assert_same(got, want, which)
