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
from typing import Any

import pytest
import torch

import ckptio
from ckptio.errors import CkptError
from ckptio.testing.rank_processes import RanksFailed, run_ranks
from ckptio.redundancy.budget import CHUNK
from ckptio.redundancy.topology import Topology
from tests.redundancy_cases import (
    restore_rebuild_raises,
    host_dir,
    wipe_host,
    calls_after_destroy,
    group_destroyed,
    peer_dies,
    replay,
    save_paced,
    steps_past_a_frozen_peer,
    restore,
    restore_broken,
    restore_paced,
    restore_deltas,
    restore_racks,
    train,
    train_budget,
    train_burst,
    train_deltas,
    train_racks,
)

TIMEOUT = 240


@pytest.fixture
def base(hosts_base: str) -> str:
    return hosts_base


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



def _check_restored(trained: list[Any], restored: list[Any], step: int) -> None:
    for rank, (t, r) in enumerate(zip(trained, restored)):
        assert r["step"] == step and r["state_step"] == step, (rank, r["step"], r["how"])
        _same(r["got"], t["saved"][step], f"rank {rank}")


# ------------------------------------------------------------------ topology (no ranks)


@pytest.mark.parametrize("spec", ["partners-1", "parity-2", "parity2-1"])
def test_the_protection_budget_holds_each_hosts_send_rate(base, tmp_path, spec):
    """3 hosts of one rank, 12 MiB each, a budget of 24 MB/s per host: every rank's protection
    takes at least what its bytes cost at that rate (measured here; unpaced, the same bytes
    cross this machine's loopback in a fraction of it), and a lost host restores bitwise from
    what was sent in paced chunks."""
    disk, rate, mib = str(tmp_path / "disk"), 24e6, 12
    saved = run_ranks(3, save_paced, base, disk, spec, mib, rate, timeout_s=TIMEOUT)
    for s in saved:
        assert s["status"]["protected"] == 1 and s["status"]["redundancy"].endswith(
            f", rate={rate:g})"), s["status"]
        floor = 0.9 * (s["nbytes"] - CHUNK) / rate  # every chunk but the first waits its turn
        assert s["seconds"] >= floor, f"{s['nbytes']} B protected in {s['seconds']:.3f} s: " \
            f"faster than {rate:g} B/s allows ({floor:.3f} s)"
    wipe_host(base, 1)
    restored = run_ranks(3, restore_paced, base, disk, spec, mib, rate, timeout_s=TIMEOUT)
    assert [r["step"] for r in restored] == [1, 1, 1]
    assert [r["digest"] for r in restored] == [s["digest"] for s in saved]
    assert restored[1]["how"]["source"] == ("partner" if spec.startswith("partners") else "parity")


def test_a_protection_budget_must_be_a_positive_rate():
    for bad in (0, -1.0, "fast", True):
        with pytest.raises(CkptError, match="rate="):
            ckptio.Partners(1, rate=bad)
        with pytest.raises(CkptError, match="rate="):
            ckptio.Parity(k=2, rate=bad)
    assert ckptio.Parity(k=2, rate=2e8).describe() == "parity(k=2, rate=2e+08)"
    assert ckptio.Partners(1).describe() == "partners(n=1)"


