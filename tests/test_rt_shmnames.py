"""A memory tier declared as ``shm://NAME`` (docs/guides/tiers.md) is named so in the messages
a user meets, not as the directory under $CKPTIO_SHM_DIR it is kept in."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ckptio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SECOND_JOB = r"""
import logging, torch, ckptio
logging.basicConfig(level=logging.WARNING, format="%(message)s")
try:
    ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-run")])
except ckptio.CkptError as exc:
    print("REFUSED", exc, flush=True)
ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-run")], take_over=True).close()
"""


@pytest.fixture
def shm(tmp_path, monkeypatch) -> str:
    """$CKPTIO_SHM_DIR in a temp dir (never under /dev)."""
    root = str(tmp_path / "shm")
    monkeypatch.setenv("CKPTIO_SHM_DIR", root)
    return root


def test_a_second_job_on_a_memory_tier_is_refused_naming_shm(shm) -> None:
    """A second job started on the memory tier a running job holds: the refusal and the
    take-over warning name shm://gpt-run, not the directory under $CKPTIO_SHM_DIR."""
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-run")]) as mgr:
        mgr.save(1, {"w": torch.zeros(4)})
        env = {**os.environ, "PYTHONPATH": ROOT}
        done = subprocess.run([sys.executable, "-c", SECOND_JOB], capture_output=True,
                              text=True, env=env, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert "REFUSED the run directory shm://gpt-run is in use by another job" in said, said
    assert "the lease file is shm://gpt-run/.ckptio-run.lease" in said, said
    assert "taking over the run directory shm://gpt-run from" in said, said
    assert shm not in said, said


def test_a_restore_past_an_incomplete_step_names_the_memory_tier_as_shm(shm) -> None:
    """A restore that passes over an interrupted step of a memory tier: its warning names the
    tier it restored from as shm://gpt-run."""
    state = {"w": torch.arange(4.0)}
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-run")]) as mgr:
        mgr.save(13, state)
        mgr.save(14, state)
    os.remove(os.path.join(shm, "gpt-run", "step-14", "manifest.json"))
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-run")]) as mgr:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert mgr.restore(state) == 13
    message = " ".join(str(w.message) for w in said)
    assert "restored step 13 from shm://gpt-run, not a newer one: step 14" in message, message
    assert shm not in message, message


def test_an_unclosed_manager_of_a_memory_tier_is_named_as_shm(shm, caplog) -> None:
    """A manager that saved and was not closed: the exit's warning names it
    CheckpointManager(shm://gpt-run); once closed, a save names it so too."""
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-run")])
    mgr.save(1, {"w": torch.zeros(4)})
    mgr.wait()
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        mgr.at_exit()  # what the interpreter's exit runs (managing/unclosed.py)
    mgr.close()
    assert "CheckpointManager(shm://gpt-run) was not closed before exit" in caplog.text, \
        caplog.text
    assert shm not in caplog.text, caplog.text
    with pytest.raises(ckptio.CkptError) as raised:
        mgr.save(2, {"w": torch.zeros(4)})
    assert "CheckpointManager(shm://gpt-run) was closed" in str(raised.value), raised.value


def test_loading_a_missing_or_incomplete_step_of_a_memory_tier_names_it_as_shm(shm) -> None:
    """ckptio.load of a memory tier's step that was interrupted, or that is not there: the
    error names shm://gpt-run/step-N as the user wrote it, not the directory."""
    state = {"w": torch.arange(4.0)}
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://gpt-run")]) as mgr:
        mgr.save(13, state)
        mgr.save(14, state)
    os.remove(os.path.join(shm, "gpt-run", "step-14", "manifest.json"))
    with pytest.raises(ckptio.CkptError) as raised:
        ckptio.load("shm://gpt-run/step-14", state)
    said = str(raised.value)
    assert said.startswith("shm://gpt-run/step-14 holds no committed manifest"), said
    assert shm not in said, said
    with pytest.raises(ckptio.CkptError) as raised:
        ckptio.load("shm://gpt-run/step-99", state)
    said = str(raised.value)
    assert "no checkpoint at shm://gpt-run/step-99: the path does not exist" in said, said
    assert shm not in said, said
