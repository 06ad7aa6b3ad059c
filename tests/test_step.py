"""The one collective step (ckptio.distributed.step.coordinate) on real gloo ranks: every rank
gets its own answer, or every rank fails, naming the rank that failed."""

from __future__ import annotations

import pytest

from ckptio.distributed.dist import Solo
from ckptio.distributed.step import coordinate
from ckptio.testing.rank_processes import run_ranks

import step_cases as cases


def test_each_rank_gets_its_own_answer():
    assert run_ranks(3, cases.one_step, "ok") == [
        f"to {r} after from 0,from 1,from 2" for r in range(3)]


def test_a_failed_rank_fails_every_rank_and_is_named():
    results = run_ranks(3, cases.one_step, "rank1 fails")
    assert results[1] == "own error"  # the failing rank raises its own error itself
    for r in (0, 2):
        assert results[r].startswith("RankFailedError: step failed on rank 1: ValueError: bad input")


def test_the_others_learn_each_failing_rank_s_error_kind():
    """RankFailedError.kinds: the failing ranks' error classes in rank order (what a caller
    tells damage from other failures by), the message naming each rank's error in full."""
    results = run_ranks(3, cases.one_step, "two fail")
    assert results[1:] == ["own error", "own error"]
    assert results[0].endswith(" [kinds ValueError,CorruptCheckpointError]"), results[0]
    assert "rank 1: ValueError: bad input" in results[0]
    assert "rank 2: CorruptCheckpointError: bad bytes\nsecond line" in results[0]


def test_the_coordinator_failing_to_decide_fails_every_rank():
    results = run_ranks(3, cases.one_step, "decide fails")
    assert results[0] == "CkptError: cannot decide"
    for r in (1, 2):
        assert "the coordinator (rank 0): CkptError: cannot decide" in results[r]


def test_the_job_s_ranks_hold_a_step_to_the_latest_caller_s_deadline():
    """dist.job_ranks is made once per group and kept (DeepSpeed's and Megatron's plugins);
    a later caller's Options.step_timeout_s governs its steps, not the first caller's (the
    old code kept the defaults: rank 0 waited out rank 1's 8 s and both answered)."""
    results = run_ranks(2, cases.late_under_later_options)
    assert results[0].startswith("RankFailedError after "), results
    assert float(results[0].split()[2]) < 7, results[0]  # 2 s, and a loaded machine's slack
    assert "rank 1" in results[0], results[0]


def test_one_process_decides_alone():
    assert coordinate(Solo(), b"x", None, lambda m: [m[0] + b"!"], str) == b"x!"
    assert coordinate(Solo(), None, ValueError("own"), lambda m: m, str) is None
    with pytest.raises(KeyError):
        coordinate(Solo(), b"x", None, lambda m: [{}["missing"]], str)