def test_topology_rules_and_refusals():
    topo = Topology.from_ids(["a", "a", "b", "b", "c", "c", "d", "d"])
    assert topo.size == 4 and topo.local_size == 2 and topo.hosts[1] == (2, 3)
    assert topo.partners(1, 1) == [3] and topo.partners(7, 2) == [1, 3]  # (h+j) mod H, same local
    assert topo.partnered(1, 1) == [7]
    # parity groups of k + 1 hosts, each holding one piece: 4 hosts, k = 3 -> one group
    assert topo.groups(3) == [(0, 1, 2, 3)] and topo.groups(1) == [(0, 1), (2, 3)]
    with pytest.raises(CkptError, match=r"at least 5 hosts: use Parity\(k\) with k <= 3"):
        topo.groups(4)
    assert topo.groups(2) == [(0, 1, 2, 3)]  # the host left over joins: k' = 3, 1.33x <= 1.5x
    assert Topology.from_ids("abc").groups(2) == [(0, 1, 2)]
    assert Topology.from_ids("abcdefg").groups(2) == [(0, 1, 2, 3), (4, 5, 6)]
    assert Topology.from_ids("abcdef").groups(3) == [(0, 1, 2, 3, 4, 5)]
    for hosts in range(2, 14):  # any count: groups of k+1 .. 2k+1 hosts, never above 1 + 1/k
        for k in range(1, hosts):
            sizes = [len(g) for g in Topology.from_ids([str(h) for h in range(hosts)]).groups(k)]
            assert sum(sizes) == hosts and all(k + 1 <= m <= 2 * k + 1 for m in sizes)
    for n in range(2, 6):  # piece i of position h goes into P_j of another position, and back
        for h in range(n):
            covering = [Topology.holder_of(i, h, n) for i in range(n - 1)]
            assert h not in covering and len(set(covering)) == n - 1
            assert [Topology.contributed(j, h, n) for j in covering] == list(range(n - 1))
    for n in range(3, 8):  # two parity pieces: stripe j's P on j, Q on j + 1, data elsewhere
        for h in range(n):
            covering = [Topology.holder_of(i, h, n) for i in range(n - 2)]
            assert not {h, (h - 1) % n} & set(covering) and len(set(covering)) == n - 2
        for j in range(n):
            assert Topology.stripe_parity(j, n, 2) == [j, (j + 1) % n]
            data = Topology.stripe_data(j, n, 2)
            assert sorted(h for h, _i in data) == sorted(set(range(n)) - {j, (j + 1) % n})
    assert topo.groups(2, 2) == [(0, 1, 2, 3)] and topo.groups(1, 2) == [(0, 1, 2, 3)]
    with pytest.raises(CkptError, match=r"at least 5 hosts: use Parity\(k, m=2\) with k <= 2"):
        topo.groups(3, 2)
    with pytest.raises(CkptError, match=r"m=3.*1 \(survives one lost host per group\) or 2"):
        ckptio.Parity(k=2, m=3)
    assert ckptio.Parity(k=3, m=2).describe() == "parity(k=3, m=2)"
    with pytest.raises(CkptError, match="at most Partners"):
        topo.partners(0, 4)
    one = Topology.from_ids(["a", "a"])  # one host: no value of n or k fits; none is suggested
    for refused in (lambda: one.partners(0, 1), lambda: one.groups(1)):
        with pytest.raises(CkptError, match=r"one host \(a\).* at least 2 hosts") as caught:
            refused()
        assert "Partners(0)" not in str(caught.value) and "k <= 0" not in str(caught.value)
    with pytest.raises(CkptError, match="same number of ranks on every host"):
        Topology.from_ids(["a", "a", "b"])
    with pytest.raises(CkptError, match="redundancy protects a memory tier"):
        ckptio.Tier("/tmp/x", redundancy=ckptio.Partners(1))
    with pytest.raises(CkptError, match="only the first tier"):
        ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://a"), ckptio.Tier(
            "shm://b", redundancy=ckptio.Parity(2))])
    with pytest.raises(CkptError, match="Parity"):
        ckptio.Parity(k=0)


