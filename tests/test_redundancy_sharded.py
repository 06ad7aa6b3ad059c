"""Sharded states in the memory tier with redundancy (issue 46): FSDP2 and FSDP2-over-TP
training states on 4 simulated hosts (one rank each), a host wiped (its memory gone), then a
restarted job restores every rank's newest step from memory, bitwise: the lost rank's from its
partner's copy or rebuilt from parity. Each rank's memory step is its piece of the job's state
(its shards, placed in their global tensors: ``meta.piece`` in its manifest); a piece alone
does not load as a whole state."""

from __future__ import annotations

import os
from typing import Any

import pytest

import ckptio
from ckptio.format.manifest import decode
from ckptio.testing.rank_processes import RanksFailed, run_ranks
from tests.redundancy_cases import host_dir, wipe_host
from ckptio.redundancy.pieces import Regrowth, item_id, plan, regrowths
from tests.redundancy_sharded_cases import first_step_estimate, restore, train

TIMEOUT = 240


@pytest.fixture
def base(hosts_base: str) -> str:
    return hosts_base



def _restored(trained: list[Any], restored: list[Any], step: int) -> list[tuple[int, str]]:
    """Every rank back at ``step``, bitwise -> (tier, source) per rank."""
    for rank, r in enumerate(restored):
        assert r["step"] == step and r["state_step"] == step, (rank, r["how"])
        assert r["digests"] == trained[rank]["digests"][step], f"rank {rank} differs"
    return [(r["how"]["tier"], r["how"].get("source")) for r in restored]


@pytest.mark.parametrize(("layout", "spec", "lost", "sources"), [
    ("fsdp", "partners-1", 1, [(0, "own"), (0, "partner"), (0, "own"), (0, "own")]),
    ("2d", "parity-3", 2, [(0, "own"), (0, "own"), (0, "parity"), (0, "own")]),
    ("2d", "parity2-2", (0, 1), [(0, "parity"), (0, "parity"), (0, "own"), (0, "own")]),
], ids=["fsdp2-partners", "fsdp2-over-tp-parity", "fsdp2-over-tp-two-parity-two-lost"])
def test_a_sharded_state_restores_bitwise_from_memory_after_a_lost_host(
        base, tmp_path, layout, spec, lost, sources):
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train, base, disk, layout, spec, 3, timeout_s=TIMEOUT)
    assert trained[0]["status"]["protected"] == 3
    assert trained[1]["digests"][3] == trained[0]["digests"][3]  # whole tensors: alike
    for host in lost if isinstance(lost, tuple) else (lost,):
        wipe_host(base, host)
    restored = run_ranks(4, restore, base, disk, layout, spec, timeout_s=TIMEOUT)
    assert _restored(trained, restored, 3) == sources
    piece = os.path.join(host_dir(base, 0), "run", "r00000", "step-3")
    with open(os.path.join(piece, "manifest.json"), "rb") as f:
        manifest = decode(f.read(), piece)
    assert manifest.meta["piece"] == {"rank": 0, "world_size": 4} and manifest.world_size == 1
    with pytest.raises(ckptio.CkptError, match="rank 0's piece of a 4-rank job's state .* "
                       "this is rank 0 of 1"):
        ckptio.load(piece)  # rank 0's shards alone are not the state: refused before reading


@pytest.mark.parametrize(("spec", "lost", "how"), [("partners-1", (3,), "partner"),
                                                   ("parity2-2", (1, 3), "parity")])
def test_sharded_deltas_restore_bitwise_from_memory_after_lost_hosts(base, tmp_path, spec, lost,
                                                                     how):
    """delta=True, zstd, keep_best on an FSDP2 state, 4 steps (step 4 a delta): the protection
    keeps its base's while it is the newest protected step, so the lost ranks get the base
    back first (from a partner's copy, or rebuilt from two parity pieces), then step 4,
    verified against its base: every rank back at step 4 from memory, bitwise."""
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train, base, disk, "fsdp", spec, 4, True, timeout_s=TIMEOUT)
    step4 = os.path.join(host_dir(base, 0), "run", "r00000", "step-4")
    with open(os.path.join(step4, "manifest.json"), "rb") as f:
        (base_name,) = decode(f.read(), step4).bases  # a delta of one base step
    held = os.listdir(os.path.join(host_dir(base, 0), "run", ".redundancy"))
    assert sorted(held) == sorted([base_name, "step-4"]), held  # the newest and its base
    for host in lost:
        wipe_host(base, host)
    restored = run_ranks(4, restore, base, disk, "fsdp", spec, True, timeout_s=TIMEOUT)
    assert _restored(trained, restored, 4) == [
        (0, how if rank in lost else "own") for rank in range(4)]
    for host in lost:  # the base came back beside its delta
        steps = os.listdir(os.path.join(host_dir(base, host), "run", f"r{host:05d}"))
        assert {base_name, "step-4"} <= set(steps), steps


