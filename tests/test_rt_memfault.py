"""A demanding user of the host-memory tier and its redundancy across hosts, under faults, with
real processes (gloo ranks each playing a host: tests/redundancy_cases.py; SIGKILL).

- A job killed while its drain copies a step to the disk tier, the disk tier keeping every
  tenth step for good (keep_every) and that step still only in memory: the next start copies
  it before the newest step due (before: only the newest was copied, the memory tier's
  retention then dropped the kept-for-good step, lost for good without a word).
- A memory tier's max_bytes sized as its refusal advises (keep_last steps plus the one being
  saved): after a restart restores from memory, the restored step (kept beyond keep_last until
  a newer one is verified) gives way to the third save, with a warning (before: that save was
  refused, and again 3 saves after every restart).
- Managers with redundancy made and closed one after another in one job (an EMA's manager, a
  manager per phase): each close destroys the gloo groups its manager made (before: four
  process groups, with their sockets, pipes and threads, stayed per manager, for good).
- A script that ends without close() (the manager's exit hook says so): the memory tier's
  slots (dropped steps' data files kept for the next saves) are removed at exit (before: a
  step's worth of host memory stayed in /dev/shm, hidden from every listing, for good).
- A rank SIGKILLed while it sends its part of a lost rank's rebuild: every other rank's
  RankFailedError names it and its host (before: "a rank of the job died", which one unsaid).
- A peer frozen (SIGSTOP) while the others call latest(): their RankFailedError names it and
  its host (before: "a rank died, is frozen, or does not call steps()/latest()"); a peer lost
  during a collective of the protection is named the same way.
- A parity block's record (JSON) damaged on a holder, a host lost: the restore falls back to
  the disk's step bitwise, and what it passed over names the file (before: a bare
  JSONDecodeError).
- Found sound (kept as checks): a byte flipped in a surviving rank's own memory step while
  another host is lost is caught by its checksum and never restored: the step comes from a
  partner, from parity, or the whole job falls back to an older step, bitwise.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import ckptio
from ckptio.testing.rank_processes import run_ranks
from tests.fetch_cases import restore as restore_fetch
from tests.fetch_cases import save as save_fetch
from tests.redundancy_cases import (OPTS, host_dir, restore, same_bits, steps_past_a_frozen_peer,
                                    train, wipe_host)

TIMEOUT = 240
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 1 << 20  # floats: 4 MiB a step


def _weights(step: int) -> torch.Tensor:
    return torch.rand(N, generator=torch.Generator().manual_seed(step))


def _drain_tiers(disk: str) -> list[ckptio.Tier]:
    return [ckptio.Tier("shm://run", keep_last=2),
            ckptio.Tier(disk, every=5, keep_last=1, keep_every=10)]


KILLED_WHILE_DRAINING = """
import sys, torch, ckptio
from tests.test_rt_memfault import _drain_tiers, _weights, N
state = {"w": torch.zeros(N), "step": 0}
mgr = ckptio.CheckpointManager(tiers=_drain_tiers(sys.argv[1]), drain_rate=1e6)
for step in range(1, 18):
    state["w"].copy_(_weights(step))
    state["step"] = step
    mgr.save(step, state)
print(mgr.status()[1]["draining"], mgr.status()[1]["committed"], flush=True)
import time; time.sleep(600)  # the drain of step 5 (4 s at 1 MB/s) is still running: killed
"""


EXITS_UNCLOSED = """
import torch, ckptio
from tests.test_rt_memfault import _weights, N
state = {"w": torch.zeros(N)}
mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2)])
mgr.restore(state)
for step in range(1, 6):
    state["w"].copy_(_weights(step))
    mgr.save(step, state)
