"""Issue 67, "host memory per node": the ranks of one host share ONE staging budget
(Options.host_budget_bytes, or half of the memory available), each growing its pool to an
equal share (io/hostbudget.py), so the host's staging stays within the budget whatever the
ranks per host; the floor (the pool a save streams through) lets a save below its share go on.

The multi-rank cases run 4 real processes of one job (gloo), each told what torchrun tells a
rank (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE), each async-saving a state larger than
its share; the host's staging is the sum of what each rank's Checkpointer.staging_nbytes says
during and after its saves (its pool only grows until close()).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptio
from ckptio import Checkpointer, CkptError, Options
from ckptio.testing.rank_processes import run_ranks

MiB = 1 << 20
RANKS = 4
TENSORS, TENSOR_MIB = 4, 4  # each rank: 16 MiB of its own values, the largest tensor 4 MiB
FLOOR = 2 * MiB  # Options.pool_bytes: the pool a save streams through


def _rank_state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 + rank)
    n = TENSOR_MIB * MiB // 4
    return {"w": {f"t{i}": torch.randn(n, generator=g) for i in range(TENSORS)}, "step": rank}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def save_on_one_host(rank: int, world: int, root: str, budget: int) -> dict[str, Any]:
    """One rank of a job of ``world`` ranks on one host: two async saves of its own 16 MiB,
    then a load of the second; -> the most staging it held and whether the load was exact."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))  # as torchrun sets them, before any ckptio
    ck = Checkpointer(Options(buffer_bytes=MiB, pool_bytes=FLOOR, io_depth=2,
                              use_profile=False, host_budget_bytes=budget))
    state = _rank_state(rank)
    held = []
    for i in range(2):
        handle = ck.async_save(state, os.path.join(root, f"s{i}"))
        held.append(ck.staging_nbytes)
        handle.wait()
        held.append(ck.staging_nbytes)
    dest = {"w": {k: torch.zeros_like(v) for k, v in state["w"].items()}, "step": -1}
    ck.load(os.path.join(root, "s1"), dest)
    exact = dest["step"] == rank and all(
        torch.equal(_bits(dest["w"][k]), _bits(v)) for k, v in state["w"].items())
    ck.close()
    return {"held": max(held), "exact": exact}


def test_four_ranks_of_one_host_share_one_budget(tmp_path: Path) -> None:
    """A 24 MiB budget for the host: each of the 4 ranks grows its pool to its 6 MiB share
    (before issue 67 each took the whole 24 MiB, the host 4 x its state), and every rank's
    checkpoint loads bit for bit."""
    budget = 24 * MiB
    got = run_ranks(RANKS, save_on_one_host, str(tmp_path), budget, timeout_s=120)
    assert all(r["exact"] for r in got), got
    assert sum(r["held"] for r in got) <= budget, got
    assert [r["held"] for r in got] == [budget // RANKS] * RANKS, got  # the share, used


def test_a_share_below_the_floor_keeps_the_streaming_pool_and_saves(tmp_path: Path) -> None:
    """A 4 MiB budget for 4 ranks: a 1 MiB share is below the 2 MiB pool a save streams
    through (Options.pool_bytes) and below the 4 MiB largest tensor: each rank keeps that
    pool, the largest tensor streams through it, the host holds 4 x 2 MiB (the documented
    floor), and every checkpoint loads bit for bit."""
    got = run_ranks(RANKS, save_on_one_host, str(tmp_path), 4 * MiB, timeout_s=120)
    assert all(r["exact"] for r in got), got
    assert [r["held"] for r in got] == [FLOOR] * RANKS, got


def _state(nbytes: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"w": {f"t{i}": torch.randn(nbytes // 16, generator=g) for i in range(4)}}


@pytest.mark.parametrize("env", [{}, {"LOCAL_WORLD_SIZE": "1"}])
def test_a_single_process_keeps_the_whole_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 assert_same: Any, env: dict[str, str]) -> None:
    """No launcher (or one rank per host): the budget is this process's, as before."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    state = _state(8 * MiB)
    ck = Checkpointer(Options(buffer_bytes=MiB, pool_bytes=FLOOR, io_depth=2,
                              use_profile=False, host_budget_bytes=6 * MiB))
    ck.async_save(state, tmp_path / "s").wait()
    assert ck.staging_nbytes == 6 * MiB
    assert_same(ckptio.load(tmp_path / "s"), state)
    ck.close()


def test_other_launchers_ranks_per_host_and_the_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, assert_same: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """Open MPI's local size is read where torchrun's is absent; the warning past the share
    names the host's budget and its ranks."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    state = _state(8 * MiB)
    ck = Checkpointer(Options(buffer_bytes=MiB, pool_bytes=FLOOR, io_depth=2,
                              use_profile=False, host_budget_bytes=8 * MiB))
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        ck.async_save(state, tmp_path / "s").wait()
    assert ck.staging_nbytes == 4 * MiB
    warned = [r.getMessage() for r in caplog.records if "host_budget_bytes" in r.getMessage()]
    assert len(warned) == 1 and "over its 2 ranks" in warned[0], warned
    assert_same(ckptio.load(tmp_path / "s"), state)
    ck.close()


def test_a_share_below_the_floor_says_what_the_host_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, assert_same: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """4 ranks per host, a 4 MiB budget: this rank's 1 MiB share is below its 2 MiB pool; the
    pool stays, the save works, and the one warning says the host may hold 4 such pools and
    how to stay within (lower pool_bytes)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    state = _state(8 * MiB)
    ck = Checkpointer(Options(buffer_bytes=MiB, pool_bytes=FLOOR, io_depth=2,
                              use_profile=False, host_budget_bytes=4 * MiB))
    with caplog.at_level(logging.WARNING, logger="ckptio"):
        for i in range(2):
            ck.async_save(state, tmp_path / f"s{i}").wait()
    assert ck.staging_nbytes == FLOOR
    warned = [r.getMessage() for r in caplog.records if "host_budget_bytes" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "over its 4 ranks" in warned[0] and "lower Options.pool_bytes" in warned[0], warned
    assert_same(ckptio.load(tmp_path / "s1"), state)
    ck.close()


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_a_bad_ranks_per_host_is_refused_at_once(monkeypatch: pytest.MonkeyPatch,
                                                 value: str) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(CkptError, match=f"LOCAL_WORLD_SIZE='{value}'.*ranks per host"):
        Checkpointer(Options(host_budget_bytes=MiB))
