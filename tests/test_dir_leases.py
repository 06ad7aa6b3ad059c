"""A plugin's run leases (ckptio/dir_leases.py) when a job saves each step into a folder of its
own (the Hugging Face Trainer's checkpoint-N as DeepSpeed's save_dir): only the folders saved
into last stay leased, a removed folder's lease is let go, and a folder let go is checked again
at its next save."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckptio.dir_leases import MOST_HELD, DirectoryLeases
from ckptio.errors import CheckpointLockedError
from ckptio.storage.local.runlease import LEASE_NAME
from test_rt_plugins_tiers import HOLDER  # a process holding a lease until its stdin ends


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _leases() -> DirectoryLeases:
    return DirectoryLeases("this job", "pass take_over=True")


def test_a_folder_per_save_holds_only_the_newest_folders_leases(tmp_path: Path) -> None:
    leases = _leases()
    folders = [tmp_path / f"checkpoint-{n}" for n in range(3 * MOST_HELD)]
    before = _open_fds()
    try:
        for n, folder in enumerate(folders):
            leases.take(str(folder), f"step {n}")
        held = [f.name for f in folders if (f / LEASE_NAME).exists()]
        assert held == [f.name for f in folders[-MOST_HELD:]]
        assert _open_fds() - before <= MOST_HELD  # one descriptor per lease held, no more
    finally:
        leases.release()
    assert _open_fds() <= before


def test_a_removed_folders_lease_is_let_go_at_the_next_save(tmp_path: Path) -> None:
    leases = _leases()
    first, second = tmp_path / "checkpoint-1", tmp_path / "checkpoint-2"
    try:
        leases.take(str(first), "step 1")
        with_one = _open_fds()
        shutil.rmtree(first)  # the Trainer's rotation
        leases.take(str(second), "step 2")
        assert _open_fds() == with_one  # the removed folder's descriptor closed
    finally:
        leases.release()


def test_a_folder_let_go_is_checked_again_at_its_next_save(tmp_path: Path) -> None:
    leases = _leases()
    first = tmp_path / "checkpoint-0"
    try:
        leases.take(str(first), "step 0")
        for n in range(1, MOST_HELD + 1):
            leases.take(str(tmp_path / f"checkpoint-{n}"), f"step {n}")
        assert not (first / LEASE_NAME).exists()  # let go
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        other = subprocess.Popen([sys.executable, "-c", HOLDER, str(first)], env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout is not None and other.stdout.readline().strip() == "held"
            with pytest.raises(CheckpointLockedError, match="did not save step 0 again"):
                leases.take(str(first), "step 0 again")
        finally:
            other.communicate("", timeout=30)
    finally:
        leases.release()
