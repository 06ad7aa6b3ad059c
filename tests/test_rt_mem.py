"""Red-team cases of the memory tier (shm://) across kills and restarts: what a killed job
leaves in host memory, and what the next start does with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

import torch

import ckptio
from ckptio import Tier
from ckptio.managing.drain import Drain
from ckptio.options import MiB, Options
from ckptio.storage.local.mapped import SLOTS_DIR

PREPARED_CHILD = r"""
import os, signal, sys, torch, ckptio
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2),
                                      ckptio.Tier(sys.argv[1], every=2)])
mgr.prepare({"model": model}, wait=True)
print(os.getpid(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _slots(shm: str) -> list[str]:
    return sorted(os.listdir(os.path.join(shm, "run", SLOTS_DIR)))


def test_a_killed_jobs_slots_made_ahead_are_removed_by_the_next_start(shm, tmp_path):
    """Each kill after prepare() left its files made ahead (prepared.<pid>.*) in /dev/shm, not
    counted by the next start, which made its own: a job crash-looping early filled the tmpfs
    (then every first save failed with ENOSPC). The next start removes a dead process's."""
    disk = str(tmp_path / "disk")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for _ in range(2):  # a job crash-looping after its restore
        proc = subprocess.run([sys.executable, "-c", PREPARED_CHILD, disk], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        pid = proc.stdout.strip()
        assert {name.split(".")[1] for name in _slots(shm)} == {pid}, _slots(shm)
        assert len(_slots(shm)) == 3  # one file per first save, the dead start's gone
    model = torch.nn.Linear(256, 256)
    with ckptio.CheckpointManager(tiers=[Tier("shm://run", keep_last=2),
                                         Tier(disk, every=2)]) as mgr:
        mgr.prepare({"model": model}, wait=True)
        assert {name.split(".")[1] for name in _slots(shm)} == {str(os.getpid())}
        assert len(_slots(shm)) == 3
    assert not os.path.exists(os.path.join(shm, "run", SLOTS_DIR))  # close() removes them


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 128)).pow(2).mean().backward()
    opt.step()
    return model, opt


def test_a_resumed_optimizers_slots_are_made_the_size_of_its_saves(shm, tmp_path):
    """restore() made the memory tier's slots for the first saves from the state before its
    load: a torch optimizer has no state until its first step (or the load), so a resumed
    job's slots were sized for the model alone; no save could take them (its first saves
    went through the pool) and they held host memory until retention dropped a step."""
    disk = str(tmp_path / "disk")
    tiers = [Tier("shm://run", keep_last=2), Tier(disk, every=2)]
    model, opt = _trained()
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        mgr.save(1, {"model": model, "optim": opt})
    step = os.path.join(shm, "run", "step-1")
    sizes = sorted(os.path.getsize(os.path.join(step, n)) for n in os.listdir(step)
                   if n.startswith("data-"))
    fresh = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 128))
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)  # no state yet: the load makes it
    with ckptio.CheckpointManager(tiers=tiers) as mgr:
        assert mgr.restore({"model": fresh, "optim": fopt}) == 1
        mgr._levels[0].join_removal()  # the slots are made behind the restore
        slots = os.path.join(shm, "run", SLOTS_DIR)
        made = sorted(os.path.getsize(os.path.join(slots, n)) for n in os.listdir(slots))
        assert made == sorted(sizes * 3), (made, sizes)


def _removed_but_mapped(root: str) -> list[str]:
    """This process's mappings of files under ``root`` removed since (their pages held)."""
    with open("/proc/self/maps") as maps:
        return [line.split(None, 5)[-1].strip() for line in maps
                if root in line and line.rstrip().endswith("(deleted)")]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 128)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_a_slower_tier_on_tmpfs_keeps_no_slots(shm, tmp_path):
    """A slower tier in a directory on tmpfs (/tmp is one on many hosts) kept the memory
    tier's slots: files made ahead at restore, and its dropped steps' data files mapped by
    every retention pass. No drain copy takes a slot, so nothing unmapped them: each dropped
    step's pages stayed held until the tmpfs was full and every drain failed with ENOSPC."""
    disk = os.path.join(shm, "disk")  # a plain directory on a tmpfs
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    with ckptio.CheckpointManager(tiers=[Tier("shm://run", keep_last=2),
                                         Tier(disk, keep_last=2)]) as mgr:
        mgr.restore(state)
        for step in range(1, 9):
            _train(model, opt)
            mgr.save(step, state)
            assert mgr.drained(timeout=60)
            assert not os.path.exists(os.path.join(disk, SLOTS_DIR)), step
        assert _removed_but_mapped(disk) == []
        assert sorted(n for n in os.listdir(disk) if n.startswith("step-")) == ["step-7",
                                                                                 "step-8"]


def test_a_memory_tier_whose_saves_do_not_map_unmaps_the_slots_it_removed(shm):
    """A compressed (packed) save never copies into a mapped file, the only place the root's
    mappings of removed files were unmapped; every retention pass still mapped its slots
    ahead, so each slot rotated out with a dropped step stayed mapped: host memory grew by a
    step's files per save until the tmpfs was full (the save failed with ENOSPC)."""
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    with ckptio.CheckpointManager(tiers=[Tier("shm://run", keep_last=2)],
                                  compression="bytegroup+zstd") as mgr:
        for step in range(1, 13):
            _train(model, opt)
            mgr.save(step, state)
        held = _removed_but_mapped(shm)
        assert len(held) <= 2, held  # at most the slots the last pass rotated out


