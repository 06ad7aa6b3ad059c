"""Where a survivor's in-process restore goes (issue 66): WORLD gloo ranks, each on a host of
its own (CKPTIO_HOST_ID, its own memory directory), save STEPS steps into a memory tier with
Partners(1) (and a disk tier every EVERY steps), wait until protected; then every rank destroys
its process group, forms the next generation's (a new store prefix, as
benchmarks/recovery_inproc.py does), makes a new CheckpointManager on the same tiers and
restores (each rolls back from its own memory; with --lose R, rank R's host is replaced by
an empty one and its restore fetches its partner's copy, as the benchmark's spare does). Each
rank prints one JSON line: the phases' seconds and counts (probes around the functions named in
PROBES; nested probes overlap).

    python dev/survivor_restore.py [--world 4] [--mib 64] [--steps 4] [--every 2] [--lose 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBES = [
    ("torch.distributed", "new_group"),
    ("torch.distributed", "new_subgroups"),
    ("torch.distributed", "all_gather"),
    ("torch.distributed", "broadcast"),
    ("ckptio.managing.manager", "CheckpointManager.__init__"),
    ("ckptio.managing.manager", "CheckpointManager.restore"),
    ("ckptio.managing.manager", "CheckpointManager._staging"),
    ("ckptio.managing.manager", "CheckpointManager._start"),
    ("ckptio.managing.manager", "CheckpointManager._slots_ahead"),
    ("ckptio.managing.guard", "Guard.__init__"),
    ("ckptio.managing.guard", "Guard.recover"),
    ("ckptio.managing.agreement", "Ranks.agreed"),
    ("ckptio.managing.all_tiers", "make_levels"),
    ("ckptio.managing.all_tiers", "list_tiers"),
    ("ckptio.managing.level", "TierSteps.manifest"),
    ("ckptio.managing.level", "TierSteps.try_load"),
    ("ckptio.managing.level", "TierSteps.try_load_at"),
    ("ckptio.managing.route", "resume"),
    ("ckptio.api", "Checkpointer.__init__"),
    ("ckptio.api", "Checkpointer.load"),
    ("ckptio.api", "Checkpointer.verify"),
    ("ckptio.redundancy.peers", "all_gather_json"),
    ("ckptio.redundancy.rebuild", "recover"),
    ("ckptio.redundancy.elastic", "survey"),
    ("ckptio.redundancy.recovery_plan", "inventory"),
    ("ckptio.format.manifest", "decode"),
    ("ckptio.managing.agreed", "restore_guarded"),
    ("ckptio.managing.agreed", "_this_world"),
    ("ckptio.managing.guard", "Guard.outcomes"),
    ("ckptio.managing.guard", "Guard.settle"),
    ("ckptio.managing.guard", "Guard.start"),
    ("ckptio.redundancy.protect", "Protector.wait"),
    ("ckptio.managing.manager", "CheckpointManager._listings"),
    ("ckptio.managing.manager", "CheckpointManager.wait"),
    ("ckptio.managing.level", "TierSteps.prepare_slots"),
    ("ckptio.managing.level", "TierSteps.join_removal"),
    ("ckptio.managing.level", "TierSteps.succeeded"),
    ("ckptio.managing.level", "TierSteps.mark_damaged"),
    ("ckptio.api", "Checkpointer.prepare"),
]
TIMES: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def _wrap(name: str, fn: Any) -> Any:
    def probe(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        COUNTS[name] += 1
        try:
            return fn(*a, **k)
        finally:
            TIMES[name] += time.perf_counter() - t
    return probe


def install() -> None:
    from phase_probe import patch  # dev/, beside this file

    patch(PROBES, _wrap, ("ckptio", "torch.distributed"))


def take() -> dict[str, Any]:
    out = {k: [COUNTS[k], round(TIMES[k], 4)] for k in sorted(TIMES)}
    TIMES.clear()
    COUNTS.clear()
    return out


def _rank(rank: int, args: argparse.Namespace, port: int, root: str) -> None:
    import torch
    import torch.distributed as dist

    import ckptio

    torch.set_num_threads(1)
    host = f"host{rank}"
    os.environ.update(CKPTIO_HOST_ID=host, CKPTIO_SHM_DIR=os.path.join(root, host))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))

    def join(gen: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{gen}/", store), rank=rank,
                                world_size=args.world, timeout=timedelta(seconds=120))

    def manager() -> ckptio.CheckpointManager:
        return ckptio.CheckpointManager(tiers=[
            ckptio.Tier("shm://run", keep_last=1, redundancy=ckptio.Partners(1)),
            ckptio.Tier(os.path.join(root, "disk"), every=args.every, keep_last=2)])

    n = args.mib * 2**20 // 4 // args.tensors
    state = {f"rank{rank}": {f"t{i}": torch.full((n,), float(rank + i)) for i in
                             range(args.tensors)}, "step": 0}
    join(0)
    mgr = manager()
    mgr.restore(state)
    for step in range(1, args.steps + 1):
        state["step"] = step
        mgr.save(step, state, force=True)
    assert mgr.protected(timeout=120)
    mgr.drained(timeout=120)
    dist.barrier()
    dist.destroy_process_group()
    mgr.close()
    if rank == args.lose:  # its host replaced: another host id, an empty memory (a spare's)
        os.environ.update(CKPTIO_HOST_ID="spare", CKPTIO_SHM_DIR=os.path.join(root, "spare"))
        for each in state[f"rank{rank}"].values():
            each.zero_()
    join(1)
    install()
    t0 = time.perf_counter()
    mgr = manager()
    made = time.perf_counter() - t0
    restored = mgr.restore(state)
    assert all(bool((t == float(rank + i)).all()) for i, t in
               enumerate(state[f"rank{rank}"].values())), f"rank {rank}: not restored"
    total = time.perf_counter() - t0
    print(json.dumps({"rank": rank, "restored": restored, "source": mgr.last_restore["source"],
                      "construct_s": round(made, 4), "restore_s": round(total - made, 4),
                      "total_s": round(total, 4), "phases [count, s]": take()}), flush=True)
    dist.barrier()
    mgr.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--lose", type=int, default=-1, help="this rank's host is replaced (its "
                   "restore fetches its partner's copy, as the benchmark's spare does)")
    args = p.parse_args()
    from ckptio.testing.rank_processes import free_port, warm_context

    root = tempfile.mkdtemp(prefix="survivor-", dir="/dev/shm")
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=120))
    ctx = warm_context()
    procs = [ctx.Process(target=_rank, args=(r, args, port, root)) for r in range(args.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(600)
    del store
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
