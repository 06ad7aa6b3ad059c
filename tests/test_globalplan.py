"""The coordinator's decisions, without processes: who writes replicas, what stays per rank,
what ranks must agree on, and how trees merge."""

from __future__ import annotations

import pytest

from ckptio.distributed import wire
from ckptio.planning.globalplan import PlanConflict, RankPlan, merge_trees, per_rank_keys, plan_global
from ckptio.format.types import Chunk, ObjectEntry, WriteItem


def item(key: str, nbytes: int, chunk: Chunk | None = None, shape=(4,)) -> WriteItem:
    return WriteItem(key, "tensor", "uint8", shape, chunk or Chunk.whole(shape), nbytes)


def rank_plan(rank: int, items, sharded=(), digests=None, objects=(), tree=None, mesh="mesh-a",
              aliases=()) -> RankPlan:
    """Sharded items are DTensors on ``mesh`` (None: hand-made shards, known by digest)."""
    domains = {n: mesh for n, i in enumerate(items) if i.key in sharded} if mesh else {}
    digests = dict(enumerate(digests)) if digests is not None else {
        n: "0" * 16 for n, i in enumerate(items) if n not in domains}
    return RankPlan(rank, dict(enumerate(items)), frozenset(sharded), digests, tuple(objects),
                    tuple(aliases), tree if tree is not None else {"d": []}, domains)



def test_replicas_written_once_and_spread_by_bytes():
    # four replicated tensors of decreasing size on 2 ranks: each goes to the rank with fewer
    # bytes so far, biggest first: 100 -> rank 0; 60, 50 -> rank 1; 10 -> rank 0
    items = [item("a", 100, shape=(100,)), item("b", 60, shape=(60,)), item("c", 50, shape=(50,)),
             item("d", 10, shape=(10,))]
    plans = [rank_plan(r, items) for r in range(2)]
    out = plan_global(plans)
    keys = [[items[i].key for i in a.writes] for a in out.assignments]
    assert sorted(keys[0] + keys[1]) == ["a", "b", "c", "d"]  # each once
    loads = [sum(items[i].nbytes for i in a.writes) for a in out.assignments]
    assert loads == [110, 110]


def test_sharded_regions_are_replicas_only_when_the_same_region():
    shape = (8, 4)
    top, bottom = Chunk((0, 0), (4, 4)), Chunk((4, 0), (4, 4))
    # 2-D mesh 2 x 2: ranks 0,1 hold the top half (replicas), ranks 2,3 the bottom half
    plans = [rank_plan(r, [item("w", 16, top if r < 2 else bottom, shape)], sharded={"w"})
             for r in range(4)]
    out = plan_global(plans)
    writers = [r for r, a in enumerate(out.assignments) if a.writes]
    assert len(writers) == 2 and writers[0] in (0, 1) and writers[1] in (2, 3)


def test_plain_tensors_differing_between_ranks_stay_per_rank():
    plans = [rank_plan(r, [item("rng", 4), item("same", 4)],
                       digests=(f"{r:016x}", "f" * 16)) for r in range(3)]
    assert per_rank_keys(plans) == {"rng"}
    out = plan_global(plans)
    for a in out.assignments:
        assert 0 in a.writes and 0 in a.own  # each rank writes its own rng
    assert sum(1 in a.writes for a in out.assignments) == 1  # "same" once


def test_objects_equal_everywhere_are_global_else_per_rank():
    plans = [rank_plan(r, [], objects=[ObjectEntry("step", ["int", 5]),
                                       ObjectEntry("pos", ["int", r])]) for r in range(2)]
    objects = plan_global(plans).objects
    assert ObjectEntry("step", ["int", 5]) in objects
    assert {(o.key, o.rank) for o in objects if o.key == "pos"} == {("pos", 0), ("pos", 1)}


