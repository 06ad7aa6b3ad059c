"""Sharded states in the memory tier with redundancy (issue 46): FSDP2 and FSDP2-over-TP
training states on 4 simulated hosts (one rank each), a host wiped (its memory gone), then a
restarted job restores every rank's newest step from memory, bitwise: the lost rank's from its
partner's copy or rebuilt from parity. Each rank's memory step is its piece of the job's state
(its shards, placed in their global tensors: ``meta.piece`` in its manifest); a piece alone
does not load as a whole state."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

import ckptio
from ckptio.format.manifest import decode
from ckptio.testing.rank_processes import RanksFailed, run_ranks
from tests.redundancy_cases import host_dir
from tests.redundancy_sharded_cases import restore, train

TIMEOUT = 240


@pytest.fixture
def base(hosts_base: str) -> str:
    return hosts_base


def _wipe(base: str, host: int) -> None:
    shutil.rmtree(host_dir(base, host))
    os.makedirs(host_dir(base, host))


def _restored(trained: list[Any], restored: list[Any], step: int) -> list[tuple[int, str]]:
    """Every rank back at ``step``, bitwise -> (tier, source) per rank."""
    for rank, r in enumerate(restored):
        assert r["step"] == step and r["state_step"] == step, (rank, r["how"])
        assert r["digests"] == trained[rank]["digests"][step], f"rank {rank} differs"
    return [(r["how"]["tier"], r["how"].get("source")) for r in restored]


@pytest.mark.parametrize(("layout", "spec", "lost", "sources"), [
    ("fsdp", "partners-1", 1, [(0, "own"), (0, "partner"), (0, "own"), (0, "own")]),
    ("2d", "parity-3", 2, [(0, "own"), (0, "own"), (0, "parity"), (0, "own")]),
], ids=["fsdp2-partners", "fsdp2-over-tp-parity"])
def test_a_sharded_state_restores_bitwise_from_memory_after_a_lost_host(
        base, tmp_path, layout, spec, lost, sources):
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train, base, disk, layout, spec, 3, timeout_s=TIMEOUT)
    assert trained[0]["status"]["protected"] == 3
    assert trained[1]["digests"][3] == trained[0]["digests"][3]  # whole tensors: alike
    _wipe(base, lost)
    restored = run_ranks(4, restore, base, disk, layout, spec, timeout_s=TIMEOUT)
    assert _restored(trained, restored, 3) == sources
    piece = os.path.join(host_dir(base, 0), "run", "r00000", "step-3")
    with open(os.path.join(piece, "manifest.json"), "rb") as f:
        manifest = decode(f.read(), piece)
    assert manifest.meta["piece"] == {"rank": 0, "world_size": 4} and manifest.world_size == 1
    with pytest.raises(ckptio.CkptError, match="rank 0's piece of a 4-rank job's state .* "
                       "this is rank 0 of 1"):
        ckptio.load(piece)  # rank 0's shards alone are not the state: refused before reading


def test_sharded_deltas_with_partners_restore_bitwise_after_a_lost_host(base, tmp_path):
    """delta=True, zstd, keep_best with Partners(1) on an FSDP2 state, 4 steps: every rank is
    back at step 4, bitwise. The lost rank's step 4 is a delta whose base's copy the rebuild
    does not install first, so its partner copy is passed over (a warning names the base) and
    that rank reads step 4 from the disk tier (as for plain states, test_redundancy.py); the
    other ranks read theirs from memory."""
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train, base, disk, "fsdp", "partners-1", 4, True, timeout_s=TIMEOUT)
    _wipe(base, 3)
    restored = run_ranks(4, restore, base, disk, "fsdp", "partners-1", True, timeout_s=TIMEOUT)
    assert [tier for tier, _ in _restored(trained, restored, 4)] == [0, 0, 0, 1]


def test_a_restart_on_fewer_hosts_is_refused_loudly(base, tmp_path):
    """Not yet supported: 4 hosts trained, a host lost, the job restarted on the 3 left. Every
    tier with redundancy holds per-rank pieces of the 4-rank state, so every rank refuses, at
    once and naming the rank count to restart with, rather than loading a wrong layout."""
    disk = str(tmp_path / "disk")
    run_ranks(4, train, base, disk, "fsdp", "partners-1", 2, timeout_s=TIMEOUT)
    _wipe(base, 3)
    with pytest.raises(RanksFailed, match=r"piece of a 4-rank job's state .* this is rank \d "
                       r"of 3.*restart with 4 ranks"):
        run_ranks(3, restore, base, disk, "fsdp", "partners-1", timeout_s=TIMEOUT)

