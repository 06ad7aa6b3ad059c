"""Per-rank bodies of tests/test_exit.py (module-level: ranks are spawned and import them):
what a rank leaves behind when it exits after ckptio saved and loaded over its process group.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

import ckptio
import dist_cases as cases

_held: list[Any] = []  # kept until the interpreter clears this module at exit


def world_freed_by_destroy(rank: int, world: int, path: str) -> bool:
    """Save on these ranks, load back, save and restore through a CheckpointManager kept
    referenced (a script's global), then destroy_process_group: -> whether the WORLD group is
    gone. Plain tensors: a DeviceMesh keeps its groups past destroy_process_group itself."""
    ref = weakref.ref(dist.group.WORLD)
    state = {"w": torch.arange(6.0), "step": 3}
    ckptio.save(state, os.path.join(path, "ck"), options=cases.SMALL)
    ckptio.load(os.path.join(path, "ck"), state, options=cases.SMALL)
    mgr = ckptio.CheckpointManager(os.path.join(path, "run"), options=cases.SMALL)
    mgr.save(1, state)
    mgr.restore(state)
    mgr.close()
    dist.destroy_process_group()
    gc.collect()
    freed = ref() is None
    del mgr
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
