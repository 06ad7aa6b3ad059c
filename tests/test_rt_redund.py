"""A demanding user of the memory tier's redundancy across hosts, with real gloo ranks (each
rank plays a host: its own CKPTIO_HOST_ID and shared-memory root, tests/redundancy_cases.py).

- A rank's own memory copy of the newest protected step damaged (a truncated data file, a
  manifest cut short), no host lost: that copy counts as lost, the rank's step comes back
  bitwise from its partner's copy or its group's parity (before: every rank raised
  RankFailedError, the step the protection held never used).
- A rank that never constructs its manager: every other rank's CheckpointManager raises a
  RankFailedError naming that rank and Options.peer_timeout_s within that bound (before:
  torch's DistStoreError about a store key).
- The job restarted with its ranks on other hosts (the scheduler placed rank 0 where rank 1
  was, and back), no host lost: every rank restores the newest step bitwise from the other
  hosts' memories (before: every piece in memory, yet every rank fell back to the disk's
  older step, the warning naming two hosts "lost").
- Two managers with redundancy on one memory tier in one process (the model's and an EMA's,
  other disks, other step numbers): the second is refused naming the tier and the fix (before:
  each one's retention removed the other's steps; the first one's committed step 2 was gone
  before its drain copied it, its protection stopped); once the first is closed, it is made.
- A protection marker on a holder damaged (not JSON), then a host of its group lost: every
  rank falls back to the disk's step, bitwise, and the holder's log names the marker (before:
  nothing said why the protected step was passed over).
- A rank that makes its manager, then exits without calling restore() while the others
  restore: each of them raises RankFailedError saying so, at once (before: gloo's
  RuntimeError "Connection closed by peer" escaped restore()).
- More hosts lost than the redundancy covers, nothing on disk: the error names the way out.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import time
from typing import Any

import pytest

import ckptio
from ckptio.testing.rank_processes import RanksFailed, run_ranks
from tests.redundancy_cases import (OPTS, host_dir, restore, same_bits, too_few_ranks, train,
                                    wipe_host)

TIMEOUT = 240


@pytest.fixture
def base(hosts_base: str) -> str:
    return hosts_base



def _cut_data(step_dir: str) -> str:
    (data,) = glob.glob(os.path.join(step_dir, "data-*"))
    os.truncate(data, os.path.getsize(data) // 2)
    return data


def _cut_manifest(step_dir: str) -> str:
    path = os.path.join(step_dir, "manifest.json")
    os.truncate(path, 1)
    return path


@pytest.mark.parametrize(("spec", "hosts", "source", "damage"), [
    ("parity-3", 4, "parity", _cut_data), ("partners-1", 3, "partner", _cut_manifest)],
    ids=["parity-data", "partners-manifest"])
def test_a_damaged_own_memory_copy_is_rebuilt_from_its_redundancy_bitwise(
        base, tmp_path, spec, hosts, source, damage):
    """Step 3 protected on every host (the disk holds step 2); rank 0's own copy of step 3 in
    its memory then damaged, its host otherwise whole: every rank restores step 3 bitwise,
    rank 0's from the redundancy, and the damaged copy is named in last_restore's skipped."""
    args = (base, str(tmp_path / "disk"), 1, spec)
    trained = run_ranks(hosts, train, *args, 3, timeout_s=TIMEOUT)
    assert all(t["status"]["protected"] == 3 for t in trained)
    damaged = damage(os.path.join(host_dir(base, 0), "run", "r00000", "step-3"))
    restored = run_ranks(hosts, restore, *args, timeout_s=TIMEOUT)
    for rank, (t, r) in enumerate(zip(trained, restored)):
        assert r["step"] == 3 and r["state_step"] == 3, (rank, r["how"])
        same_bits(r["got"], t["saved"][3], f"rank {rank}")
    assert [r["how"]["source"] for r in restored] == [source] + ["own"] * (hosts - 1)
    for r in restored:
        assert any("step 3 in memory" in s and damaged in s for s in r["how"]["skipped"]), \
            r["how"]["skipped"]
    # the copy rebuilt replaced the damaged one: the next job loads it from its own memory
    again = run_ranks(hosts, restore, *args, timeout_s=TIMEOUT)
    assert [r["how"]["source"] for r in again] == ["own"] * hosts
    same_bits(again[0]["got"], trained[0]["saved"][3], "rank 0, next job")


def never_makes_its_manager(rank: int, world: int, base: str, disk: str, absent: int,
                            peer_timeout_s: float) -> dict[str, Any]:
    """Rank ``absent`` never constructs its manager (it waits until the others have given
    up); every other rank does -> its error ("Type|message") and the seconds it took."""
    flag = os.path.join(base, "gave-up")
    if rank == absent:
        deadline = time.monotonic() + 10 * peer_timeout_s
        while len(glob.glob(flag + "-*")) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        return {"error": "", "seconds": 0.0}
    os.environ["CKPTIO_HOST_ID"] = f"host{rank}"
    os.environ["CKPTIO_SHM_DIR"] = host_dir(base, rank)
    options = dataclasses.replace(OPTS, peer_timeout_s=peer_timeout_s)
    tiers = [ckptio.Tier("shm://run", redundancy=ckptio.Partners(1)), ckptio.Tier(disk)]
    started = time.monotonic()
    try:
        ckptio.CheckpointManager(tiers=tiers, options=options).close()
    except Exception as exc:  # noqa: BLE001 - the test inspects what every rank got
        error = f"{type(exc).__name__}|{exc}"
    else:
        error = ""
    seconds = time.monotonic() - started
    with open(f"{flag}-{rank}", "w", encoding="utf-8"):
        pass
    return {"error": error, "seconds": seconds}


def test_a_rank_that_never_makes_its_manager_is_named_within_peer_timeout_s(base, tmp_path):
    os.makedirs(base, exist_ok=True)
    got = run_ranks(3, never_makes_its_manager, base, str(tmp_path / "disk"), 1, 4.0,
                    timeout_s=TIMEOUT)
    for rank in (0, 2):
        error, seconds = got[rank]["error"], got[rank]["seconds"]
        assert error.startswith("RankFailedError|"), error
        assert "rank 1 did not construct its manager" in error, error
        assert "Options.peer_timeout_s=4 s" in error, error
        assert seconds < 4.0 + 10, seconds


def restore_on_other_hosts(rank: int, world: int, base: str, disk: str, spec: str,
                           hosts: list[int]) -> dict[str, Any]:
    """restore() with this rank on host ``hosts[rank]`` (the ranks placed anew)."""
    os.environ["CKPTIO_HOST_ID"] = f"host{hosts[rank]}"
    os.environ["CKPTIO_SHM_DIR"] = host_dir(base, hosts[rank])
    import torch

    torch.manual_seed(1000 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = ckptio.CheckpointManager(tiers=[
        ckptio.Tier("shm://run", keep_last=2, redundancy=ckptio.Partners(1)),
        ckptio.Tier(disk, every=2, keep_last=2)], options=OPTS)
    state = {"model": model, "optim": opt, "rng": ckptio.RNGState(), "step": -1}
    step = mgr.restore(state)
    how = mgr.last_restore
    mgr.close()
    return {"step": step, "state_step": state["step"], "how": how,
            "got": {"model": model.state_dict(), "optim": opt.state_dict(),
                    "rng": torch.get_rng_state()}}


def test_ranks_restarted_on_other_hosts_restore_the_newest_step_bitwise(base, tmp_path):
    """Partners(1) on 4 hosts, step 3 protected (the disk holds step 2); the next job runs
    rank 0 on host 1 and rank 1 on host 0: step 3 on every rank, bitwise, from memory."""
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train, base, disk, 1, "partners-1", 3, timeout_s=TIMEOUT)
    restored = run_ranks(4, restore_on_other_hosts, base, disk, "partners-1", [1, 0, 2, 3],
                         timeout_s=TIMEOUT)
    for rank, (t, r) in enumerate(zip(trained, restored)):
        assert r["step"] == 3 and r["state_step"] == 3, (rank, r["how"])
        same_bits(r["got"], t["saved"][3], f"rank {rank}")
        assert r["how"]["tier"] == 0, r["how"]


def two_managers_one_memory(rank: int, world: int, base: str, disk: str) -> dict[str, Any]:
    """One rank per host: manager ``a`` saves steps 1-3, then a second manager on the same
    shm://run (another disk) is made -> its error, a's status, and whether a second manager
    is made once a is closed."""
    os.environ["CKPTIO_HOST_ID"] = f"host{rank}"
    os.environ["CKPTIO_SHM_DIR"] = host_dir(base, rank)
    os.makedirs(host_dir(base, rank), exist_ok=True)
    import torch

    def tiers(sub: str) -> list[Any]:
        return [ckptio.Tier("shm://run", keep_last=2, redundancy=ckptio.Partners(1)),
                ckptio.Tier(os.path.join(disk, sub), every=2, keep_last=2)]

    a = ckptio.CheckpointManager(tiers=tiers("a"), options=OPTS)
    for step in range(1, 4):
        a.save(step, {"w": torch.full((64,), float(step)), "step": step})
    a.protected()
    try:
        ckptio.CheckpointManager(tiers=tiers("b"), options=OPTS)
    except ckptio.errors.CkptError as exc:
        error = str(exc)
    else:
        error = ""
    status = a.status()[0]
    a.close()
    own = sorted(n for n in os.listdir(os.path.join(host_dir(base, rank), "run", f"r{rank:05d}"))
                 if n.startswith("step-"))
    b = ckptio.CheckpointManager(tiers=tiers("b"), options=OPTS)
    b.save(1001, {"w": torch.zeros(64), "step": 1001})
    b.protected()
    b.close()
    return {"error": error, "status": status, "own": own}


def test_a_second_manager_on_one_protected_memory_tier_is_refused(base, tmp_path):
    got = run_ranks(3, two_managers_one_memory, base, str(tmp_path / "disk"), timeout_s=TIMEOUT)
    for rank, g in enumerate(got):
        assert "another CheckpointManager of this process protects that memory tier" in \
            g["error"] and host_dir(base, rank) in g["error"], g["error"]
        assert "shm://NAME" in g["error"] and "close() the other" in g["error"], g["error"]
        assert g["status"]["protected"] == 3 and g["status"]["protect_error"] is None, g["status"]
        assert g["own"] == ["step-2", "step-3"], g["own"]  # a's steps, none removed
        assert "step-2" in os.listdir(os.path.join(str(tmp_path / "disk"), "a", f"r{rank:05d}"))


def restore_logged(rank: int, world: int, base: str, disk: str, spec: str) -> dict[str, Any]:
    """restore() with every ckptio log record of WARNING and above kept."""
    import logging

    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("ckptio").addHandler(handler)
    try:
        out = restore(rank, world, base, disk, 1, spec)
    finally:
        logging.getLogger("ckptio").removeHandler(handler)
    return {**out, "said": said}


def test_a_damaged_protection_marker_is_named_and_the_disk_step_restored(base, tmp_path):
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train, base, disk, 1, "parity-3", 3, timeout_s=TIMEOUT)
    marker = os.path.join(host_dir(base, 3), "run", ".redundancy", "step-3",
                          "protected-r00003.json")
    with open(marker, "w", encoding="utf-8") as f:
        f.write("{not json")
    wipe_host(base, 1)
    restored = run_ranks(4, restore_logged, base, disk, "parity-3", timeout_s=TIMEOUT)
    for rank, (t, r) in enumerate(zip(trained, restored)):
        assert r["step"] == 2 and r["state_step"] == 2, (rank, r["how"])
        same_bits(r["got"], t["saved"][2], f"rank {rank}")
    assert [r["how"]["source"] for r in restored] == ["own", "disk", "own", "own"]
    assert any(marker in m and "unreadable" in m and "step 3" in m
               for m in restored[3]["said"]), restored[3]["said"]


def one_rank_leaves_before_restore(rank: int, world: int, base: str, disk: str,
                                   leaver: int) -> dict[str, Any]:
    """Every rank makes its manager (rank_timeout_s=5); rank ``leaver`` then exits (never calls
    restore) while the others restore -> their error ("Type|message") and the seconds it
    took."""
    os.environ["CKPTIO_HOST_ID"] = f"host{rank}"
    os.environ["CKPTIO_SHM_DIR"] = host_dir(base, rank)
    import torch

    mgr = ckptio.CheckpointManager(tiers=[
        ckptio.Tier("shm://run", keep_last=2, redundancy=ckptio.Partners(1)),
        ckptio.Tier(disk, every=2, keep_last=2)],
        options=dataclasses.replace(OPTS, rank_timeout_s=5.0))
    if rank == leaver:
        time.sleep(1.0)  # the others are in restore() by now
        return {"error": "", "seconds": 0.0}
    started = time.monotonic()
    try:
        mgr.restore({"w": torch.zeros(4), "step": 0})
    except Exception as exc:  # noqa: BLE001 - the test inspects what every rank got
        error = f"{type(exc).__name__}|{exc}"
    else:
        error = ""
    return {"error": error, "seconds": time.monotonic() - started}


def test_a_rank_that_leaves_instead_of_restoring_fails_the_others_with_a_ckpterror(
        base, tmp_path):
    """Rank 2 exits instead of calling restore() (without a word: run_ranks' child ends by
    os._exit): the others raise RankFailedError naming it where the ranks meet, as died (the
    ranks on its machine saw its process gone), before rank_timeout_s."""
    disk = str(tmp_path / "disk")
    run_ranks(3, train, base, disk, 1, "partners-1", 2, timeout_s=TIMEOUT)
    got = run_ranks(3, one_rank_leaves_before_restore, base, disk, 2, timeout_s=TIMEOUT,
                    destroy=False)
    for rank in (0, 1):
        error, seconds = got[rank]["error"], got[rank]["seconds"]
        assert error.startswith("RankFailedError|"), error
        assert "stopped where the ranks meet, waiting for rank 2 on host 2" in error, error
        assert "rank 2: its process died while rank 0 waited" in error, error
        assert seconds < 5 + 15, seconds


def test_more_hosts_lost_than_the_redundancy_covers_names_the_fix(base: str,
                                                                  tmp_path: Any) -> None:
    """Two of three hosts lost with Partners(1) and nothing kept on disk: every rank's
    CheckpointNotFoundError names the hosts lost and the way out (before: the hosts and
    each rank's steps only)."""
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "partners-1")
    run_ranks(3, train, *args, 3, timeout_s=TIMEOUT)
    shutil.rmtree(disk)
    os.makedirs(disk)  # nothing kept on the slower tier
    wipe_host(base, 1)
    wipe_host(base, 2)
    with pytest.raises(RanksFailed) as raised:
        run_ranks(3, restore, *args, timeout_s=TIMEOUT)
    message = str(raised.value)
    assert "CheckpointNotFoundError" in message and "hosts lost: host 1" in message
    assert "More hosts were lost than the memory tier's redundancy rebuilds" in message
    # the slower tier the job has is named, not suggested as if it had none
    assert f"the slower tiers ({disk}/r0000" in message, message
    assert ", every=2) hold no step every rank can load" in message, message


def test_a_redundancy_needing_more_hosts_than_ranks_is_refused_alike_on_every_rank(
        base: str) -> None:
    """Parity(k=3) on a job of 3 ranks (a group is 4 hosts): every rank raises the same
    CkptError at once, naming the fix, before any process group is made (a new user's trial:
    one rank got torch's DistNetworkError, as the others' refusal came after the host gather
    and the rank holding the store exited)."""
    said = run_ranks(3, too_few_ranks, base, "parity-3", timeout_s=TIMEOUT)
    assert len(set(said)) == 1, said
    assert said[0].startswith("CkptError: Tier('shm://run', redundancy=parity(k=3)"), said[0]
    assert "3 rank(s), so at most 3 host(s), and it needs at least 4" in said[0], said[0]
