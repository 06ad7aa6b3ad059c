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


def test_each_dtensor_region_is_worked_out_once_per_load(saved):
    """Before: twice per DTensor (the regular chunks' wants, then the fill plan)."""
    got = run_ranks(WORLD, cases.load_counted, saved)
    assert all(g["equal"] for g in got), got
    assert all(g["regions"] == 2 * cases.N for g in got), got  # N matrices + N vectors