print(sorted(__import__("os").listdir(mgr.directory)), flush=True)
"""


@pytest.fixture
def base(hosts_base: str) -> str:
    return hosts_base



def _flip(step_dir: str, at: int = 64) -> str:
    data = min(glob.glob(os.path.join(step_dir, "data-*")))
    with open(data, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    return data


@pytest.mark.parametrize(("spec", "hosts", "lost", "flipped"), [
    ("parity-3", 4, 2, 1), ("partners-1", 3, 0, 1), ("parity2-2", 4, 2, 0)],
    ids=["parity", "partners", "parity2"])
def test_a_flipped_byte_in_a_survivors_own_step_is_never_restored(
        base, tmp_path, spec, hosts, lost, flipped):
    """Step 3 protected (the disk holds step 2); host ``lost`` wiped and one byte of rank
    ``flipped``'s own step 3 changed in its memory: every rank restores a step bitwise (step 3
    where the redundancy still covers both, else step 2), the damaged file named."""
    args = (base, str(tmp_path / "disk"), 1, spec)
    trained = run_ranks(hosts, train, *args, 3, timeout_s=TIMEOUT)
    wipe_host(base, lost)
    damaged = _flip(os.path.join(host_dir(base, flipped), "run", f"r{flipped:05d}", "step-3"))
    restored = run_ranks(hosts, restore, *args, timeout_s=TIMEOUT)
    want = 2 if spec == "parity-3" else 3  # two erasures in a group of Parity(k=3): too many
    for rank, (t, r) in enumerate(zip(trained, restored)):
        assert r["step"] == want and r["state_step"] == want, (rank, r["how"])
        same_bits(r["got"], t["saved"][want], f"rank {rank}")
        assert any(damaged in s and "checksum" in s for s in r["how"]["skipped"]), r["how"]


def test_a_step_kept_for_good_left_in_memory_by_a_killed_drain_reaches_the_disk(shm, tmp_path):
    """Steps 1-17 saved into memory, the disk tier due every 5th step and keeping every 10th
    for good; the job is SIGKILLed while the drain still copies step 5 (step 10 waiting in
    memory for it). The next start drains step 10 and 15; step 10 reaches the disk bitwise."""
    disk = str(tmp_path / "disk")
    child = tmp_path / "child.py"
    child.write_text(KILLED_WHILE_DRAINING)
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, str(child), disk], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip() == "5 []", f"not killed mid-drain: {line!r}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
    assert os.path.isdir(os.path.join(shm, "run", "step-10"))  # only in memory
    state = {"w": torch.zeros(N), "step": -1}
    started = time.monotonic()
    with ckptio.CheckpointManager(tiers=_drain_tiers(disk)) as mgr:
        assert mgr.restore(state) == 17 and torch.equal(state["w"], _weights(17))
        assert mgr.drained(timeout=60)
        status = mgr.status()[1]
    assert time.monotonic() - started < 60
    assert status["committed"] == [10, 15], status
    with ckptio.CheckpointManager(disk) as from_disk:
        assert from_disk.restore(state, step=10) == 10
    assert torch.equal(state["w"], _weights(10)) and state["step"] == 10


def test_an_exit_without_close_leaves_no_slot_in_host_memory(shm, tmp_path):
    """Five steps saved into memory, the script ends without close(): the steps kept stay (a
    restart restores step 5 bitwise), the dropped steps' files kept for later saves do not
    (before: a step's worth of tmpfs, in a hidden directory no listing shows, for good)."""
    child = tmp_path / "child.py"
    child.write_text(EXITS_UNCLOSED)
    done = subprocess.run([sys.executable, str(child)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ".ckptio-slots" in done.stdout  # slots there while it ran
    assert "was not closed before exit" in done.stderr
    root = os.path.join(shm, "run")
    assert sorted(os.listdir(root)) == ["step-4", "step-5"]
    state = {"w": torch.zeros(N)}
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2)]) as mgr:
        assert mgr.restore(state) == 5 and torch.equal(state["w"], _weights(5))
    assert sorted(os.listdir(root)) == ["step-4", "step-5"]


def test_a_restart_keeps_saving_within_a_max_bytes_sized_for_keep_last_plus_one(shm, caplog):
    """A memory tier of keep_last=2 and max_bytes for 3.2 steps (its own refusal's advice:
    keep_last steps plus the one being saved): steps 1-5, then a restart restores step 5 from
    memory and saves steps 6-9, each within the budget; the restored step, kept beyond
    keep_last, gives way with a warning naming it (before: the save of step 8 was refused, and
    every restart after it again 3 saves later: a job that could not run)."""
    tiers = [ckptio.Tier("shm://run", keep_last=2, max_bytes=int(3.2 * N * 4))]
    state = {"w": torch.zeros(N)}
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        for step in range(1, 6):
            state["w"].copy_(_weights(step))
            mgr.save(step, state)
    state["w"].zero_()
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        assert mgr.restore(state) == 5 and torch.equal(state["w"], _weights(5))
        for step in range(6, 10):
            state["w"].copy_(_weights(step))
            mgr.save(step, state)
        assert mgr.steps() == [8, 9]
    assert any("step 5 (restored last, kept beyond keep_last=2) removed" in r.getMessage()
               for r in caplog.records)
    state["w"].zero_()
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        assert mgr.restore(state) == 9 and torch.equal(state["w"], _weights(9))