def test_a_drain_behind_still_copies_the_steps_a_slower_tiers_keep_every_keeps(shm, tmp_path):
    """A drain that fell behind skipped a queued step for the newest one, even a step the
    slower tier's keep_every keeps for good: Tier(disk, every=2, keep_every=4) never received
    step 4 or 8 (a log line only), and once the memory tier dropped them they were lost. They
    are copied, in order, before the newest step; the steps between them are still skipped."""
    disk = str(tmp_path / "disk")
    model, opt = _trained()
    state = {"model": model, "optim": opt}
    with ckptio.CheckpointManager(tiers=[Tier("shm://run", keep_last=2),
                                         Tier(disk, every=2, keep_last=1, keep_every=4)],
                                  drain_rate=1 << 20) as mgr:  # ~0.8 s a copy: behind
        for step in range(1, 13):
            _train(model, opt)
            mgr.save(step, state)
        assert mgr.drained(timeout=60)
        skipped = mgr.status()[1]["skipped"]
        assert skipped and not [s for s in skipped if s % 4 == 0], skipped  # it was behind
    assert sorted(os.listdir(disk)) == ["step-12", "step-4", "step-8"]
    for step in (4, 8):
        assert ckptio.verify(os.path.join(disk, f"step-{step}")) > 0


class _HeldRoute:
    """A drain Route holding every step already: records the order asked; the first ask
    waits for ``go`` (the drain busy meanwhile)."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.busy, self.go = threading.Event(), threading.Event()

    def holds(self, step: int, tier: int) -> bool:
        self.asked.append(step)
        self.busy.set()
        assert self.go.wait(30)
        return True

    def done(self, step: int) -> None:
        pass


@pytest.mark.parametrize("preempted", [False, True])
def test_the_drain_keeps_the_kept_for_good_steps_due_until_preempted(preempted):
    """Drain: with tier 1 keeping every 4th step for good, a drain behind skips step 6 but
    not 4 or 8 (pinned meanwhile, then copied in order before the newest); once the job is
    preempted (final()) only its last step is copied, as before."""
    route = _HeldRoute()
    drain = Drain(route, [1, 2], Options(buffer_bytes=MiB, pool_bytes=2 * MiB),  # type: ignore[arg-type]
                  long_every=[(), (4,)])
    try:
        drain.submit(2)
        assert route.busy.wait(30)
        for step in (4, 6, 8, 10):
            drain.submit(step)
        assert drain.pinned() == {2, 4, 8, 10}
        if preempted:
            drain.final()
            assert drain.pinned() == {2, 10}
        route.go.set()
        assert drain.wait(30)
        assert route.asked == ([2, 10] if preempted else [2, 4, 8, 10])
        assert drain.status()[1]["skipped"] == ([6, 4, 8] if preempted else [6])
        assert drain.pinned() == set()
    finally:
        route.go.set()
        drain.close()


def test_a_fresh_jobs_slots_of_sizes_no_save_writes_go_at_the_first_drop(shm):
    """A fresh job's restore() makes the slots ahead from its state before the first step: a
    torch optimizer has no state yet, so they are the model's size, which no save writes
    (its saves went through the pool). They stayed until two steps had dropped, while the
    memory budget counted them as free: a tmpfs that held the steps filled with ENOSPC from
    the pool's write rather than the budget's refusal. They go with the first dropped step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt}
    slots = os.path.join(shm, "run", SLOTS_DIR)
    with ckptio.CheckpointManager(tiers=[Tier("shm://run", keep_last=2)]) as mgr:
        assert mgr.restore(state) is None
        mgr.prepare({"model": model}, wait=True)  # the same sizes: the ones restore made
        made = {os.path.getsize(os.path.join(slots, n)) for n in os.listdir(slots)}
        for step in range(1, 4):  # step 1 drops at step 3's retention
            _train(model, opt)
            mgr.save(step, state)
        data = {os.path.getsize(os.path.join(shm, "run", "step-3", n))
                for n in os.listdir(os.path.join(shm, "run", "step-3")) if n.startswith("data-")}
        assert made and not made & data  # made for the model alone
        mgr._levels[0].join_removal()
        left = {n: os.path.getsize(os.path.join(slots, n)) for n in os.listdir(slots)}
        assert {n: s for n, s in left.items() if s not in data} == {}


def test_the_slots_made_ahead_stay_within_max_bytes(shm):
    """A memory tier's slots made ahead (prepare(), restore()) for its first saves count within
    its max_bytes: a budget of two and a half steps gets two steps' files, not the ring's three
    (a new user's trial: 289 MiB on tmpfs after the first step against max_bytes=200 MiB)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt}

    def slot_nbytes(tier: str) -> int:
        slots = os.path.join(shm, tier, SLOTS_DIR)
        return sum(os.path.getsize(os.path.join(slots, n)) for n in os.listdir(slots))

    with ckptio.CheckpointManager(tiers=[Tier("shm://free", keep_last=2)]) as mgr:
        mgr.prepare(state, wait=True)
        one_step = slot_nbytes("free") // 3  # the ring: keep_last + 1 steps' files
    with ckptio.CheckpointManager(tiers=[Tier("shm://bound", keep_last=2,
                                              max_bytes=int(one_step * 2.5))]) as mgr:
        mgr.prepare(state, wait=True)
        assert slot_nbytes("bound") == 2 * one_step