def test_disagreeing_ranks_are_named():
    a = rank_plan(0, [item("w", 16, Chunk((0,), (4,)), (8,))], sharded={"w"})
    b = rank_plan(1, [WriteItem("w", "tensor", "float32", (8,), Chunk((4,), (4,)), 16)], sharded={"w"})
    with pytest.raises(PlanConflict, match="rank 0.*rank 1"):
        plan_global([a, b])
    c = rank_plan(1, [item("w", 8)])  # plain on rank 1, sharded on rank 0
    with pytest.raises(PlanConflict, match="sharded tensor on rank 0 but a plain tensor on rank 1"):
        plan_global([a, c])


def test_same_key_on_two_meshes_is_refused():
    """Pipeline stages whose state uses the same keys (optimizer state indexed 0..n): DTensors
    on different meshes are different tensors, never replicas."""
    shape = (8,)
    plans = [rank_plan(r, [item("0.w", 16, Chunk((0,), (8,)), shape)], sharded={"0.w"},
                       mesh=f"stage{r}") for r in range(2)]
    with pytest.raises(PlanConflict, match="different device meshes by rank 0 and rank 1"):
        plan_global(plans)


def test_hand_made_shards_are_replicas_only_with_equal_bytes():
    region = Chunk((0,), (8,))
    same = [rank_plan(r, [item("w", 8, region, (8,))], sharded={"w"}, mesh=None,
                      digests=["a" * 16]) for r in range(2)]
    assert sum(len(a.writes) for a in plan_global(same).assignments) == 1
    differ = [rank_plan(r, [item("w", 8, region, (8,))], sharded={"w"}, mesh=None,
                        digests=[f"{r:016x}"]) for r in range(2)]
    with pytest.raises(PlanConflict, match="same region .* different values"):
        plan_global(differ)


def test_missing_or_overlapping_shards_are_refused_before_writing():
    top = Chunk((0, 0), (4, 4))
    gap = [rank_plan(r, [item("w", 16, top, (8, 4))], sharded={"w"}) for r in range(2)]
    # both ranks hold the top half on one mesh: replicas; the bottom half is nobody's
    with pytest.raises(PlanConflict, match="16 elements of a tensor of 32.*missing"):
        plan_global(gap)
    overlap = [rank_plan(0, [item("w", 24, Chunk((0, 0), (6, 4)), (8, 4))], sharded={"w"}),
               rank_plan(1, [item("w", 16, Chunk((4, 0), (4, 4)), (8, 4))], sharded={"w"})]
    with pytest.raises(PlanConflict, match="overlap"):
        plan_global(overlap)


def test_a_piece_may_miss_shards_but_not_overlap():
    """One rank's piece of a job's state (the memory tier with redundancy) holds its shards
    only: its missing rows are the other ranks' pieces; overlapping shards stay refused."""
    mine = [rank_plan(0, [item("w", 16, Chunk((0, 0), (4, 4)), (8, 4))], sharded={"w"})]
    assert plan_global(mine, piece=True).assignments[0].writes == (0,)
    with pytest.raises(PlanConflict, match="missing"):
        plan_global(mine)  # not a piece: refused as before
    twice = [rank_plan(0, [item("w", 24, Chunk((0, 0), (6, 4)), (8, 4)),
                           item("w", 16, Chunk((4, 0), (4, 4)), (8, 4))], sharded={"w"})]
    with pytest.raises(PlanConflict, match="overlap"):
        plan_global(twice, piece=True)


def test_a_key_that_is_a_tensor_here_and_a_value_there_is_refused():
    plans = [rank_plan(0, [item("x", 4)]), rank_plan(1, [], objects=[ObjectEntry("x", ["none", None])])]
    with pytest.raises(PlanConflict, match="tensor on rank 0 but a none on rank 1"):
        plan_global(plans)


