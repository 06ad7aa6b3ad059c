"""The TorchTitan options ckptio's manager names in its errors, as a TorchTitan user types them:

* two jobs started on one ``--checkpoint.folder``: the second is refused on every rank
  (CheckpointLockedError naming the first job) before it touches the folder, naming
  TorchTitan's ``--checkpoint.take_over``, not ckptio's ``CheckpointManager(...,
  take_over=True)`` (which a TorchTitan job cannot pass); with it the second job saves there;
* a finished run (its last step model-only) started again: its first save, below that step, is
  refused naming the options that train on from those weights;
* every ``--checkpoint.*`` option an error names parses on TorchTitan's command line
  (ConfigManager, tyro: a bool is a flag, ``--checkpoint.x`` / ``--checkpoint.no_x``; the
  ``--checkpoint.initial_load_model_only false`` named before was refused by it).
Skipped where torchtitan is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer.base")

from ckptio.errors import CheckpointLockedError, CkptError  # noqa: E402
from ckptio.testing.rank_processes import run_ranks  # noqa: E402
from ckptio.torchtitan_manager import CkptioCheckpointManager  # noqa: E402
from test_torchtitan import Job, titan_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_FIRST_JOB = """
import sys, time, torch
from pathlib import Path
import ckptio
folder, flag = sys.argv[1], Path(sys.argv[2])
mgr = ckptio.CheckpointManager(folder)
mgr.save(2, {"w": torch.ones(3)}, force=True)
print("SAVED", flush=True)
deadline = time.monotonic() + 120
while not flag.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _build(base: str, **config: Any) -> CkptioCheckpointManager:
    """The checkpointer TorchTitan's Trainer builds (tests/test_torchtitan.py's Job)."""
    built: CkptioCheckpointManager = Job(base, **config).checkpointer
    return built


def _parsed(typed: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Options as an error names them (``typed``: a piece of its message), parsed by
    TorchTitan's ConfigManager for a job whose checkpoint is ckptio's -> its config."""
    return titan_config(tmp_path, monkeypatch, typed.split())


def _second_job(rank: int, world: int, base: str) -> tuple[str, str]:
    """One rank of a job built on the folder the first job holds -> (error type, message)."""
    try:
        _build(base)
    except CkptError as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def _first_job(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """A job holding ``tmp_path/checkpoint`` (it saved a step) until the flag it returns."""
    flag = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    first = subprocess.Popen([sys.executable, "-c", _FIRST_JOB, str(tmp_path / "checkpoint"),
                              str(flag)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "checkpoint" / "step-2" / "manifest.json").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.poll()
        time.sleep(0.05)
    return first, flag


def test_a_second_job_is_refused_naming_torchtitans_take_over_option(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, flag = _first_job(tmp_path)
    try:
        with pytest.raises(CheckpointLockedError) as refused:
            _build(str(tmp_path))
        said = str(refused.value)
        assert f"pid {first.pid}" in said and "--checkpoint.take_over" in said, said
        assert "CheckpointManager(..., take_over=True)" not in said, said
        typed = re.search(r"pass (--checkpoint\.\S+)", said)
        assert typed, said
        assert _parsed(typed[1], tmp_path, monkeypatch).checkpoint.take_over is True
        for rank, (kind, said) in enumerate(run_ranks(2, _second_job, str(tmp_path))):
            assert kind in ("CheckpointLockedError", "RankFailedError"), (rank, kind, said)
            assert "--checkpoint.take_over" in said, (rank, said)
            assert "CheckpointManager(..., take_over=True)" not in said, (rank, said)
        taker = _build(str(tmp_path), take_over=True)  # the option the refusal names
        assert taker.save(4) is True
        taker.close()
    finally:
        flag.touch()
        first.communicate(timeout=60)
    assert sorted(os.listdir(tmp_path / "checkpoint" / "step-4")) != []


def test_a_folder_of_dcp_steps_names_options_torchtitan_parses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder holding only DCP steps (TorchTitan's own manager's): load() refuses, naming the
    options that load the newest into a new folder; as typed, TorchTitan's command line takes
    them and they load the whole state (not the model alone)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "checkpoint" / "step-2"))
    job = _build(str(tmp_path))
    with pytest.raises(CkptError, match="another manager") as refused:
        job.load()
    job.close()
    typed = re.search(r"--checkpoint\.initial_load_path \S+ --checkpoint\.\S+", str(refused.value))
    assert typed, refused.value
    config = _parsed(typed[0], tmp_path, monkeypatch).checkpoint
    assert config.initial_load_path == str(tmp_path / "checkpoint" / "step-2"), config
    assert config.initial_load_model_only is False, config


def test_a_finished_runs_model_only_last_step_refuses_saves_below_it_naming_options(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished run (last step saved model-only, TorchTitan's default) started again on its
    folder loads the weights and trains from step 0: its first save, below that last step, was
    refused in ckptio's terms (a rollback, restore(state, step=N)). Now the refusal says why
    and names the options, which TorchTitan's command line takes; nothing is written."""
    run = _build(str(tmp_path), last_save_model_only=True)
    assert run.save(2) and run.save(4, last_step=True)
    run.close()
    again = _build(str(tmp_path), last_save_model_only=True)
    assert again.load() is True
    with pytest.raises(CkptError, match="finished run saved model-only") as refused:
        again.save(2)
    again.close()
    said = str(refused.value)
    typed = re.search(r"--checkpoint\.initial_load_path \S+;", said)
    assert typed and "--checkpoint.no_last_save_model_only" in said, said
    config = _parsed(f"{typed[0][:-1]} --checkpoint.no_last_save_model_only", tmp_path,
                     monkeypatch).checkpoint
    assert config.initial_load_path == str(tmp_path / "checkpoint" / "step-4"), config
    assert config.last_save_model_only is False, config
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2", "step-4"]


def test_a_fresh_start_in_a_mistyped_folder_names_no_call_a_torchtitan_job_cannot_make(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A job whose --checkpoint.folder is mistyped ("checkpont" beside a "checkpoint" holding
    step 2) starts fresh: the log line says so and the warning names the folder meant and its
    step, neither naming ``restore(state, required=True)`` (before: both did), which no
    TorchTitan option passes."""
    import warnings

    first = _build(str(tmp_path))
    assert first.save(2) is True
    first.close()
    job = _build(str(tmp_path), folder="checkpont")
    with warnings.catch_warnings(record=True) as said, caplog.at_level("WARNING", "ckptio"):
        warnings.simplefilter("always")
        assert job.load() is False  # a fresh start
    job.close()
    texts = [str(w.message) for w in said if "starts fresh" in str(w.message)]
    assert len(texts) == 1, [str(w.message) for w in said]
    assert f"did you mean {tmp_path / 'checkpoint'}?" in texts[0], texts[0]
    assert "the newest: step 2" in texts[0], texts[0]
    logged = [r.getMessage() for r in caplog.records if "starting fresh" in r.getMessage()]
    assert len(logged) == 1, caplog.records
    for text in texts + logged:
        assert "required=True" not in text, text