def test_failure_domains_interleave_the_hosts_or_are_refused():
    """CKPTIO_FAILURE_DOMAIN: hosts numbered with the racks interleaved, so each rank's partner
    and each parity group's hosts are in other racks; a group that cannot be spread is refused
    naming the hosts and their rack; domains given by some hosts only, or differing within a
    host, are refused."""
    topo = Topology.from_ids(list("abcd"), ["r1", "r1", "r2", "r2"])
    assert topo.ids == ("a", "c", "b", "d") and topo.domains == ("r1", "r2", "r1", "r2")
    assert topo.partners(0, 1) == [2] and topo.partners(2, 1) == [1]  # a -> c, c -> b
    topo.check_domains(topo.partner_groups(1), "ckptio.Partners(1)")
    topo.check_domains(topo.groups(1), "ckptio.Parity(k=1)")  # (a, c), (b, d)
    with pytest.raises(CkptError, match=r"Parity\(k=3\): host 0 \(a, rank 0, domain r1\) and "
                       r"host 2 \(b, rank 1, domain r1\).*2 domain\(s\) for 4 hosts"):
        topo.check_domains(topo.groups(3), "ckptio.Parity(k=3)")
    with pytest.raises(CkptError, match="in one failure domain"):
        topo.check_domains(topo.partner_groups(2), "ckptio.Partners(2)")
    uneven = Topology.from_ids(list("abcdef"), ["r1", "r1", "r1", "r2", "r2", "r3"])
    assert uneven.domains == ("r1", "r2", "r1", "r2", "r1", "r3")
    uneven.check_domains(uneven.partner_groups(1), "ckptio.Partners(1)")
    plain = Topology.from_ids(list("abcd"), ["", "", "", ""])  # none given: rank order
    assert plain.ids == ("a", "b", "c", "d") and plain.domains == ()
    plain.check_domains(plain.groups(3), "ckptio.Parity(k=3)")
    with pytest.raises(CkptError, match="CKPTIO_FAILURE_DOMAIN: host b .* on none"):
        Topology.from_ids(list("abcd"), ["r1", "", "r2", "r2"])
    with pytest.raises(CkptError, match=r"host a \(ranks 0-1\) gives \['r1', 'r2'\]"):
        Topology.from_ids(list("aabb"), ["r1", "r2", "r2", "r2"])


# ------------------------------------------------------------------ a lost host, restored


@pytest.mark.parametrize("racks", [2, 0], ids=["domains", "no-domains"])
def test_a_lost_rack_with_failure_domains_restores_from_memory(base, tmp_path, racks):
    """4 hosts in 2 racks (hosts 0-1, 2-3), Partners(1), 3 steps; then both hosts of rack 0
    are wiped. With the racks given, each rank's copy is in the other rack: every rank is back
    at step 3 from memory, bitwise. Without them (the control), rank 0's copy was on host 1,
    lost with it: the job goes back to the disk tier's step 2 (ranks 2-3 still hold it in
    memory)."""
    disk = str(tmp_path / "disk")
    trained = run_ranks(4, train_racks, base, disk, racks, "partners-1", 3, timeout_s=TIMEOUT)
    wipe_host(base, 0)
    wipe_host(base, 1)
    restored = run_ranks(4, restore_racks, base, disk, racks, "partners-1", timeout_s=TIMEOUT)
    if racks:
        _check_restored(trained, restored, 3)
        assert [r["how"]["source"] for r in restored] == ["partner", "partner", "own", "own"]
        assert all(r["how"]["tier"] == 0 for r in restored)
    else:
        _check_restored(trained, restored, 2)
        assert [r["how"]["tier"] for r in restored] == [1, 1, 0, 0]  # ranks 2-3: own memory


