"""Recovery without a relaunch (issue 66, docs/guides/redundancy.md "Recovery without a
relaunch"): 3 gloo ranks on 3 simulated hosts (each its own CKPTIO_HOST_ID and memory directory)
save every step; rank 1 dies mid-run. The survivors catch the collective's error, destroy the process group, close their
manager and form a new group (a new store prefix) with a hot spare (a fourth process, waiting
with torch imported on a host of its own) that takes rank 1; every rank then makes a new
CheckpointManager on the same tiers and restores. Every rank's final state is bitwise an
uninterrupted run's.

- memory tier with Partners(1): the survivors restore from their own memory (rolling back what
  they trained past it), the spare its partner's copy. The victim dies after step 4's
  all_reduce, before saving step 4: the survivors hold a committed step 4 that can never be
  protected, so the job resumes from step 3 and saves step 4 again.
- one shared disk tier: every save and restore is agreed by the ranks through the job's store;
  the survivors' and the spare's agreements meet (the names of ckptio's groups count anew under
  the new default group), and the survivors' close() does not wait for the dead rank.
"""

from __future__ import annotations

import hashlib
import os
import queue
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ckptio
from ckptio.errors import CkptError
from ckptio.testing.rank_processes import free_port, warm_context

import pytest

STEPS, DIES_AT, WORLD, VICTIM = 6, 4, 3, 1


def _build(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(rank: int, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    loss = model(torch.randn(4, 16, generator=gen)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().view(torch.uint8).numpy().tobytes())
        for key in sorted(opt.state.get(p, {})):
            h.update(opt.state[p][key].reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _reference(rank: int) -> str:
    model, opt = _build(rank)
    for step in range(1, STEPS + 1):
        _train(rank, step, model, opt)
    return _digest(model, opt)


def _join(store: Any, generation: int, rank: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore(f"gen{generation}/", store),
                            rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))


def _manager(tier: str, root: str) -> ckptio.CheckpointManager:
    options = ckptio.Options(peer_timeout_s=10, rank_timeout_s=30)
    if tier == "disk":
        return ckptio.CheckpointManager(os.path.join(root, "disk"), keep_last=2, options=options)
    return ckptio.CheckpointManager(
        tiers=[ckptio.Tier("shm://run", keep_last=1, redundancy=ckptio.Partners(1))],
        options=options)


def _rank(tier: str, rank: int, port: int, root: str, out: Any) -> None:
    """A rank (rank >= 0) or the hot spare (rank -1: waits until told which rank it takes)."""
    torch.set_num_threads(1)
    host = f"host{rank}" if rank >= 0 else "spare"
    os.environ.update(CKPTIO_HOST_ID=host, CKPTIO_SHM_DIR=os.path.join(root, host))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=90))
    generation = 0
    if rank < 0:
        rank, generation = int(store.get("spare/rank")), 1  # get() waits for the key
    model, opt = _build(rank)
    _join(store, generation, rank)
    mgr = _manager(tier, root)
    state = {"model": model, "optim": opt, "step": 0}
    step = (mgr.restore(state) or 0) + 1
    if generation:
        out.put(("restored", rank, step - 1, mgr.last_restore.get("source")))
    while step <= STEPS:
        try:
            loss = _train(rank, step, model, opt)
            if generation == 0 and rank == VICTIM and step == DIES_AT and tier == "disk":
                os._exit(9)  # before the step's collective
            dist.all_reduce(loss)
            if generation == 0 and rank == VICTIM and step == DIES_AT:
                os._exit(9)  # after the step's collective, before its save
            state["step"] = step
            mgr.save(step, state, force=True)
            if generation == 0 and step == DIES_AT - 1:
                assert mgr.protected(timeout=60)  # step 3 protected on every host
                dist.barrier()
            step += 1
        except RuntimeError:  # the collective's error: a peer is gone
            failed = time.monotonic()
            dist.destroy_process_group()
            try:
                mgr.close()
            except CkptError:
                pass  # the protection of the step in flight failed: expected
            generation += 1
            if rank == 0:
                store.set("spare/rank", str(VICTIM))
            _join(store, generation, rank)
            mgr = _manager(tier, root)
            step = (mgr.restore(state) or 0) + 1
            out.put(("restored", rank, step - 1, mgr.last_restore.get("source")))
            out.put(("took", rank, time.monotonic() - failed))
    mgr.close()
    out.put(("final", rank, _digest(model, opt)))
    dist.destroy_process_group()


RESTORED = {"memory": {0: [3, "own"], 1: [3, "partner"], 2: [3, "own"]},
            "disk": {0: [3, None], 1: [3, None], 2: [3, None]}}


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_spare_replaces_a_dead_rank_without_a_relaunch(tmp_path: Path, tier: str) -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=90))
    ctx = warm_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(tier, r, port, str(tmp_path), out))
             for r in (*range(WORLD), -1)]
    for proc in procs:
        proc.start()
    got: dict[str, dict[int, Any]] = {"restored": {}, "final": {}, "took": {}}
    deadline = time.monotonic() + 90
    try:
        while len(got["final"]) < WORLD and time.monotonic() < deadline:
            try:
                kind, rank, *rest = out.get(timeout=1)
            except queue.Empty:
                if all(p.exitcode not in (None, 0, 9) for p in procs[:1]):
                    break
                continue
            got[kind][rank] = rest
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(got["final"]) == WORLD else 0)
            if proc.is_alive():
                proc.kill()
        del store
    assert got["restored"] == RESTORED[tier], got
    # no survivor waited for the dead rank (rank_timeout_s=30) before its restore
    assert max(t[0] for t in got["took"].values()) < 20, got["took"]
    assert {r: d[0] for r, d in got["final"].items()} == \
        {r: _reference(r) for r in range(WORLD)}, got
