"""A restarting job's in-place load on many ranks plans once and agrees once before it reads:
each DTensor's region is worked out once per load (its region wants and its fill plan share
it), and the key step rides on the read-plan step (one collective fewer), while a rank whose
plan fails still fails the load on every rank, named. Real gloo ranks; bodies in
restart_plan_cases.py."""

from __future__ import annotations

import pytest
import restart_plan_cases as cases
from ckptio.testing.rank_processes import run_ranks

WORLD = 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("restart") / "ck")
    assert all(run_ranks(WORLD, cases.save, path))
    return path


@pytest.fixture(scope="module")
def counted(saved: str) -> list[dict]:
    """A fresh job's load, counted on every rank."""
    got = run_ranks(WORLD, cases.load_counted, saved)
    assert all(g["equal"] for g in got), got
    return got


def test_each_dtensor_region_is_worked_out_once_per_load(counted):
    """Before: twice per DTensor (the regular chunks' wants, then the fill plan)."""
    got = counted
    assert all(g["regions"] == 2 * cases.N for g in got), got  # N matrices + N vectors


def test_a_load_on_many_ranks_takes_three_collective_steps(counted):
    """The key step rides on the read-plan step: the read plan, all read, the outcome (before:
    four, the key step its own collective before the plan)."""
    got = counted
    assert all(g["steps"] == 3 for g in got), got


def test_a_rank_whose_plan_fails_fails_the_load_on_every_rank_named(saved):
    got = run_ranks(WORLD, cases.load_mismatched_on, saved, 2)
    assert all(g is not None and g[2] for g in got), got  # a CkptError on every rank
    assert got[2][0] == "StateMismatchError" and "layer3.b" in got[2][1], got
    assert all(g[0] == "RankFailedError" and "rank 2" in g[1] for r, g in enumerate(got)
               if r != 2), got


def test_a_key_one_rank_lacks_is_not_unexpected_while_another_asks_for_it(saved):
    got = run_ranks(WORLD, cases.load_extra_key_on, saved, 1)
    assert all(g == ([], True) for g in got), got
