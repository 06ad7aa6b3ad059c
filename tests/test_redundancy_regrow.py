"""A restart on fewer hosts fetches only the bytes its new shards need (issue 66): 4 hosts
trained a Shard(0) state with Partners(1), one host is lost, and the job restarted on the 3
left receives, per rank, the rows of its new shard that other hosts hold, never the old
ranks' whole chunks; nothing is written to the memory tier on the way; a holder killed during
the fetch is named (RankFailedError) and nothing is loaded.

Real gloo ranks on this machine, one rank per simulated host (tests/regrow_cases.py); the bytes
each rank received are ``last_restore["received_bytes"]``."""

from __future__ import annotations

import os
from typing import Any

import pytest

from ckptio.testing.rank_processes import run_ranks
from tests.redundancy_cases import PEER_GONE_S, host_dir, wipe_host
from tests.regrow_cases import ROW_NBYTES, restore, restore_one_fails, train

TIMEOUT = 240


@pytest.fixture
def base(hosts_base: str) -> str:
    return hosts_base


def test_a_restart_on_fewer_hosts_receives_only_the_rows_its_shards_need(base, tmp_path):
    """Old rank k held rows [120k, 120k + 120), new rank r needs [160r, 160r + 160). Before:
    each rank received every old chunk its shard meets whole (rank 0: old rank 1's 120 rows
    for the 40 it needs) and wrote them into the memory tier before loading; now rank 0
    receives exactly rows 120-160 (old rank 1's), rank 1 rows 240-320 (old rank 2's), and
    every rank is bitwise at step 3 (the disk tier holds step 2)."""
    disk = str(tmp_path / "disk")
    run_ranks(4, train, base, disk, "partners-1", 3, timeout_s=TIMEOUT)
    wipe_host(base, 3)
    restored = run_ranks(3, restore, base, disk, "partners-1", timeout_s=TIMEOUT)
    for rank, r in enumerate(restored):
        assert r["error"] is None and r["bitwise"], (rank, r)
        assert (r["step"], r["state_step"], r["how"]["source"]) == (3, 3, "resharded"), r["how"]
    got = [r["how"]["received_bytes"] for r in restored]
    assert got[0] == 40 * ROW_NBYTES and got[1] == 80 * ROW_NBYTES, got
    assert got[2] in (0, 120 * ROW_NBYTES), got  # old rank 3's rows: its copy's holder's
    held = os.path.join(host_dir(base, 0), "run", ".redundancy", "step-3")
    assert not [n for n in os.listdir(held) if n.startswith("elastic-")]


def test_a_restart_on_fewer_hosts_rebuilds_a_lost_piece_along_its_stripes(base, tmp_path):
    """Parity(k=3) on 4 hosts, host 3 lost, the job restarted on the 3 others (Parity(k=2)):
    old rank 3's piece is rebuilt along its stripes' survivors (stripes.py's chains), so no
    rank receives more than that piece's length beside the rows of its new shard (before: the
    rebuilding rank received the other members' whole pieces and blocks); bitwise. The
    rebuilt piece is kept in its receiver's memory for the restart, not written into the
    memory tier (before: its receiver wrote it there as a partner copy, then read it back)."""
    disk = str(tmp_path / "disk")
    run_ranks(4, train, base, disk, "parity-3", 3, timeout_s=TIMEOUT)
    wipe_host(base, 3)
    restored = run_ranks(3, restore, base, disk, "parity-2", timeout_s=TIMEOUT)
    for rank, r in enumerate(restored):
        assert r["error"] is None and r["bitwise"], (rank, r)
        assert (r["step"], r["how"]["source"], r["how"]["skipped"]) == (3, "resharded", [])
    got = [r["how"]["received_bytes"] for r in restored]
    piece = 120 * ROW_NBYTES
    assert all(0 < g <= 160 * ROW_NBYTES + piece for g in got), got
    assert [r["written"] for r in restored] == [0] * 3, restored
    for host in range(3):
        held = os.path.join(host_dir(base, host), "run", ".redundancy", "step-3")
        assert not [n for n in os.listdir(held) if n.startswith("copy-")], (host, held)


