"""A rank's regular DTensor items, planned per tensor rather than per chunk.

A rank's ``Regular`` lists its DTensor items whose layout is a Grid (grid.py): item index in its
plan, key, dtype, global shape and grid. It says nothing rank-specific (the rank's chunk follows
from its coordinate), so ranks of the same state and mesh hold equal lists, sent once for all of
them (wire.py, collective.py), and the coordinator's checks cost O(distinct lists x tensors +
ranks x grids) instead of O(chunks). Who writes which chunk follows from the grid
(Grid.writes): every rank computes its own writes, and the coordinator the entries it expects.

Owns: those lists, their checks across ranks (same dtype, shape and grid for a key everywhere;
every rank of a grid's mesh holds every key laid over it) and the items a rank writes. Pure:
no torch, no I/O. Does not own: the arithmetic (grid.py) or the per-chunk path (globalplan.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from ckptio.errors import CkptError
from ckptio.format.grid import Grid
from ckptio.format.types import DTYPE_ITEMSIZE, RegularTensor, WriteItem

__all__ = ["RankView", "Regular", "RegularItem", "check_regular", "regular_section",
           "regular_writes", "submesh_replicas"]


@dataclass(frozen=True)
class RegularItem:
    index: int  # of the item in its rank's plan (results are keyed by it)
    key: str
    dtype: str
    shape: tuple[int, ...]
    grid: int  # into Regular.grids


@dataclass(frozen=True)
class Regular:
    grids: tuple[Grid, ...]
    items: tuple[RegularItem, ...]

    @cached_property
    def keys(self) -> frozenset[str]:
        return frozenset(i.key for i in self.items)

    @cached_property
    def written_by(self) -> dict[tuple[int, int], tuple[RegularItem, ...]]:
        """(grid number, replica) -> the items that replica writes its chunks of (Grid.writer),
        so a rank visits only its own."""
        out: dict[tuple[int, int], list[RegularItem]] = {}
        for item in self.items:
            out.setdefault((item.grid, self.grids[item.grid].writer(item.key)), []).append(item)
        return {where: tuple(items) for where, items in out.items()}

    @cached_property
    def by_key(self) -> dict[str, RegularItem]:
        return {i.key: i for i in self.items}

    def chunk_is_empty(self, key: str, rank: int) -> bool | None:
        """Whether global rank ``rank``'s chunk of ``key`` is empty; None if ``key`` is not
        one of these items (or ``rank`` not in its mesh)."""
        item = self.by_key.get(key)
        if item is None:
            return None
        coordinate = self.grids[item.grid].coordinate(rank)
        if coordinate is None:
            return None
        return self.grids[item.grid].chunk(item.shape, coordinate).numel == 0

    @cached_property
    def keys_on(self) -> dict[int, frozenset[str]]:
        """Grid number -> the keys laid over that grid."""
        out: dict[int, set[str]] = {}
        for item in self.items:
            out.setdefault(item.grid, set()).add(item.key)
        return {grid: frozenset(keys) for grid, keys in out.items()}


def regular_writes(regular: Regular, rank: int) -> dict[int, WriteItem]:
    """The items global rank ``rank`` (holding ``regular``) writes, by item index: on each
    grid, the items its replica writes, but for empty pieces."""
    out: dict[int, WriteItem] = {}
    for number, grid in enumerate(regular.grids):
        coordinate = grid.coordinate(rank)
        if coordinate is None:
            raise CkptError(f"rank {rank} holds DTensors on a device mesh without it "
                            "(internal: check_regular refuses this)")
        for item in regular.written_by.get((number, grid.replica(coordinate)), ()):
            chunk = grid.chunk(item.shape, coordinate)
            if chunk.numel:  # an empty piece of an uneven split: nothing to store
                out[item.index] = WriteItem(item.key, "tensor", item.dtype, item.shape, chunk,
                                            chunk.numel * DTYPE_ITEMSIZE[item.dtype])
    return out


class RankView(Protocol):
    """What this module reads of one rank's plan (globalplan.RankPlan, which imports this
    module: so a Protocol here)."""

    @property
    def rank(self) -> int: ...

    @property
    def items(self) -> Mapping[int, WriteItem]: ...

    @property
    def aliases(self) -> tuple[tuple[str, str], ...]: ...

    @property
    def regular(self) -> Regular | None: ...


def check_regular(ranks: Sequence[RankView], conflict: type[CkptError]) -> None:
    """Raise ``conflict`` naming keys and ranks unless every rank's regular items agree: a key
    has one dtype, shape and grid everywhere, is regular on every rank holding it, and every
    rank of a grid's mesh holds it (and only those ranks)."""
    lists: dict[int, tuple[Regular, list[int]]] = {}
    for plan in ranks:
        if plan.regular is not None and plan.regular.items:
            lists.setdefault(id(plan.regular), (plan.regular, []))[1].append(plan.rank)
    seen: dict[str, tuple[tuple[str, tuple[int, ...], Grid], int]] = {}
    for regular, holders in lists.values():
        for item in regular.items:
            mine = (item.dtype, item.shape, regular.grids[item.grid])
            first, rank = seen.setdefault(item.key, (mine, holders[0]))
            if first != mine:
                raise conflict(
                    f"key {item.key!r}: rank {rank} holds a shard of a {first[0]} tensor of shape "
                    f"{first[1]} on mesh {_mesh(first[2])}, rank {holders[0]} of a {mine[0]} "
                    f"tensor of shape {mine[1]} on mesh {_mesh(mine[2])}; every rank must hold "
                    "the same tensor (pipeline stages: give each stage's keys a prefix)")
    _check_mixed(ranks, seen, conflict)
    by_rank = {plan.rank: plan for plan in ranks}
    for regular, holders in lists.values():
        _check_holders(regular, holders, by_rank, conflict)


