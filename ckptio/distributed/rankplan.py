"""This rank's part of a save's plan, as it goes to the coordinator.

local_plan() turns the rank's SavePlan into a RankPlan: regular DTensor items (format/grid.py)
described once per tensor where the group's ranks are the global ranks 0..N-1 and the mesh lies
inside it (meshes name global ranks), every other item per chunk; plain tensors carry an xxh3
digest of their bytes when there are peers, so replicas of equal bytes are stored once and
different ones kept per rank.

Owns: that choice and the digests. Does not own: the messages (wire.py), the collective steps
(collective.py) or the coordinator's decisions (planning/globalplan.py, planning/regular_items.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import xxhash

from ckptio.distributed.dist import Group
from ckptio.format.flatten import FlatState
from ckptio.format.grid import Grid
from ckptio.planning.globalplan import RankPlan
from ckptio.planning.plan import SavePlan
from ckptio.planning.regular_items import Regular, RegularItem

__all__ = ["local_plan", "valued_shards"]


def local_plan(group: Group, plan: SavePlan, sources: dict[str, torch.Tensor],
               flat: FlatState, *, regular: bool = True,
               across: frozenset[str] = frozenset()) -> RankPlan:
    """This rank's RankPlan; plain items carry a digest of their bytes when there are peers.
    Regular DTensor items (grid.py) are planned per tensor when the group's ranks are the
    global ranks 0..size-1 and the DTensor's mesh lies inside it (every rank holding the key
    sees that mesh, so all decide alike); every other item per chunk, and every item when not
    ``regular`` (a packed save, format version 4: its rows carry fields index files lack).
    ``across``: DTensor keys the group holds on disjoint device meshes (collective.Memory):
    per chunk with a digest, so only equal replicas are stored once."""
    grids = {key: grid for key, grid in plan.grids.items()
             if max(grid.ranks) < group.size and key not in across} \
        if regular and _whole_job(group) else {}
    items = {index: i for index, i in enumerate(plan.items) if i.key not in grids}
    domains = {index: plan.domains[i.key] for index, i in items.items()
               if i.key in plan.domains and i.key not in across}
    digests: dict[int, str] = {}
    if group.size > 1:
        digests = {index: _digest(sources[i.key]) for index, i in items.items()
                   if index not in domains}
    sharded = plan.sharded - grids.keys() if grids else plan.sharded
    return RankPlan(group.rank, items, sharded, digests, plan.objects, plan.aliases,
                    flat.tree, domains, _regular(plan, grids) if grids else None)


def _whole_job(group: Group) -> bool:
    """Whether ``group`` has peers and its ranks are global ranks 0..size-1."""
    return group.size > 1 and getattr(group, "members", None) == tuple(range(group.size))


def _regular(plan: SavePlan, grids: Mapping[str, Grid]) -> Regular:
    numbers: dict[Grid, int] = {}
    items = []
    for index, item in enumerate(plan.items):
        grid = grids.get(item.key)
        if grid is not None:
            number = numbers.setdefault(grid, len(numbers))
            items.append(RegularItem(index, item.key, item.dtype, item.shape, number))
    return Regular(tuple(numbers), tuple(items))


def valued_shards(plan: RankPlan) -> bool:
    """Whether replicas of some sharded item are known only by its bytes (TensorShard,
    FlatShard): then who writes what can change with the values, and is decided afresh."""
    return any(plan.items[i].key in plan.sharded for i in plan.digests)


def _digest(t: torch.Tensor) -> str:
    """xxh3 of a plain tensor's bytes (copied to host if needed): equal on two ranks means the
    same value, so it is stored once."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return xxhash.xxh3_64_hexdigest(b"")
    return xxhash.xxh3_64_hexdigest(t.view(-1).view(torch.uint8).numpy().data)
