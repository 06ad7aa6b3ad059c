"""Redundancy of the memory tier across hosts (issue 27): partner copies and XOR parity, every
copy verified, restore after a lost host.

Real gloo ranks on this machine; each group of ranks plays a host (its own CKPTIO_HOST_ID and
its own shared-memory root, tests/redundancy_cases.py), so "losing a host" is killing its ranks
(every run ends) and removing its memory. Worlds are small: 3-4 hosts x 1-2 ranks."""

from __future__ import annotations

import glob
import json
import os
import shutil
import uuid
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import CkptError
from ckptio.testing.ranks import RanksFailed, run_ranks
from ckptio.tiering.hosts import Topology
from tests.redundancy_cases import host_dir, replay, restore, train

TIMEOUT = 240


@pytest.fixture
def base() -> Any:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    root = os.path.join("/dev/shm", f"ckptio-test-redundancy-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _same(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), where
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _wipe(base: str, host: int) -> None:
    shutil.rmtree(host_dir(base, host))
    os.makedirs(host_dir(base, host))  # the replacement host: an empty memory


def _check_restored(trained: list[Any], restored: list[Any], step: int) -> None:
    for rank, (t, r) in enumerate(zip(trained, restored)):
        assert r["step"] == step and r["state_step"] == step, (rank, r["step"], r["how"])
        _same(r["got"], t["saved"][step], f"rank {rank}")


# ------------------------------------------------------------------ topology (no ranks)


def test_topology_rules_and_refusals():
    topo = Topology.from_ids(["a", "a", "b", "b", "c", "c", "d", "d"])
    assert topo.size == 4 and topo.local_size == 2 and topo.hosts[1] == (2, 3)
    assert topo.partners(1, 1) == [3] and topo.partners(7, 2) == [1, 3]  # (h+j) mod H, same local
    assert topo.partnered(1, 1) == [7]
    assert topo.groups(3) == [(0, 1, 2), (3,)]
    assert [topo.parity_host(g, 3) for g in range(2)] == [3, 2]  # never its own group's
    for k in (1, 2, 3):
        for g, hosts in enumerate(topo.groups(k)):
            assert topo.parity_host(g, k) not in hosts
    with pytest.raises(CkptError, match="needs more than k hosts"):
        topo.groups(4)
    with pytest.raises(CkptError, match="at most Partners"):
        topo.partners(0, 4)
    with pytest.raises(CkptError, match="same number of ranks on every host"):
        Topology.from_ids(["a", "a", "b"])
    with pytest.raises(CkptError, match="redundancy protects a memory tier"):
        ckptio.Tier("/tmp/x", redundancy=ckptio.Partners(1))
    with pytest.raises(CkptError, match="only the first tier"):
        ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://a"), ckptio.Tier(
            "shm://b", redundancy=ckptio.Parity(2))])
    with pytest.raises(CkptError, match="Parity"):
        ckptio.Parity(k=0)


# ------------------------------------------------------------------ a lost host, restored


def test_partners_wipe_one_of_three_hosts_restores_bitwise(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 2, "partners-1")
    trained = run_ranks(6, train, *args, 3, timeout_s=TIMEOUT)
    status = trained[0]["status"]
    assert status["redundancy"] == "partners(n=1)" and status["protected"] == 3
    held = os.path.join(host_dir(base, 2), "run", ".redundancy", "step-3")
    assert sorted(os.listdir(held)) == sorted(  # host 2 holds host 1's ranks (2, 3)
        ["copy-r00002", "copy-r00003", "held-r00004.json", "held-r00005.json",
         "protected-r00004.json", "protected-r00005.json"])
    _wipe(base, 1)
    restored = run_ranks(6, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 3)
    sources = [r["how"]["source"] for r in restored]
    assert sources == ["own", "own", "partner", "partner", "own", "own"]
    assert all(r["how"]["tier"] == 0 and r["how"]["skipped"] == [] for r in restored)


