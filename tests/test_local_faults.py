"""Local storage faults from the kernel (issue 63, items 3 and 4): a FUSE file system under the
checkpoint directory (ckptio.testing.faultfs) fails or stalls write, fsync, fsyncdir, rename and
read; what a user sees through the public API, the CLI and the checkpoints left behind.

Skipped only where /dev/fuse is unusable (the reason says so); .ci/run installs libfuse.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.testing.faultfs import FaultFS, fuse_unusable

pytestmark = pytest.mark.skipif(fuse_unusable() is not None, reason=str(fuse_unusable()))


@pytest.fixture
def fs(tmp_path: Path):
    """A fault file system: ``fs.mountpoint`` shows ``tmp_path/backing``."""
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as mounted:
        yield mounted


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
    assert "1 committed" in listing and "\n  2 " not in listing, listing
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
