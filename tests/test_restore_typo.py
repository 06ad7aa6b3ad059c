"""A mistyped run directory: restore() starts fresh, with a warning naming the run meant (issue 63.9).

``CheckpointManager("rnu").restore(state)`` beside a run ``run`` that holds committed steps
returns None (the quick start restores into a new directory this way, so it stays a warning,
not an error) and warns, through ``warnings`` (a UserWarning a filter can silence or escalate),
naming ``run`` and its newest step, as ``ckptio.load`` and the CLI say "did you mean run?". No
warning where nothing spelled alike holds a committed step: no neighbour, an empty one, or
another run of a numbered series (``run2`` beside ``run1``). ``required=True`` names it in its
error. Run in a fresh process, as a training script starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

import ckptio

CHILD = r'''
import json, sys, warnings
import torch
import ckptio

out = {}
for name in sys.argv[1:]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        step = ckptio.CheckpointManager(name).restore({"model": torch.nn.Linear(2, 2)})
    out[name] = {"step": step, "warnings": [[w.category.__name__, str(w.message)] for w in said]}
try:
    ckptio.CheckpointManager("rnu").restore({"model": torch.nn.Linear(2, 2)}, required=True)
except ckptio.CheckpointNotFoundError as exc:
    out["required"] = str(exc)
print(json.dumps(out))
'''


def _save_run(path: Path, steps: list[int]) -> None:
    manager = ckptio.CheckpointManager(path)
    for step in steps:
        manager.save(step, {"model": torch.nn.Linear(2, 2)})
    manager.close()


def _restores(cwd: Path, *names: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", CHILD, *names], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_mistyped_run_directory_warns_naming_the_run_and_its_newest_step(tmp_path: Path) -> None:
    _save_run(tmp_path / "run", [10, 20, 30])
    _save_run(tmp_path / "exp1", [5])
    (tmp_path / "other").mkdir()  # spelled alike, nothing committed: not named
    (tmp_path / "othre").mkdir()
    got = _restores(tmp_path, "rnu", str(tmp_path / "rnu"), "xyz", "exp2", "othre")
    for name, shown in (("rnu", "run"), (str(tmp_path / "rnu"), str(tmp_path / "run"))):
        row = got[name]
        assert row["step"] is None, row  # starts fresh
        assert len(row["warnings"]) == 1, row
        category, text = row["warnings"][0]
        assert category == "UserWarning"
        assert f"nothing to restore in {name}" in text, text
        assert f"did you mean {shown}? It holds committed steps (the newest: step 30)" in text, text
    for name in ("xyz", "exp2", "othre"):  # no neighbour; a numbered series; nothing committed
        assert got[name] == {"step": None, "warnings": []}, (name, got[name])
    assert "did you mean run? It holds committed steps (the newest: step 30)" in got["required"]
    assert not (tmp_path / "rnu").exists()  # restoring created nothing


def test_names_merely_alike_are_not_offered_as_a_typo(tmp_path: Path) -> None:
    """Two temporary directories (tempfile.mkdtemp's tmpXXXXXXXX) were "spelled alike" often
    enough that the getting-started example warned "did you mean /tmp/tmp...?" of another
    run's directory (a new user's trial). A typo is now a letter or two off (one in a name of
    at most 5 characters)."""
    from ckptio.storage.missing_manifest import spelled_alike

    assert spelled_alike("tmp0p5po_rn", ["tmpab12cd34", "tmp9x5po_qk", "tmpq0p5p_rn"]) == [
        "tmpq0p5p_rn"]  # two letters off: offered; the others are other names
    assert spelled_alike("chekpoints", ["checkpoints", "checkpoint"]) == [
        "checkpoints", "checkpoint"]
    assert spelled_alike("rnu", ["run", "rna", "urn"]) == ["run", "rna"]
    assert spelled_alike("run", ["ran1", "rxx"]) == []
    _save_run(tmp_path / "tmpab12cd34", [3])
    got = _restores(tmp_path, "tmp0p5po_rn")
    assert got["tmp0p5po_rn"] == {"step": None, "warnings": []}, got