def test_a_tie_unseen_on_an_empty_shard_is_kept():
    """Uneven sharding can leave a rank an empty shard of a tied weight: it cannot see the tie
    (no storage), so its empty item of the alias key is not written; a non-empty one fails."""
    shape = (4, 2)
    full = [item("emb", 8, Chunk((0, 0), (4, 2)), shape)]
    empty = [item("emb", 0, Chunk((4, 0), (0, 2)), shape), item("head", 0, Chunk((4, 0), (0, 2)), shape)]
    plans = [rank_plan(0, full, sharded={"emb", "head"}, aliases=[("head", "emb")]),
             rank_plan(1, empty, sharded={"emb", "head"})]
    out = plan_global(plans)
    assert out.aliases == (("head", "emb"),)
    assert 1 not in out.assignments[1].writes  # rank 1's empty "head" item is not written
    wrong = [plans[0], rank_plan(1, [item("emb", 8, Chunk((0, 0), (4, 2)), shape),
                                     item("head", 8, Chunk((0, 0), (4, 2)), shape)],
                                 sharded={"emb", "head"})]
    with pytest.raises(PlanConflict, match="tied to 'emb'.* on rank 0 but not on rank 1"):
        plan_global(wrong)


def test_a_tie_on_one_pipeline_stage_is_kept_where_other_ranks_lack_the_key():
    """Stage 0 ties "head" to "emb"; stage 1 holds neither (its own layers): the tie is kept.
    A rank holding "head" untied (a tensor of its own, or a Python value) is refused."""
    shape = (4, 2)
    tied = rank_plan(0, [item("emb", 8, Chunk((0, 0), shape), shape)], aliases=[("head", "emb")])
    other = rank_plan(1, [item("layers.3.w", 8, Chunk((0, 0), shape), shape)])
    out = plan_global([tied, other])
    assert out.aliases == (("head", "emb"),)
    assert out.assignments[1].writes == (0,)
    untied = rank_plan(1, [item("head", 8, Chunk((0, 0), shape), shape)])
    with pytest.raises(PlanConflict, match="tied to 'emb'.* on rank 0 but not on rank 1"):
        plan_global([tied, untied])
    a_value = rank_plan(1, [], objects=[ObjectEntry("head", ["none", None])])
    with pytest.raises(PlanConflict, match="tied to 'emb'.* on rank 0 but not on rank 1"):
        plan_global([tied, a_value])


def test_trees_merge_dicts_and_refuse_other_differences():
    t0 = {"d": [["layers.0.w", {"k": "layers.0.w"}], ["step", {"k": "step"}]]}
    t1 = {"d": [["layers.1.w", {"k": "layers.1.w"}], ["step", {"k": "step"}]]}
    merged = merge_trees([t0, t1])
    assert [k for k, _ in merged["d"]] == ["layers.0.w", "step", "layers.1.w"]
    with pytest.raises(PlanConflict, match="structure"):
        merge_trees([{"l": [{"k": "0"}]}, {"l": [{"k": "0"}, {"k": "1"}]}])


def _decoded(parts: dict[str, bytes], rank: int, message: bytes) -> RankPlan:
    """What the coordinator rebuilds from a rank's message and the parts it published."""
    values = wire.decode_plan(message, rank)
    assert isinstance(values, wire.Values)
    layout = wire.decode_layout(parts[values.fingerprint], values.fingerprint)
    regular = (None if layout.regular_fp is None
               else wire.decode_regular(parts[layout.regular_fp], layout.regular_fp))
    return layout.plan(rank, values, wire.decode_tree(parts[layout.tree_fp], layout.tree_fp),
                       regular)