@pytest.mark.parametrize(("layout", "lost", "world"), [("fsdp", 3, 3), ("2d", 1, 6)],
                         ids=["fsdp2-4-to-3-hosts", "fsdp2-over-tp-4-to-6-hosts"])
def test_a_restart_on_another_number_of_hosts_restores_resharded_from_memory(
        base, tmp_path, layout, lost, world):
    """4 hosts trained (Partners(1)), one lost, the job restarted on 3 hosts (FSDP2 over 3
    ranks) or on 6 (a 3x2 mesh; two new hosts with empty memory): every rank restores step 3,
    the newest, resharded from the pieces left in memory (the lost rank's from its partner's
    copy), bitwise against the whole tensors trained; the disk tier (step 2) is not used."""
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train, base, disk, layout, "partners-1", 3, timeout_s=TIMEOUT)
    wipe_host(base, lost)
    restored = run_ranks(world, restore, base, disk, layout, "partners-1", timeout_s=TIMEOUT)
    assert _restored([trained[0]] * world, restored, 3) == [(0, "resharded")] * world
    scratch = os.path.join(host_dir(base, 0), "run", ".redundancy", "step-3")
    assert not [n for n in os.listdir(scratch) if n.startswith("elastic-")]  # removed after


def test_a_damaged_piece_is_passed_over_in_a_restart_on_fewer_hosts(base, tmp_path):
    """Rank 1's own piece damaged in memory (a flipped byte): its holder's check catches it,
    the restart on 3 hosts takes rank 1's partner copy instead, names what it passed over,
    and every rank is bitwise at step 3."""
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train, base, disk, "fsdp", "partners-1", 3, timeout_s=TIMEOUT)
    wipe_host(base, 3)
    piece = os.path.join(host_dir(base, 1), "run", "r00001", "step-3")
    data = next(os.path.join(piece, n) for n in os.listdir(piece) if n.endswith(".bin"))
    with open(data, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    restored = run_ranks(3, restore, base, disk, "fsdp", "partners-1", timeout_s=TIMEOUT)
    assert _restored([trained[0]] * 3, restored, 3) == [(0, "resharded")] * 3
    skipped = restored[0]["how"]["skipped"]
    assert len(skipped) == 1 and "rank 1's piece of step 3 (own)" in skipped[0], skipped


@pytest.mark.parametrize(("spec", "hosts", "lost", "restart_spec"), [
    ("parity-2", 4, (3,), "parity-2"), ("parity2-2", 5, (3, 4), "parity2-1")],
    ids=["parity-4-to-3-hosts", "two-parity-5-to-3-hosts"])
def test_a_restart_on_fewer_hosts_rebuilds_lost_pieces_from_parity(base, tmp_path, spec, hosts,
                                                                   lost, restart_spec):
    """Parity(2) on 4 hosts, one lost; Parity(2, m=2) on 5, two lost: the job restarted on the 3
    hosts left first rebuilds each lost rank's piece from its group's blocks and the other
    pieces (redundancy/regrow.py), then restores step 3 resharded from memory, bitwise; the
    rebuilt pieces are kept in their receivers' memory for the restart, none written into a
    memory tier (test_redundancy_regrow.py counts it)."""
    disk = str(tmp_path / "disk")
    trained = run_ranks(hosts, train, base, disk, "fsdp", spec, 3, timeout_s=TIMEOUT)
    for host in lost:
        wipe_host(base, host)
    restored = run_ranks(3, restore, base, disk, "fsdp", restart_spec, timeout_s=TIMEOUT)
    assert _restored([trained[0]] * 3, restored, 3) == [(0, "resharded")] * 3
    assert restored[0]["how"]["skipped"] == []
    copies = [n for h in range(3) for n in os.listdir(
        os.path.join(host_dir(base, h), "run", ".redundancy", "step-3")) if n.startswith("copy-")]
    assert copies == [], copies


def test_a_restart_on_fewer_hosts_that_memory_cannot_supply_is_refused_loudly(base, tmp_path):
    """Parity(2): two hosts of the group lost (one more than its parity rebuilds), and the
    disk tier holds only the 4-rank job's pieces: every rank of the 3-rank restart refuses,
    naming the steps and the rank count to restart with, rather than loading a wrong layout
    or starting from scratch."""
    disk = str(tmp_path / "disk")
    run_ranks(4, train, base, disk, "fsdp", "parity-2", 2, timeout_s=TIMEOUT)
    wipe_host(base, 2)
    wipe_host(base, 3)
    with pytest.raises(RanksFailed, match=r"CheckpointNotFoundError.*steps \[1, 2\] were saved "
                       r"by a job of another number of ranks.*restart with the rank count"):
        run_ranks(3, restore, base, disk, "fsdp", "parity-2", timeout_s=TIMEOUT)


def test_a_kill_during_the_protection_of_a_sharded_step_leaves_the_previous_one(base, tmp_path):
    """FSDP2 over TP with Parity(3): every rank SIGKILLed while step 3's parity is encoded.
    Step 3 is in every memory but its protection never committed; with a host then lost, the
    restarted job restores step 2 (protected), bitwise, the lost rank's rebuilt from parity."""
    reference = run_ranks(4, train, os.path.join(base, "ref"), str(tmp_path / "ref"), "2d",
                          "parity-3", 2, timeout_s=TIMEOUT)  # the same training, not killed
    disk = str(tmp_path / "disk")
    with pytest.raises(RanksFailed):
        run_ranks(4, train, base, disk, "2d", "parity-3", 3, False, 3, timeout_s=TIMEOUT)
    for host in range(4):
        assert os.path.isdir(os.path.join(host_dir(base, host), f"run/r{host:05d}/step-3"))
        marks = os.listdir(os.path.join(host_dir(base, host), "run/.redundancy/step-3"))
        assert not [n for n in marks if n.startswith("protected-")], marks
    wipe_host(base, 1)
    restored = run_ranks(4, restore, base, disk, "2d", "parity-3", timeout_s=TIMEOUT)
    assert _restored(reference, restored, 2) == [(0, "own"), (0, "parity"), (0, "own"),
                                                 (0, "own")]


def test_the_plan_of_a_restart_takes_each_piece_once_own_first_newest_step():
    """Pure (redundancy/pieces.plan), from the hosts' surveys: a step saved by as many ranks as
    this job is not this plan's; own pieces before partner copies, the lowest holder first; a
    piece passed over (bad) falls to its copy; a step missing a piece is skipped for an older
    one; ``only`` restricts to one step."""
    reports = [
        [[5, 0, 4, "own"], [5, 3, 4, "copy"], [4, 0, 4, "own"], [4, 3, 4, "copy"],
         [6, 0, 3, "own"]],
        [[5, 1, 4, "own"], [5, 0, 4, "copy"], [4, 1, 4, "own"], [4, 0, 4, "copy"]],
        [[5, 2, 4, "own"], [5, 1, 4, "copy"], [4, 2, 4, "own"], [4, 1, 4, "copy"]],
    ]
    want = {0: ("own", 0), 1: ("own", 1), 2: ("own", 2), 3: ("copy", 0)}
    assert plan(reports, 3, set(), None) == (5, 4, want)  # step 6: saved by 3 ranks, as now
    assert plan(reports, 4, set(), None) is None  # a 4-rank job restores 4-rank steps itself
    bad = {item_id(5, 1, ("own", 1))}
    assert plan(reports, 3, bad, None)[2][1] == ("copy", 2)
    bad |= {item_id(5, 3, ("copy", 0))}
    assert plan(reports, 3, bad, None)[0] == 4  # step 5 lacks rank 3's piece: the older step
    assert plan(reports, 3, bad, 5) is None


def test_a_first_steps_size_estimate_counts_the_local_shards():
    """Before any step is held, the memory tier's budget estimates a step from the state: a
    DTensor counts its local shard (before: the whole tensor, so a first save of a 5-host
    sharded job with Partners(2) was refused as if each rank held the whole state)."""
    for got in run_ranks(4, first_step_estimate, timeout_s=TIMEOUT):
        assert got["estimate"] == got["local"] == 64 * 1024 * 4 // 4


def test_the_plan_rebuilds_a_lost_piece_from_parity_only_where_its_group_allows():
    """Pure (redundancy/pieces.regrowths): step 5 of a 4-rank job misses rank 3's piece; the 3
    hosts left hold pieces 0-2 and the blocks of positions 0-2 of the one group (m = 1): rank 3
    is rebuilt, received by the first block's holder. A newer whole step, a second lost
    position, or the rebuild found bad before: nothing to rebuild."""
    reports = [[[5, r, 4, "own"]] for r in range(3)]
    blocks = [[[5, 0, 0, j, [0, 1, 2, 3], 1]] for j in range(3)]
    want = Regrowth(5, 3, 0, 0, [0, 1, 2, 3], 1, [3], {j: ("own", j) for j in range(3)},
                    {0: 0, 1: 1, 2: 2}, 0)
    assert regrowths(reports, blocks, 3, set(), None) == (5, [want])
    whole = [[*found, *([[6, r, 4, "own"], [6, 3, 4, "copy"]] if r == 0 else [[6, r, 4, "own"]])]
             for r, found in enumerate(reports)]
    assert regrowths(whole, blocks, 3, set(), None) is None  # step 6 needs no rebuild
    assert regrowths(reports, blocks[:2] + [[]], 3, set(), None) is None  # two lost, m = 1
    two = [[[5, 0, 0, j, [0, 1, 2, 3], 2]] for j in range(2)] + [[]]
    assert regrowths(reports, two, 3, set(), None)[1][0].lost == [2, 3]  # m = 2: rebuilt
    assert regrowths(reports, blocks, 3, {"regrow:r3:s5"}, None) is None