def _cli_shows_protection(monkeypatch: Any, capsys: Any, base: str, disk: str) -> None:
    """``ckptio status`` and ``ckptio ls`` on host 3: its rank's steps, step 3 protected."""
    from ckptio.cli import main

    monkeypatch.setenv("CKPTIO_SHM_DIR", host_dir(base, 3))
    assert main(["status", "shm://run", disk]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["tier", "0", "shm://run/r00003", "committed", "2", "3",
                                "protected", "3", "(parity(k=3))"]
    assert [line.split()[2] for line in lines[1:]] == [f"{disk}/r{r:05d}" for r in range(4)]
    assert main(["ls", "shm://run/r00003", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["protected"] == [{"step": 3, "how": "parity(k=3)"}]
    assert main(["ls", "shm://run/r00003"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "  protected across hosts: step 3 (parity(k=3))")


def test_parity_wipe_one_of_four_hosts_rebuilds_bitwise(base, tmp_path, monkeypatch, capsys):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-3")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)
    # group 0 = hosts 0-2, its parity on host 3; group 1 = host 3, its parity on host 2
    assert glob.glob(os.path.join(host_dir(base, 3), "run/.redundancy/step-3/parity-g0-l0.bin"))
    assert glob.glob(os.path.join(host_dir(base, 2), "run/.redundancy/step-3/parity-g1-l0.bin"))
    assert not glob.glob(os.path.join(host_dir(base, 0), "run/.redundancy/step-3/parity-*"))
    assert trained[0]["status"]["protected"] == 3
    assert trained[0]["status"]["redundancy"] == "parity(k=3)"
    _cli_shows_protection(monkeypatch, capsys, base, disk)
    _wipe(base, 1)
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 3)
    assert [r["how"]["source"] for r in restored] == ["own", "parity", "own", "own"]


# ------------------------------------------------------------------ damaged copies, detected


def _flip_first_data_byte(directory: str) -> str:
    victim = sorted(glob.glob(os.path.join(directory, "data-*.bin")))[0]
    with open(victim, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim


def test_corrupted_partner_copy_is_detected_and_the_next_partner_used(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "partners-2")
    trained = run_ranks(3, train, *args, 3, timeout_s=TIMEOUT)
    _wipe(base, 0)  # rank 0's copies: host 1 (first partner), host 2 (second)
    _flip_first_data_byte(os.path.join(host_dir(base, 1), "run/.redundancy/step-3/copy-r00000"))
    restored = run_ranks(3, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 3)
    assert [r["how"]["source"] for r in restored] == ["partner", "own", "own"]
    for r in restored:  # every rank names the copy it passed over and why
        (skipped,) = r["how"]["skipped"]
        assert "the partner copy of rank 0, step 3, held by rank 1 on host 1" in skipped
        assert "CorruptCheckpointError" in skipped and "checksum" in skipped


def test_corrupted_parity_block_is_detected_and_the_disk_used(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-3")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)  # the disk holds step 2
    _wipe(base, 2)
    block = os.path.join(host_dir(base, 3), "run/.redundancy/step-3/parity-g0-l0.bin")
    with open(block, "r+b") as f:
        f.seek(100)
        f.write(b"\x5a")
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == ["own", "own", "disk", "own"]
    for r in restored:
        assert any("parity block of group 0 (local rank 0), step 3, held by rank 3" in s
                   and "corrupted" in s for s in r["how"]["skipped"])
    (message,) = [w for w in restored[2]["warnings"] if "restored step 2" in w]
    assert "hosts lost: host 2 (host2, rank 2)" in message and "parity(k=3)" in message


# ------------------------------------------------------------------ beyond what it protects


def test_two_hosts_lost_in_one_parity_group_fall_back_to_disk(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-3")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)
    _wipe(base, 0)
    _wipe(base, 1)
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)  # the disk's newest step, on every rank
    assert [r["how"]["source"] for r in restored] == ["disk", "disk", "own", "own"]
    for r in restored:
        (message,) = [w for w in r["warnings"] if "restored step 2" in w]
        assert ("no newer step could be obtained in the memory of every rank (hosts lost: "
                "host 0 (host0, rank 0), host 1 (host1, rank 1); parity(k=3)") in message


def test_kill_during_parity_encoding_leaves_the_previous_protected_step(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-3")
    with pytest.raises(RanksFailed):  # every rank SIGKILLed while step 3's parity is encoded
        run_ranks(4, train, *args, 3, 3, timeout_s=TIMEOUT)
    for host in range(4):  # step 3 is in every memory, its protection never committed
        step3 = os.path.join(host_dir(base, host), "run/.redundancy/step-3")
        assert os.path.isdir(os.path.join(host_dir(base, host), f"run/r{host:05d}/step-3"))
        assert not glob.glob(os.path.join(step3, "protected-*"))
    trained = [{"saved": replay(rank, 3)} for rank in range(4)]  # what the run saved (seeded)
    _wipe(base, 1)
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == ["own", "parity", "own", "own"]
