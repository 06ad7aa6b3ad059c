"""Regular DTensor layouts planned per tensor (format/grid.py, planning/regular_items.py): the chunk
arithmetic is torch's, every chunk has exactly one writer, and the coordinator's checks name
the key and rank when ranks disagree."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from ckptio.format.types import Chunk
from ckptio.planning.globalplan import PlanConflict, RankPlan
from ckptio.format.grid import REPLICATE, Grid, split
from ckptio.planning.regular_items import Regular, RegularItem, check_regular, regular_writes

MESHES = [(4,), (3,), (2, 2), (2, 3), (3, 2, 2)]
SHAPES = [(8, 6), (7, 5), (13, 3), (5, 11), (2, 9)]


def placements_for(ndim: int, mesh: tuple[int, ...]):
    """Every choice of Shard(d) / Replicate per mesh dim (nested Shard of one dim included)."""
    options = [REPLICATE, *range(ndim)]
    return itertools.product(options, repeat=len(mesh))


def torch_chunk(shape, mesh, dims, coordinate) -> Chunk:
    placements = [Replicate() if d == REPLICATE else Shard(d) for d in dims]
    sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(coordinate),
                                                            placements)
    return Chunk(tuple(offsets), tuple(sizes))


def test_split_is_torch_chunk():
    import torch

    for size, parts in itertools.product(range(0, 13), range(1, 6)):
        pieces = [len(p) for p in torch.arange(size).chunk(parts)] if size else []
        pieces += [0] * (parts - len(pieces))
        assert [split(size, parts, i)[1] for i in range(parts)] == pieces, (size, parts)


def test_chunks_are_torchs():
    """Grid.chunk agrees with torch's own computation for every coordinate of every layout,
    uneven, nested (two mesh dims splitting one tensor dim) and empty pieces included."""
    empty = 0
    for mesh, shape in itertools.product(MESHES, SHAPES):
        for dims in placements_for(len(shape), mesh):
            grid = Grid(mesh, tuple(range(math.prod(mesh))), dims)
            coordinates = list(itertools.product(*(range(n) for n in mesh)))
            theirs = [torch_chunk(shape, mesh, dims, c) for c in coordinates]
            assert [grid.chunk(shape, c) for c in coordinates] == theirs, (mesh, shape, dims)
            empty += any(c.numel == 0 for c in theirs)
    assert empty > 50  # layouts with empty pieces were among those checked


def test_every_chunk_written_once_and_replicas_spread():
    grid = Grid((2, 4), tuple(range(8)), (0, REPLICATE))  # 2 shards, 4 replicas of each
    regular = Regular((grid,), tuple(RegularItem(i, f"layers.{i}.norm", "float32", (16, 4), 0)
                                     for i in range(400)))
    written = {rank: regular_writes(regular, rank) for rank in range(8)}
    writers = Counter({rank: len(items) for rank, items in written.items()})
    for i in range(400):
        chunks = Counter(w[i].chunk for w in written.values() if i in w)
        assert sorted(chunks.values()) == [1, 1] and len(chunks) == 2  # each chunk once
    assert set(writers) == set(range(8)) and min(writers.values()) > 60  # about 100 each


def test_coordinates_follow_the_mesh_ranks():
    grid = Grid((2, 3), (10, 11, 12, 13, 14, 15), (0, 1))
    assert grid.coordinate(10) == (0, 0) and grid.coordinate(14) == (1, 1)
    assert grid.coordinate(3) is None
    assert grid.chunk((4, 6), (1, 2)) == Chunk((2, 4), (2, 2))


def _plan(rank: int, regular: Regular, items=None) -> RankPlan:
    return RankPlan(rank, items or {}, frozenset(i.key for i in regular.items), {}, (), (),
                    {"d": []}, {}, regular)


def test_empty_chunks_are_not_written():
    grid = Grid((2, 4), tuple(range(8)), (0, 0))  # 3 rows over 8 nested pieces: 5 empty
    regular = Regular((grid,), (RegularItem(0, "k", "float32", (3, 2), 0),))
    chunks = [i.chunk for rank in range(8) for i in regular_writes(regular, rank).values()]
    assert len(chunks) == 3 and sum(c.numel for c in chunks) == 6
    assert [regular.chunk_is_empty("k", r) for r in range(8)].count(True) == 5
    assert regular.chunk_is_empty("other", 0) is None


def test_regular_writes_cover_the_tensor_once():
    grid = Grid((2, 2), (0, 1, 2, 3), (0, REPLICATE))
    regular = Regular((grid,), (RegularItem(0, "w", "float32", (5, 3), 0),
                                RegularItem(1, "b", "float32", (5,), 0)))
    written = [regular_writes(regular, rank) for rank in range(4)]
    for key, numel in (("w", 15), ("b", 5)):
        chunks = [i.chunk for w in written for i in w.values() if i.key == key]
        assert len(chunks) == 2 and sum(c.numel for c in chunks) == numel
    assert all(i.nbytes == i.chunk.numel * 4 for w in written for i in w.values())


def test_check_regular_names_what_ranks_disagree_on():
    grid = Grid((2,), (0, 1), (0,))
    a = Regular((grid,), (RegularItem(0, "w", "float32", (4, 4), 0),))
    check_regular([_plan(0, a), _plan(1, a)], PlanConflict)
    other = Regular((grid,), (RegularItem(0, "w", "float32", (4, 5), 0),))
    with pytest.raises(PlanConflict, match=r"'w': rank 0 .* \(4, 4\).* rank 1 .* \(4, 5\)"):
        check_regular([_plan(0, a), _plan(1, other)], PlanConflict)
    lacking = Regular((grid,), ())
    with pytest.raises(PlanConflict, match="'w': rank 1 is in its device mesh"):
        check_regular([_plan(0, a), _plan(1, lacking)], PlanConflict)
    outside = Regular((Grid((1,), (0,), (0,)),), (RegularItem(0, "w", "float32", (4, 4), 0),))
    with pytest.raises(PlanConflict, match="rank 1 holds DTensors on a device mesh without it"):
        check_regular([_plan(0, outside), _plan(1, outside)], PlanConflict)
    from ckptio.format.types import WriteItem

    mixed = {0: WriteItem("w", "tensor", "float32", (4, 4), Chunk((2, 0), (2, 4)), 32)}
    with pytest.raises(PlanConflict, match="'w': rank 1 holds it otherwise than the other ranks"):
        check_regular([_plan(0, a), _plan(1, Regular((), ()), mixed)], PlanConflict)


def test_the_same_layout_on_disjoint_meshes_is_planned_again():
    """A module outside the TP plan (or PP stages under one name): one key laid out alike on
    disjoint submeshes is found, to be planned again per chunk with digests; other
    disagreements are not (check_regular refuses them)."""
    from ckptio.planning.globalplan import across_meshes
    from ckptio.planning.regular_items import submesh_replicas

    def lists(*meshes, shape=((4, 4), (4, 4)), dims=((0,), (0,))):
        return [Regular((Grid((len(ranks),), ranks, d),), (RegularItem(0, "w", "float32", s, 0),
                                                          RegularItem(1, "b", "float32", (4,), 0)))
                for ranks, s, d in zip(meshes, shape, dims)]

    sub = lists((0, 2), (1, 3))
    plans = [_plan(r, sub[r % 2]) for r in range(4)]
    assert submesh_replicas(plans) == across_meshes(plans) == {"w", "b"}
    assert submesh_replicas([_plan(r, sub[0]) for r in (0, 2)]) == set()  # one mesh
    other = lists((0, 2), (1, 3), shape=((4, 4), (4, 5)))  # "w" differs in shape: not replicas
    assert submesh_replicas([_plan(r, other[r % 2]) for r in range(4)]) == {"b"}
    placed = lists((0, 2), (1, 3), dims=((0,), (1,)))  # split on another dim: not alike
    assert submesh_replicas([_plan(r, placed[r % 2]) for r in range(4)]) == set()
    overlap = lists((0, 1), (1, 2))  # meshes sharing rank 1: a conflict, not replicas
    assert submesh_replicas([_plan(0, overlap[0]), _plan(1, overlap[0]),
                             _plan(2, overlap[1])]) == set()
    from ckptio.format.types import WriteItem

    def chunked(rank: int, domain: str) -> RankPlan:  # per chunk (a subgroup's save)
        item = WriteItem("p", "tensor", "float32", (4,), Chunk((0,), (4,)), 16)
        return RankPlan(rank, {0: item}, frozenset({"p"}), {}, (), (), {"d": []}, {0: domain})

    assert across_meshes([chunked(0, "mesh-a"), chunked(1, "mesh-b")]) == {"p"}
    assert across_meshes([chunked(0, "mesh-a"), chunked(1, "mesh-a")]) == set()


def test_a_tie_stands_for_the_key_on_ranks_that_see_it():
    """A rank whose piece of a tied tensor is empty sees no tie and lists the alias key as a
    regular item; the ranks that see the tie list the tie instead: accepted. A rank holding
    neither is refused."""
    grid = Grid((2,), (0, 1), (0,))
    emb = RegularItem(0, "emb", "float32", (1, 4), 0)  # 1 row in 2 pieces: rank 1's is empty
    blind = Regular((grid,), (emb, RegularItem(1, "head", "float32", (1, 4), 0)))
    seeing = Regular((grid,), (emb,))
    tied = RankPlan(0, {}, frozenset(), {}, (), (("head", "emb"),), {"d": []}, {}, seeing)
    check_regular([tied, _plan(1, blind)], PlanConflict)
    untied = RankPlan(0, {}, frozenset(), {}, (), (), {"d": []}, {}, seeing)
    with pytest.raises(PlanConflict, match="'head': rank 0 is in its device mesh"):
        check_regular([untied, _plan(1, blind)], PlanConflict)
    assert blind.chunk_is_empty("head", 1) and not blind.chunk_is_empty("head", 0)