def test_protection_behind_skips_to_the_newest_step_then_restores_it(base, tmp_path):
    """Five saves back to back while each protection pauses 1 s: the ranks agree on the newest
    step they all have queued, the older queued ones are superseded (not protected one by
    one), the newest is protected, and a lost host restores it bitwise from parity."""
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-2")
    trained = run_ranks(3, train_burst, *args, 5, 1.0, timeout_s=TIMEOUT)
    for t in trained:
        s = t["status"]
        assert s["protected"] == 5 and s["unprotected"] == [] and s["protect_error"] is None
        assert 3 <= s["superseded"] <= 4, s  # round 1 takes a step <= 5, round 2 takes 5
    assert len({t["status"]["superseded"] for t in trained}) == 1  # the same steps everywhere
    steps = sorted(os.listdir(os.path.join(host_dir(base, 0), "run", ".redundancy")))
    assert steps == ["step-5"]
    wipe_host(base, 1)
    restored = run_ranks(3, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 5)
    assert [r["how"]["source"] for r in restored] == ["own", "parity", "own"]


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
    wipe_host(base, 1)
    restored = run_ranks(6, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 3)
    sources = [r["how"]["source"] for r in restored]
    assert sources == ["own", "own", "partner", "partner", "own", "own"]
    assert all(r["how"]["tier"] == 0 and r["how"]["skipped"] == [] for r in restored)
    # a rank's step of whole tensors (its own plain state) is a piece that loads anywhere
    step = ckptio.load(os.path.join(host_dir(base, 0), "run", "r00001", "step-3"))
    assert step["step"] == 3


def test_deltas_with_partners_survive_a_lost_host_bitwise(base, tmp_path):
    """delta=True, compression="zstd", keep_best=1, save_interval_s with Partners(1), 3 hosts:
    step 1 full, 2..4 deltas against it. Host 1's memory is lost: the protection kept step 1's
    copy beside step 4's (a delta's base), so the partner copies of step 1 then step 4 come
    back, step 4 verified against its base: every rank gets step 4 from memory, bit for bit."""
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "partners-1")
    trained = run_ranks(3, train_deltas, *args, 4, timeout_s=TIMEOUT)
    own = os.path.join(host_dir(base, 0), "run", "r00000")
    with open(os.path.join(own, "step-4", "manifest.json")) as f:
        assert "step-1" in f.read()  # step 4 is a delta against step 1
    assert sorted(os.listdir(os.path.join(disk, "r00001"))) == ["step-1", "step-2", "step-4"]
    # keep_best=1 by loss kept step 2 in memory beside keep_last=2 (3, 4) and their base (1)
    assert sorted(os.listdir(own)) == ["step-1", "step-2", "step-3", "step-4"]
    wipe_host(base, 1)
    restored = run_ranks(3, restore_deltas, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 4)
    assert [r["how"]["tier"] for r in restored] == [0, 0, 0]
    assert [r["how"]["source"] for r in restored] == ["own", "partner", "own"]
    assert not any("restored step" in w for r in restored for w in r["warnings"])


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
    assert main(["ls", "shm://run"]) == 0  # the parent: one line per rank directory here
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("shm://run: 1 rank directory(ies), each rank's own steps")
    assert lines[2].split()[:4] == ["r00003", "2,", "3", "0"] and lines[2].endswith("  3")
    assert lines[-1] == "one rank's steps: ckptio ls shm://run/r00003"
    assert main(["ls", disk, "--json"]) == 0  # the disk tier: every rank's directory
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ckptio.ranks/1"
    assert [r["location"] for r in doc["ranks"]] == [f"{disk}/r{r:05d}" for r in range(4)]


def _shard_nbytes(base: str, host: int, rank: int, step: int) -> int:
    """The bytes of rank ``rank``'s step stream: its data files (what parity covers)."""
    step_dir = os.path.join(host_dir(base, host), f"run/r{rank:05d}/step-{step}")
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(step_dir, "data-*")))