def test_wire_round_trip_layout_published_apart():
    from ckptio.format.grid import Grid
    from ckptio.planning.regular_items import Regular, RegularItem

    regular = Regular((Grid((2, 2), (0, 1, 2, 3), (0, -1)),),
                      (RegularItem(2, "dt", "bfloat16", (6, 3), 0),))
    plan = RankPlan(3, {0: item("w", 16, Chunk((8,), (4,)), (16,)), 1: item("p", 4)},
                    frozenset({"w"}), {1: "0" * 16}, (ObjectEntry("o", ["int", 1]),), (),
                    {"d": [["w", {"k": "w"}]]}, {0: "mesh-a"}, regular)
    parts = wire.layout_parts(plan)
    fp = list(parts)[-1]
    assert _decoded(parts, 3, wire.encode_plan(plan, fp=fp)) == plan
    # values go every time; the parts are the same bytes for another rank of the same layout
    changed = RankPlan(4, plan.items, plan.sharded, plan.digests, (ObjectEntry("o", ["int", 2]),),
                       plan.aliases, plan.tree, plan.domains, regular)
    assert wire.layout_parts(changed) == parts
    assert _decoded(parts, 4, wire.encode_plan(changed, fp=fp)) == changed
    assert wire.decode_plan(wire.encode_plan(None, "boom"), 1) == "boom"
    with pytest.raises(wire.WireError, match="fingerprint"):  # altered bytes are refused
        wire.decode_layout(parts[fp].replace(b'"w"', b'"x"'), fp)
    with pytest.raises(wire.WireError):
        wire.decode_plan(b'{"rank": 1}', 1)
    with pytest.raises(wire.WireError):  # an item encoded as nothing
        broken = b'[[[]],[],[],[],"t",null]'
        wire.decode_layout(broken, wire.fingerprint(broken))
    clash = wire.decode_layout(parts[fp], fp)  # regular item 2 is also a per-chunk item
    clash.items[2] = item("dt", 4)
    with pytest.raises(wire.WireError, match="both per chunk and per tensor"):
        clash.check_regular(regular, fp)
    bad = b'[[[[2],[0,1],[0]]],[[0,"k","float32",[4],0]]]'  # a 2-mesh with 2 ranks: fine
    assert wire.decode_regular(bad, wire.fingerprint(bad)).items[0].key == "k"
    for wrong in (b'[[[[2],[0],[0]]],[]]', b'[[[[2],[0,1],[3]]],[[0,"k","float32",[4],0]]]',
                  b'[[],[[0,"k","float32",[4],0]]]', b'[[[[0],[],[0]]],[]]',  # a 0-sized mesh
                  b'[[[[2],[1,1],[0]]],[]]',  # a rank twice
                  b'[[[[2],[0,1],[0]]],[[0,"k","float32",[4],0],[1,"k","float32",[4],0]]]',
                  b'[[[[2],[0,1],[0]]],[[0,"k","float32",[4],0],[0,"j","float32",[4],0]]]'):
        with pytest.raises(wire.WireError, match="malformed"):
            wire.decode_regular(wrong, wire.fingerprint(wrong))


def test_written_results_are_keyed_by_item_not_position():
    from ckptio.format.types import FileInfo, IndexFile, TensorEntry, Written

    assigned = {0: item("a", 8), 2: item("c", 16)}
    files = [FileInfo("data-f", 64, 1)]

    def entry(key: str, offset: int) -> TensorEntry:
        return TensorEntry(key, "tensor", "float32", (4,), Chunk.whole((4,)), "data-f", offset, 8,
                           f"{offset:016x}", None, ())

    def result(entries: dict[int, TensorEntry], index: IndexFile | None = None) -> bytes:
        return wire.encode_result(Written(entries, tuple(files), index))

    forward = result({0: entry("a", 0), 2: entry("c", 32)})
    backward = result({2: entry("c", 32), 0: entry("a", 0)})
    for data in (forward, backward):
        got = wire.decode_result(data, 1, assigned)
        assert got.index is None and got.files == tuple(files)
        # the rows are made of the coordinator's items (here uint8), not the sender's fields
        assert {i: (e.key, e.dtype, e.offset, e.checksum) for i, e in got.entries.items()} == {
            0: ("a", "uint8", 0, f"{0:016x}"), 2: ("c", "uint8", 32, f"{32:016x}")}
    with pytest.raises(wire.WireError, match="no entry"):
        wire.decode_result(result({0: entry("a", 0)}), 1, assigned)
    with pytest.raises(wire.WireError):  # an index the rank was not assigned
        wire.decode_result(result({0: entry("a", 0), 1: entry("b", 8)}), 1, assigned)
    with pytest.raises(wire.WireError, match="index file"):  # not one of the rank's files
        wire.decode_result(result({0: entry("a", 0), 2: entry("c", 32)},
                                  IndexFile(1, "data-elsewhere", 10, "0" * 16)), 1, assigned)
