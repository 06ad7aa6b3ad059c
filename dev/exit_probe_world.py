"""Issue 63 item 11's last cause, as a probe: after a CheckpointManager save and a ckptio.load
of DTensors in one process, is torch's WORLD group gone once destroy_process_group returns?
A reference cycle (a recursive closure over the loaded state in loading/merge.py, fixed) held it
until the next garbage collection, which may run while the interpreter finalizes. Prints, per
rank, whether WORLD is alive after destroy_process_group and after gc.collect(); 'True, False'
is such a cycle, '(False, False)' on every rank is clean (tests/test_exit.py asserts it).

    PYTHONPATH=$PWD python dev/exit_probe_world.py
"""

from __future__ import annotations

import gc
import sys
import tempfile
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def probe(rank: int, world: int, path: str) -> tuple[bool, bool]:
    import torch.distributed as dist

    import ckptio
    import exit_stress

    alive = weakref.ref(dist.group.WORLD)
    exit_stress.save_case(rank, world, path, "manager")
    state = exit_stress._state(rank, world, zeros=True)
    mgr = ckptio.CheckpointManager(path)
    ckptio.load(path + "/step-7", state)
    mgr.close()
    del mgr, state
    dist.destroy_process_group()
    before = alive() is not None
    gc.collect()
    return before, alive() is not None


if __name__ == "__main__":
    from ckptio.testing.rank_processes import run_ranks

    print(run_ranks(2, probe, tempfile.mkdtemp() + "/ck", destroy=False))