def _assert_parity_memory(base: str, hosts: int, per_host: int, k: int, step: int,
                          m: int = 1) -> None:
    """Every host holds, per local rank, m parity pieces of ceil(shard / k) bytes (rounded up
    to 8) and a small JSON: 1 + m/k of the state, with no host holding more."""
    longest = max(_shard_nbytes(base, r // per_host, r, step) for r in range(hosts * per_host))
    piece = m * -(-longest // k)
    for host in range(hosts):
        held = os.path.join(host_dir(base, host), f"run/.redundancy/step-{step}")
        bins = sorted(glob.glob(os.path.join(held, "*.bin")))
        assert [os.path.basename(b) for b in bins] == [
            f"parity-g0-l{local}.bin" for local in range(per_host)], bins
        for b in bins:
            assert piece <= os.path.getsize(b) <= piece + 7 * m, (b, os.path.getsize(b), longest)
        extra = sum(os.path.getsize(os.path.join(held, n)) for n in os.listdir(held)
                    if not n.endswith(".bin"))
        assert extra < 64 * 1024, (held, extra)  # manifests and markers only


def test_parity_wipe_one_of_four_hosts_rebuilds_bitwise(base, tmp_path, monkeypatch, capsys):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-3")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)
    _assert_parity_memory(base, 4, 1, 3, 3)  # one group of 4 hosts, each 1/3 of a shard
    assert trained[0]["status"]["protected"] == 3
    assert trained[0]["status"]["redundancy"] == "parity(k=3)"
    _cli_shows_protection(monkeypatch, capsys, base, disk)
    wipe_host(base, 1)
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 3)
    assert [r["how"]["source"] for r in restored] == ["own", "parity", "own", "own"]
    assert all(r["how"]["lost_hosts"] == ["host 1 (host1, rank 1)"] for r in restored)


def test_parity_wipe_one_of_three_hosts_k2_rebuilds_bitwise(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-2")
    trained = run_ranks(3, train, *args, 3, timeout_s=TIMEOUT)
    _assert_parity_memory(base, 3, 1, 2, 3)  # 3 hosts, k = 2: 1.5x
    wipe_host(base, 2)
    restored = run_ranks(3, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 3)
    assert [r["how"]["source"] for r in restored] == ["own", "own", "parity"]


def test_parity_five_hosts_k2_one_group_of_five_rebuilds_bitwise(base, tmp_path):
    """5 hosts, k = 2: not a multiple of k + 1, so one group of 5 (k' = 4): each host holds a
    quarter of a shard (<= 1 + 1/k), and a lost host is rebuilt from 4 pieces."""
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-2")
    trained = run_ranks(5, train, *args, 2, timeout_s=TIMEOUT)
    _assert_parity_memory(base, 5, 1, 4, 2)
    wipe_host(base, 3)
    restored = run_ranks(5, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == ["own"] * 3 + ["parity", "own"]


def test_parity_two_ranks_per_host_rebuilds_each_local_rank(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 2, "parity-2")  # hosts {0, 1, 2}: one group, per local rank
    trained = run_ranks(6, train, *args, 2, timeout_s=TIMEOUT)
    _assert_parity_memory(base, 3, 2, 2, 2)
    wipe_host(base, 0)
    restored = run_ranks(6, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == ["parity"] * 2 + ["own"] * 4


def _damage_block(base: str, host: int, step: int) -> None:
    """One byte of ``host``'s parity block of ``step`` changed."""
    block = os.path.join(host_dir(base, host), f"run/.redundancy/step-{step}/parity-g0-l0.bin")
    with open(block, "r+b") as f:
        f.seek(100)
        f.write(b"\x5a")


def _names_damaged_block(restored: list[Any], rank: int, step: int) -> None:
    """Every rank names the block it passed over, and why."""
    for r in restored:
        assert any(f"parity piece of group 0 (local rank 0), step {step}, held by rank {rank}"
                   in s and "corrupted" in s for s in r["how"]["skipped"]), r["how"]["skipped"]


@pytest.mark.parametrize(("hosts", "k", "lost"), [(5, 3, (1, 3)), (4, 2, (0, 1))],
                         ids=["k3-five-hosts-two-apart", "k2-four-hosts-two-adjacent"])
def test_two_parity_wipe_two_hosts_of_a_group_rebuilds_bitwise(base, tmp_path, hosts, k, lost):
    """Parity(k, m=2): each host holds P of one stripe and Q of the one before (2/k of a shard:
    1 + 2/k in all); two hosts of the group wiped (apart; adjacent: a stripe whose P and Q are
    both lost, and stripes with one data piece and P lost, rebuilt from Q) are rebuilt."""
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, f"parity2-{k}")
    trained = run_ranks(hosts, train, *args, 2, timeout_s=TIMEOUT)
    _assert_parity_memory(base, hosts, 1, k, 2, m=2)
    assert trained[0]["status"]["redundancy"] == f"parity(k={k}, m=2)"
    for host in lost:
        wipe_host(base, host)
    restored = run_ranks(hosts, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == [
        "parity" if h in lost else "own" for h in range(hosts)]


def test_two_parity_rebuilds_past_a_damaged_block_and_a_third_loss_uses_the_disk(base,
                                                                                 tmp_path):
    """Parity(2, m=2) on 4 hosts: host 2 wiped and host 3's block damaged: two erasures, still
    rebuilt from memory (the damaged block named); then hosts 0, 1 and 2 wiped: three of the
    group's four, more than m: every rank falls back to the disk's step."""
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity2-2")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)  # the disk holds step 2
    wipe_host(base, 2)
    _damage_block(base, 3, 3)
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 3)
    assert [r["how"]["source"] for r in restored] == ["own", "own", "parity", "own"]
    _names_damaged_block(restored, 3, 3)
    for host in (0, 1, 2):
        wipe_host(base, host)
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == ["disk", "disk", "disk", "own"]


# ------------------------------------------------------------------ damaged copies, detected


def _flip_first_data_byte(directory: str) -> str:
    victim = min(glob.glob(os.path.join(directory, "data-*.bin")))
    with open(victim, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    return victim


def test_corrupted_partner_copy_is_detected_and_the_next_partner_used(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "partners-2")
    trained = run_ranks(3, train, *args, 3, timeout_s=TIMEOUT)
    wipe_host(base, 0)  # rank 0's copies: host 1 (first partner), host 2 (second)
    _flip_first_data_byte(os.path.join(host_dir(base, 1), "run/.redundancy/step-3/copy-r00000"))
    restored = run_ranks(3, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 3)
    assert [r["how"]["source"] for r in restored] == ["partner", "own", "own"]
    for r in restored:  # every rank names the copy it passed over and why
        (skipped,) = r["how"]["skipped"]
        assert "the partner copy of rank 0, step 3, held by rank 1 on host 1" in skipped
        assert "CorruptCheckpointError" in skipped and "checksum" in skipped


def test_corrupted_parity_piece_is_detected_and_the_disk_used(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-3")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)  # the disk holds step 2
    wipe_host(base, 2)  # its rebuild needs every other host's piece, host 3's damaged
    _damage_block(base, 3, 3)
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == ["own", "own", "disk", "own"]
    _names_damaged_block(restored, 3, 3)
    (message,) = [w for w in restored[2]["warnings"] if "restored step 2" in w]
    assert "hosts lost: host 2 (host2, rank 2)" in message and "parity(k=3)" in message


# ------------------------------------------------------------------ beyond what it protects


def test_a_rebuild_that_raises_a_bug_on_one_rank_falls_back_on_every_rank_at_once(base,
                                                                                 tmp_path):
    """Rank 1 is rebuilt from parity and rank 2's share of the decode (its part of a lost piece
    summed into what it passes on) raises a RuntimeError (not a CkptError): the chain still
    completes, every rank hears of it in the same gather and restores the disk's step within
    seconds (never a wait up to step_timeout_s)."""
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-3")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)  # the disk holds step 2
    wipe_host(base, 1)
    restored = run_ranks(4, restore_rebuild_raises, *args, 2, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == ["own", "disk", "own", "own"]
    assert all(r["seconds"] < 60 for r in restored), [r["seconds"] for r in restored]
    (message,) = [w for w in restored[1]["warnings"] if "restored step 2" in w]
    assert "RuntimeError: injected: the decode failed" in message, message
    # the rank rebuilt received into its tier's scratch directory in place: gone again
    assert not glob.glob(os.path.join(host_dir(base, 1), "run", "r00001", ".rebuild-*"))


def test_two_hosts_lost_in_one_parity_group_fall_back_to_disk(base, tmp_path):
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "parity-3")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)
    wipe_host(base, 0)
    wipe_host(base, 1)
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
    wipe_host(base, 1)
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    _check_restored(trained, restored, 2)
    assert [r["how"]["source"] for r in restored] == ["own", "parity", "own", "own"]


# ------------------------------------------------------------------ failures: a clear error, no wait


def test_a_rank_whose_load_raises_makes_every_rank_raise_naming_it(base, tmp_path):
    """Rank 1's state does not fit the step (not damage): every rank raises RankFailedError
    naming rank 1 and its error within seconds (step_timeout_s is 30 min)."""
    disk = str(tmp_path / "disk")
    args = (base, disk, 1, "partners-1")
    run_ranks(3, train, *args, 2, timeout_s=TIMEOUT)
    got = run_ranks(3, restore_broken, *args, 1, timeout_s=TIMEOUT)
    for rank, r in enumerate(got):
        kind, _, message = r["error"].partition("|")
        assert kind == "RankFailedError", (rank, r["error"])
        assert message.startswith(f"restore on rank {rank}: loading step 2 from memory failed on "
                                  "1 rank(s): rank 1: StateMismatchError: "), message
        assert r["seconds"] < 30, (rank, r["seconds"])


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_peer_lost_during_protection_fails_it_naming_the_peer_within_the_bound(base, tmp_path,
                                                                                 how):
    """Parity(k=2) on 3 hosts, rank 2 SIGKILLed (its connections close) or SIGSTOPped (it never
    answers) while step 2 is protected: the survivors' protection fails with RankFailedError
    naming rank 2 within peer_timeout_s (+ slack), not after step_timeout_s (30 min); status()
    shows it, close() returns at once, step 1 stays the protected step."""
    got = run_ranks(3, peer_dies, base, str(tmp_path / "disk"), "parity-2", 2, 3.0, how,
                    timeout_s=TIMEOUT, may_die=[2])
    assert got[2] is None
    for rank in (0, 1):
        r = got[rank]
        kind, _, message = r["error"].partition("|")
        assert kind == "RankFailedError", (rank, r["error"])
        assert "protecting step 2 across hosts failed receiving a parity piece from rank 2 on " \
               "host 2 (host2, rank 2)" in message and "peer_timeout_s=3 s" in message, message
        assert r["seconds"] < 3.0 + 10, (rank, r["seconds"])
        assert r["status"]["protected"] == 1 and "rank 2" in r["status"]["protect_error"]
        assert r["close_seconds"] < 10, (rank, r["close_seconds"])


def test_a_group_destroyed_during_the_protection_fails_close_with_a_ckpterror(base, tmp_path):
    """Partners(1) on 2 hosts: each rank destroys the process group while step 2's protection
    is in flight (a loop's recovery after a peer died). close() raises RankFailedError saying
    so (torch's ValueError for a destroyed group used to escape it), blaming no peer, at once;
    step 1 stays the protected step."""
    got = run_ranks(2, group_destroyed, base, str(tmp_path / "disk"), "partners-1",
                    timeout_s=TIMEOUT, destroy=False)
    for rank in (0, 1):
        kind, _, message = got[rank]["error"].partition("|")
        assert kind == "RankFailedError", (rank, got[rank]["error"])
        assert f"rank {rank}: protecting step 2 across hosts failed" in message, message
        assert "destroyed the process group (destroy_process_group)" in message, message
        assert "ValueError" in message and "Step 2 is not protected" in message, message
        assert got[rank]["seconds"] < 10, got[rank]
        assert got[rank]["status"]["protected"] == 1, got[rank]["status"]


def test_the_old_manager_after_destroy_process_group_raises_only_ckpterrors(base, tmp_path):
    """Partners(1) on 2 hosts, step 1 protected, then every rank destroys the process group (a
    loop's in-process recovery, which then makes a new manager): the old manager's steps()
    still lists (its own groups), restore() raises RankFailedError naming torch's error, close()
    returns; no torch error escapes any of them, and none hangs."""
    got = run_ranks(2, calls_after_destroy, base, str(tmp_path / "disk"), "partners-1",
                    timeout_s=TIMEOUT, destroy=False)
    for rank in (0, 1):
        assert got[rank]["steps"] == "", (rank, got[rank]["steps"])
        kind, _, message = got[rank]["restore"].partition("|")
        assert kind == "RankFailedError", (rank, got[rank]["restore"])
        assert "Default process group has not been initialized" in message, message
        assert got[rank]["close"] == "", (rank, got[rank]["close"])
        assert max(got[rank][f"{call}_seconds"] for call in ("steps", "restore", "close")) < 10


def test_steps_with_a_frozen_peer_fail_naming_the_bound_within_peer_timeout_s(base, tmp_path):
    """Partners(1) on 3 hosts, rank 2 frozen (SIGSTOP) when the others call latest(): they
    raise RankFailedError within peer_timeout_s (+ slack) instead of waiting step_timeout_s
    (30 min), saying what to check."""
    got = run_ranks(3, steps_past_a_frozen_peer, base, str(tmp_path / "disk"), "partners-1",
                    3.0, timeout_s=TIMEOUT, may_die=[2])
    for rank in (0, 1):
        kind, _, message = got[rank]["error"].partition("|")
        assert kind == "RankFailedError", (rank, got[rank]["error"])
        assert f"rank {rank}: listing the steps every rank holds" in message, message
        assert "peer_timeout_s=3 s" in message and "restart the job" in message, message
        assert got[rank]["seconds"] < 3.0 + 10, got[rank]


# ------------------------------------------------------------------ the memory budget


@pytest.mark.parametrize("spec", ["partners-1", "parity-1"])
def test_memory_budget_counts_the_copies_held_for_other_hosts(base, tmp_path, spec):
    """2 hosts, keep_last=2, Partners(1) or Parity(k=1) (a 2-host group: each host's parity
    piece is a whole shard): with what each rank holds for the other host (and the new step's,
    written before the older one is removed), step 3 needs 5 steps' bytes; max_bytes = 4.5
    steps (own steps alone: 3) refuses it, naming the copies/parity."""
    disk = str(tmp_path / "disk")
    probe = run_ranks(2, train_budget, base + "-probe", disk + "-probe", spec, 1 << 30,
                      3, timeout_s=TIMEOUT)
    shutil.rmtree(base + "-probe", ignore_errors=True)
    assert [p["saved"] for p in probe] == [[1, 2, 3]] * 2
    step = max(p["step_nbytes"] for p in probe)
    got = run_ranks(2, train_budget, base, disk, spec, int(4.5 * step), 4, timeout_s=TIMEOUT)
    how = "partners(n=1)" if spec == "partners-1" else "parity(k=1)"
    for r in got:
        assert r["saved"] == [1, 2], r
        assert "does not fit" in r["error"] and "of copies/parity for other hosts" in r["error"]
        assert f"redundancy={how}" in r["error"], r["error"]


def test_a_parity_group_that_cannot_be_spread_over_the_racks_is_refused(base, tmp_path):
    """Parity(k=3) over 4 hosts in 2 racks: one group of 4 hosts needs 4 racks. Every rank's
    manager refuses at construction, naming two hosts of one rack; nothing is saved."""
    disk = str(tmp_path / "disk")
    with pytest.raises(RanksFailed, match=r"Parity\(k=3\): host \d .*domain rack0\) and host "
                       r"\d .*domain rack0\).*2 domain\(s\) for 4 hosts"):
        run_ranks(4, train_racks, base, disk, 2, "parity-3", 1, timeout_s=TIMEOUT)
    assert not os.path.exists(disk)
