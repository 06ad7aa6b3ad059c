"""Per-rank bodies of tests/test_exit.py (module-level: ranks are spawned and import them):
what a rank leaves behind when it exits after ckptio saved and loaded over its process group.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import ckptio
import dist_cases as cases

_held: list[Any] = []  # kept until the interpreter clears this module at exit


def world_freed_by_destroy(rank: int, world: int, path: str) -> list[bool]:
    """Save DTensors on these ranks, load them back resharded, save and restore through a
    CheckpointManager kept referenced (a script's global), mark a one-rank group as the memory
    tier's redundancy does, save over rank_alone_group(), then destroy_process_group: ->
    whether the WORLD group and the one-rank group are gone (as they are without ckptio), and
    whether the save alone made no torch group (one made on some ranks only would shift the
    names of the groups made after it there)."""
    from ckptio.distributed.dist import mark_piece, rank_alone_group

    ref = weakref.ref(dist.group.WORLD)
    single, subgroups = dist.new_subgroups(group_size=1, backend="gloo")
    mark_piece(single, rank, world)
    piece_ref = weakref.ref(single)
    alone = rank_alone_group()  # a per-rank file's group (the DeepSpeed and Lightning plugins)
    ckptio.save({"w": torch.ones(3)}, os.path.join(path, f"alone-{rank}"), process_group=alone)
    no_group_made = alone is not None and not isinstance(alone, dist.ProcessGroup)
    del single, subgroups, alone
    cases.save_layout(rank, world, os.path.join(path, "ck"), "shard0")
    cases.load_layout(rank, world, os.path.join(path, "ck"), "shard1")
    state = {"w": torch.arange(6.0), "step": 3}
    mgr = ckptio.CheckpointManager(os.path.join(path, "run"), options=cases.SMALL)
    mgr.save(1, state)
    mgr.restore(state)
    mgr.close()
    dist.destroy_process_group()
    gc.collect()
    freed = [ref() is None, piece_ref() is None, no_group_made]
    del mgr
    return freed


def world_freed_before_collection(rank: int, world: int, path: str) -> bool:
    """A CheckpointManager save of a DTensor (a 1-D mesh over the world) and a ckptio.load of
    it, then destroy_process_group with no garbage collection between (collections disabled,
    as loops that avoid their pauses run): -> whether WORLD is gone at once. A recursive
    closure in the load (loading/merge.py) held the state, its mesh and WORLD in a reference
    cycle until the next collection, which may run while the interpreter finalizes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = weakref.ref(dist.group.WORLD)
    mesh = init_device_mesh("cpu", (world,))
    state = {"model": {"w": distribute_tensor(torch.arange(64.0).reshape(8, 8), mesh, [Shard(0)]),
                       "b": torch.ones(4)}, "step": 7}
    gc.collect()  # torch's own cycles (frames of distribute_tensor's first call) go here
    gc.disable()  # then no automatic collection hides a cycle ckptio makes
    mgr = ckptio.CheckpointManager(path, options=cases.SMALL)
    mgr.save(7, state)
    mgr.close()
    ckptio.load(os.path.join(path, "step-7"), state)
    del mgr, state, mesh
    dist.destroy_process_group()
    freed = ref() is None
    gc.enable()
    return freed


class _Finalizing:
    """Cleared with this module while the interpreter finalizes: says so (a file), then holds
    the finalization until the peer says its collective is done (another file)."""

    def __init__(self, flags: str) -> None:
        self.flags = flags

    def __del__(self) -> None:
        open(os.path.join(self.flags, "finalizing"), "w").close()
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(self.flags, "done")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the gloo worker wakes in this time


def _noted(future: Any) -> None:
    sys.stderr.write("the collective's callback ran\n")


def late_gloo_work(rank: int, world: int, path: str, flags: str) -> int:
    """After a ckptio save, rank 1 posts an all_reduce with a Python callback and returns
    (run_ranks then destroys the process group and the interpreter exits); rank 0 joins the
    collective only once rank 1 finalizes, or after 3 s. destroy_process_group waits for the
    group's work: then the callback runs before exit. A group that outlives it (held by
    someone) finishes the work while the interpreter finalizes: its gloo thread takes the GIL
    for the callback and the process aborts (std::terminate)."""
    ckptio.save({"w": torch.ones(4)}, os.path.join(path, "all"), options=cases.SMALL)
    if rank == 1:
        work = dist.all_reduce(torch.ones(8), async_op=True)
        work.get_future().then(_noted)
        _held.append(_Finalizing(flags))
        return rank
    deadline = time.monotonic() + 3
    while not os.path.exists(os.path.join(flags, "finalizing")) and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.all_reduce(torch.ones(8))
    open(os.path.join(flags, "done"), "w").close()
    return rank


class _StoreWait:
    """A Worker's Jobs: one job, waiting in the c10d store (a torch call, the GIL released)
    for a key nobody sets before exit, for at most ``wait_s``."""

    def __init__(self, store: Any, wait_s: float) -> None:
        self.store, self.wait_s = store, wait_s
        self.queued, self.running = True, threading.Event()

    def take(self) -> bool | None:
        job, self.queued = (True if self.queued else None), False
        return job

    def pending(self) -> bool:
        return self.queued

    def run(self, job: bool) -> None:
        self.running.set()
        self.store.wait(["late"], timedelta(seconds=self.wait_s))

    def finish(self, job: bool, error: Exception | None) -> None:
        pass


class _SetsAtFinalization:
    """Cleared with this module while the interpreter finalizes: sets the key the job waits
    for, then lets the job's thread wake in that time."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __del__(self) -> None:
        self.store.set("late", b"1")
        time.sleep(0.5)


def worker_busy_at_exit() -> None:
    """A process whose background Worker (the drain's, the protection's) is inside a torch
    call when the main thread returns; run with ``python -c``: it must exit with status 0."""
    from ckptio.io.worker import Worker

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    jobs = _StoreWait(master, wait_s=1.0)
    worker: Worker[bool] = Worker("ckptio-test", jobs)
    worker.wake()
    jobs.running.wait(10)
    time.sleep(0.2)  # inside store.wait
    _held.append(_SetsAtFinalization(dist.TCPStore("127.0.0.1", master.port, is_master=False)))
