"""The fixed cost of a survivor's restore (issue 66, docs/BENCH_RECOVERY.md "Where a survivor's
restore goes"), as counts: 3 gloo ranks on 3 simulated hosts save into a memory tier with
Partners(1) and a disk tier, close, and make a new manager on the same tiers that rolls back
(the in-process recovery's new manager, here under the same default group).

- constructing it makes the Guard's three job-wide groups, and this rank's one-rank group by
  itself: no collective group creation per rank of the job (torch's new_subgroups made one
  per rank, each a collective of every rank);
- its restore lists each tier once (the steps newer than the one restored are read from that
  listing, not from a second scan) and reads each stored step's manifest once.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import ckptio
from ckptio.managing.level import TierSteps
from ckptio.testing.rank_processes import run_ranks

WORLD = 3


def _tiers(disk: str) -> list[ckptio.Tier]:
    return [ckptio.Tier("shm://run", keep_last=1, redundancy=ckptio.Partners(1)),
            ckptio.Tier(disk, every=2, keep_last=2)]


def rollback_counts(rank: int, world: int, base: str) -> dict[str, Any]:
    """A rank: saves 3 steps, closes, then a new manager restores -> what it counted."""
    host = os.path.join(base, f"host{rank}")
    os.makedirs(host, exist_ok=True)
    os.environ.update(CKPTIO_HOST_ID=f"host{rank}", CKPTIO_SHM_DIR=host)
    disk = os.path.join(base, "disk")
    state = {"w": torch.full((1024,), float(rank)), "step": 0}
    mgr = ckptio.CheckpointManager(tiers=_tiers(disk))
    mgr.restore(state)
    for step in range(1, 4):
        state["step"] = step
        mgr.save(step, state, force=True)
    assert mgr.protected(timeout=60)
    mgr.close()
    counts: Counter[str] = Counter()
    made, listing, manifest = c10d.new_group, TierSteps.listing, TierSteps.manifest

    def new_group(*args: Any, **kwargs: Any) -> Any:
        local = kwargs.get("use_local_synchronization", False)
        counts["groups made alone" if local else "groups made by every rank"] += 1
        return made(*args, **kwargs)

    def listed(self: TierSteps) -> Any:
        counts[f"tier {self.index} listed"] += 1
        return listing(self)

    def decoded(self: TierSteps, step: int) -> Any:
        counts[f"tier {self.index} step {step} manifest"] += 1
        return manifest(self, step)

    c10d.new_group = dist.new_group = new_group  # new_subgroups calls c10d's
    TierSteps.listing = listed  # type: ignore[method-assign]
    TierSteps.manifest = decoded  # type: ignore[method-assign]
    try:
        mgr = ckptio.CheckpointManager(tiers=_tiers(disk))
        made_counts = dict(counts)
        counts.clear()
        state["w"].zero_()
        restored = mgr.restore(state)
        restore_counts = dict(counts)
    finally:
        c10d.new_group = dist.new_group = made
        TierSteps.listing = listing  # type: ignore[method-assign]
        TierSteps.manifest = manifest  # type: ignore[method-assign]
    ok = bool(torch.equal(state["w"], torch.full((1024,), float(rank))))
    mgr.close()
    return {"made": made_counts, "restore": restore_counts, "restored": restored, "ok": ok}


def test_a_survivors_new_manager_makes_its_groups_once_and_lists_once(tmp_path: Path) -> None:
    got = run_ranks(WORLD, rollback_counts, str(tmp_path), timeout_s=120)
    for rank, each in enumerate(got):
        assert each["restored"] == 3 and each["ok"], (rank, each)
        # group, control, listing: the job's; this rank's saves' group: made by it alone
        # (and, construction's probe of its tiers, managing/route.py's resume: each listed once)
        assert each["made"] == {"groups made by every rank": 3, "groups made alone": 1,
                                "tier 0 listed": 1, "tier 1 listed": 1}, each
        listed = {k: v for k, v in each["restore"].items() if k.endswith("listed")}
        assert listed == {"tier 0 listed": 1, "tier 1 listed": 1}, each
        decoded = {k: v for k, v in each["restore"].items() if k.endswith("manifest")}
        # the steps of both tiers, each step's manifest read once (the memory tier's were read
        # twice: for its own steps, then again among every tier's)
        assert "tier 0 step 3 manifest" in decoded and "tier 1 step 2 manifest" in decoded, each
        assert set(decoded.values()) == {1}, each
