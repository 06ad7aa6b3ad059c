"""A rank killed (SIGKILL) at each phase of a save and of a load: every other rank raises
RankFailedError naming it within 2x Options.rank_timeout_s, and a failed save commits nothing
(the previous checkpoint still loads). Real processes over gloo and the job's TCPStore."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptio
from ckptio.testing import killed as cases
from ckptio.testing.ranks import run_ranks

WORLD = 3
DEADLINE_S = 3.0


def _check_survivors(outcomes: list, victim: int, mark: Path) -> None:
    killed_at = float(mark.read_text())
    for rank, outcome in enumerate(outcomes):
        if rank == victim:
            assert outcome is None  # it died
            continue
        kind, when, message, ranks = outcome
        assert kind == "RankFailedError", (rank, kind, message)
        assert f"rank {victim}" in message and ranks == (victim,), (rank, message)
        assert when - killed_at < 2 * DEADLINE_S, (rank, when - killed_at, message)


@pytest.mark.parametrize("phase,victim", [
    ("save:plan", 1), ("save:agree", 2), ("save:write", 1), ("save:conclude", 2),
    ("save:write", 0),
])
def test_a_rank_killed_during_a_save_fails_every_rank_and_commits_nothing(tmp_path, phase, victim):
    path, mark = str(tmp_path / "ck"), tmp_path / "killed"
    outcomes = run_ranks(WORLD, cases.save_killed, path, phase, victim, str(mark), DEADLINE_S,
                         may_die=(victim,))
    _check_survivors(outcomes, victim, mark)
    loaded = ckptio.load(path)  # the first save, whole and unchanged
    assert loaded["step"] == 1
    assert torch.equal(loaded["model"]["w"], cases.state(0, 1)["model"]["w"])


@pytest.mark.parametrize("phase,victim", [("load:keys", 1), ("load:read", 2), ("load:end", 1),
                                          ("load:read", 0)])
def test_a_rank_killed_during_a_load_fails_every_rank(tmp_path, phase, victim):
    path, mark = str(tmp_path / "ck"), tmp_path / "killed"
    run_ranks(WORLD, cases.save_for_load, path)
    outcomes = run_ranks(WORLD, cases.load_killed, path, phase, victim, str(mark), DEADLINE_S,
                         may_die=(victim,))
    _check_survivors(outcomes, victim, mark)