def submesh_replicas(ranks: Sequence[RankView]) -> frozenset[str]:
    """Keys laid out alike (dtype, shape, mesh shape, placements) on pairwise disjoint device
    meshes: replicas of one tensor on submeshes (a module left out of the tensor-parallel plan,
    fully_shard over the data-parallel mesh alone), or different tensors under one name
    (pipeline stages). Only their bytes tell which, so they are planned again per chunk with
    digests (collective.py): equal replicas are stored once, different ones refused."""
    layouts: dict[str, tuple[object, ...]] = {}
    meshes: dict[str, set[frozenset[int]]] = {}
    other: set[str] = set()
    for regular in {id(p.regular): p.regular for p in ranks if p.regular is not None}.values():
        for item in regular.items:
            grid = regular.grids[item.grid]
            if layouts.setdefault(item.key, (item.dtype, item.shape, grid.shape, grid.dims)) \
                    != (item.dtype, item.shape, grid.shape, grid.dims):
                other.add(item.key)
            mesh, seen = frozenset(grid.ranks), meshes.setdefault(item.key, set())
            if mesh not in seen and any(mesh & s for s in seen):
                other.add(item.key)
            seen.add(mesh)
    return frozenset(key for key, seen in meshes.items() if len(seen) > 1 and key not in other)


def _lacks(plan: RankView | None, keys: frozenset[str]) -> set[str]:
    """Of ``keys``, those ``plan`` holds neither as regular items nor as ties to another key
    (a rank whose shard of a tied tensor is empty sees no tie and lists the key; the others
    list the tie)."""
    if plan is None:
        return set(keys)
    lacking = keys - plan.regular.keys if plan.regular is not None else set(keys)
    return set(lacking) - {key for key, _target in plan.aliases} if lacking else set()


def _check_mixed(ranks: Sequence[RankView], seen: Mapping[str, object],
                 conflict: type[CkptError]) -> None:
    """No rank holds a regular key on the per-chunk path."""
    for plan in ranks:
        for item in plan.items.values():
            if item.key in seen:
                raise conflict(
                    f"key {item.key!r}: rank {plan.rank} holds it otherwise than the other ranks "
                    "(they hold DTensors laid out by their placements; rank "
                    f"{plan.rank} a hand-made shard, a plain tensor or a DTensor whose local "
                    "region is not where its placements put it); hold it the same way on every "
                    "rank")


def _check_holders(regular: Regular, holders: list[int], by_rank: dict[int, RankView],
                   conflict: type[CkptError]) -> None:
    """Ranks holding ``regular`` are in the mesh of each of its grids, and every rank of that
    mesh holds the keys laid over it."""
    have = set(holders)
    for number, grid in enumerate(regular.grids):
        mesh = set(grid.ranks)
        outside = have - mesh
        if outside:
            raise conflict(f"rank {min(outside)} holds DTensors on a device mesh without it "
                           f"({_mesh(grid)}): a process group and mesh that do not match?")
        keys = regular.keys_on.get(number, frozenset())
        lacking: dict[object, set[str]] = {}  # ranks alike in what they hold: checked once
        for rank in sorted(mesh - have):
            plan = by_rank.get(rank)
            alike = None if plan is None else (id(plan.regular), plan.aliases)
            if alike not in lacking:
                lacking[alike] = _lacks(plan, keys)
            missing = lacking[alike]
            if missing:
                raise conflict(
                    f"key {min(missing)!r}: rank {rank} is in its device mesh ({_mesh(grid)}) "
                    "but does not hold it; every rank of the mesh must pass every DTensor laid "
                    "over it" + ("" if rank in by_rank else
                                 f" (rank {rank} is not in this save's process group)"))


def _mesh(grid: Grid) -> str:
    ranks = grid.ranks if len(grid.ranks) <= 8 else (*grid.ranks[:8], "...")
    return f"shape {grid.shape}, ranks {ranks}"


def regular_section(plans: Sequence[RankView], aliases: Sequence[tuple[str, str]]) -> tuple[
        tuple[Grid, ...], tuple[RegularTensor, ...]]:
    """A manifest's grids and regular tensors (one row per key), from the ranks' lists: each
    distinct list once (ranks of equal lists share one, collective.py). A key the global plan
    made an alias (a tie one rank could not see, its piece being empty) is left out."""
    grids: dict[Grid, int] = {}
    rows: dict[str, RegularTensor | None] = dict.fromkeys(key for key, _target in aliases)
    seen: set[int] = set()
    for plan in plans:
        regular = plan.regular
        if regular is None or id(regular) in seen:
            continue
        seen.add(id(regular))
        number = [grids.setdefault(grid, len(grids)) for grid in regular.grids]
        for item in regular.items:
            if item.key not in rows:
                rows[item.key] = RegularTensor(item.key, item.dtype, item.shape,
                                               number[item.grid])
    return tuple(grids), tuple(row for row in rows.values() if row is not None)