def test_a_holder_killed_during_a_restarts_fetch_is_named_and_nothing_is_loaded(base, tmp_path):
    """Rank 1 (old rank 1's piece, which rank 0 needs rows of) dies as it starts sending: the
    other ranks raise RankFailedError within peer_timeout_s, their states untouched; a second
    restart (rank 1's host and memory intact) restores every rank bitwise."""
    disk = str(tmp_path / "disk")
    run_ranks(4, train, base, disk, "partners-1", 3, timeout_s=TIMEOUT)
    wipe_host(base, 3)
    failed = run_ranks(3, restore, base, disk, "partners-1", 1, may_die=(1,), timeout_s=TIMEOUT)
    for rank in (0, 2):
        error = failed[rank]["error"]
        assert error and error.startswith("RankFailedError"), (rank, failed[rank])
        assert failed[rank]["untouched"] and failed[rank]["seconds"] < PEER_GONE_S, failed[rank]
    assert "fetching step 3 from the memory of other hosts" in failed[0]["error"], failed[0]
    restored = run_ranks(3, restore, base, disk, "partners-1", timeout_s=TIMEOUT)
    assert all(r["bitwise"] and r["step"] == 3 for r in restored), restored


def test_a_rank_whose_restart_exchange_fails_stalls_no_rank_that_finished_its_own(base, tmp_path):
    """A restart on 3 of 4 hosts (Partners(1)); rank 1's exchange fails as it ends (its
    peers' parts done) and it waits at the job's next collective. Before: rank 1 raised
    RankFailedError at once, while ranks 0 and 2, their exchanges complete, loaded and
    waited for it in the exchange of the load's outcomes until step_timeout_s (here 60 s;
    30 minutes by default). Now a rank whose exchange fails takes that exchange, its error
    its outcome: every rank raises RankFailedError naming rank 1's error within seconds."""
    disk = str(tmp_path / "disk")
    run_ranks(4, train, base, disk, "partners-1", 3, timeout_s=TIMEOUT)
    wipe_host(base, 3)
    failed = run_ranks(3, restore_one_fails, base, disk, "partners-1", 1, 3.0, 60.0,
                       timeout_s=150)
    _every_rank_said(failed, "rank 1: a link of the restart failed")


def test_a_rank_whose_rebuild_of_a_lost_piece_fails_stalls_no_rank_that_finished_its_own(
        base, tmp_path):
    """Parity(k=3) on 4 hosts, host 3 lost, the job restarted on the 3 others: old rank 3's
    piece is rebuilt along its stripes; rank 1's part of it fails as it ends (its peers'
    parts done) and it waits at the job's next collective. Before: rank 1 raised
    RankFailedError at once, while ranks 0 and 2 waited for it in the gather after the
    rebuild until step_timeout_s (here 60 s). Now it says so in that gather: every rank
    raises RankFailedError naming rank 1's error within seconds."""
    disk = str(tmp_path / "disk")
    run_ranks(4, train, base, disk, "parity-3", 3, timeout_s=TIMEOUT)
    wipe_host(base, 3)
    failed = run_ranks(3, restore_one_fails, base, disk, "parity-2", 1, 3.0, 60.0, "stripes.run",
                       timeout_s=150)
    _every_rank_said(failed, "rank 1: RuntimeError: rank 1: a link of the restart failed")


def _every_rank_said(failed: list[dict[str, Any]], said: str) -> None:
    """Every rank raised RankFailedError quoting ``said`` within seconds (not step_timeout_s)."""
    for rank, out in enumerate(failed):
        assert out["seconds"] < 30, out
        assert out["error"] and out["error"].startswith("RankFailedError"), (rank, out)
        assert said in out["error"], (rank, out["error"])