def managers_made_and_closed(rank: int, world: int, base: str, disk: str,
                             rounds: int) -> list[int]:
    """One rank per host, Partners(1): ``rounds`` managers one after the other, each restoring,
    saving two steps, protecting them and closed -> this process's open fds after each close."""
    import gc

    os.environ["CKPTIO_HOST_ID"] = f"host{rank}"
    os.environ["CKPTIO_SHM_DIR"] = host_dir(base, rank)
    os.makedirs(host_dir(base, rank), exist_ok=True)
    tiers = [ckptio.Tier("shm://run", keep_last=2, redundancy=ckptio.Partners(1)),
             ckptio.Tier(disk, every=2)]
    out = []
    for _ in range(rounds):
        mgr = ckptio.CheckpointManager(tiers=tiers, options=OPTS)
        step = mgr.restore({"w": torch.zeros(1 << 12), "step": 0}) or 0
        for s in (step + 1, step + 2):
            mgr.save(s, {"w": torch.full((1 << 12,), float(s)), "step": s})
        mgr.protected()
        mgr.close()
        del mgr
        gc.collect()
        out.append(len(os.listdir("/proc/self/fd")))
    return out


def test_managers_with_redundancy_made_and_closed_leak_no_fd(base, tmp_path):
    """Four managers in turn on 3 hosts: the fds open after the last close are no more than
    after the first (before: each manager left its groups' sockets, pipes and epolls open)."""
    got = run_ranks(3, managers_made_and_closed, base, str(tmp_path / "disk"), 4,
                    timeout_s=TIMEOUT)
    for rank, fds in enumerate(got):
        assert fds[-1] <= fds[0], (rank, fds)


def test_a_holder_killed_during_a_rebuild_is_named_by_every_other_rank(base, tmp_path):
    """Parity(k=3) on 4 hosts, host 1 lost; rank 2 SIGKILLed as it passes on its first piece of
    rank 1's rebuild: every other rank's restore raises RankFailedError naming rank 2 and its
    host within seconds (before: "a rank of the job died", whichever one)."""
    disk = str(tmp_path / "disk")
    run_ranks(4, save_fetch, base, disk, "parity", 6, timeout_s=TIMEOUT)
    wipe_host(base, 1)
    failed = run_ranks(4, restore_fetch, base, disk, "parity", 6, 2, may_die=(2,),
                       timeout_s=TIMEOUT)
    for rank in (0, 1, 3):
        error, seconds = failed[rank]["error"], failed[rank]["seconds"]
        assert error.startswith("RankFailedError: "), (rank, error)
        assert ("restoring from the memory of other hosts failed: rank 2 on host 2 (host2, "
                "rank 2) (one it exchanges") in error, (rank, error)
        assert "restart the job" in error and seconds < 30, (rank, seconds)


def test_a_frozen_peer_during_latest_is_named_by_every_other_rank(base, tmp_path):
    """Partners(1) on 3 hosts, rank 2 frozen (SIGSTOP) while the others call latest(): their
    RankFailedError names rank 2 and its host, within peer_timeout_s and a few beats (before:
    "a rank died, is frozen, or ...", which one unsaid)."""
    got = run_ranks(3, steps_past_a_frozen_peer, base, str(tmp_path / "disk"), "partners-1",
                    3.0, timeout_s=TIMEOUT, may_die=[2])
    for rank in (0, 1):
        kind, _, message = got[rank]["error"].partition("|")
        assert kind == "RankFailedError", (rank, got[rank]["error"])
        assert "within peer_timeout_s=3 s: rank 2 on host 2 (host2, rank 2) died, is frozen" \
            in message, message
        assert got[rank]["seconds"] < 3.0 + 10, got[rank]


def test_a_damaged_parity_record_is_named_by_its_file_and_the_disk_step_restored(base, tmp_path):
    """Parity(k=3) on 4 hosts, step 3 protected (the disk holds step 2); host 0 lost and host
    1's record of its parity block cut to "{": every rank restores step 2 bitwise, and what it
    passed over names that file (before: a bare JSONDecodeError, no file)."""
    args = (base, str(tmp_path / "disk"), 1, "parity-3")
    trained = run_ranks(4, train, *args, 3, timeout_s=TIMEOUT)
    wipe_host(base, 0)
    record = os.path.join(host_dir(base, 1), "run/.redundancy/step-3/parity-g0-l0.json")
    with open(record, "w", encoding="utf-8") as f:
        f.write("{")
    restored = run_ranks(4, restore, *args, timeout_s=TIMEOUT)
    for rank, (t, r) in enumerate(zip(trained, restored)):
        assert r["step"] == 2 and r["state_step"] == 2, (rank, r["how"])
        same_bits(r["got"], t["saved"][2], f"rank {rank}")
        assert any(record in s and "damaged" in s for s in r["how"]["skipped"]), r["how"]
