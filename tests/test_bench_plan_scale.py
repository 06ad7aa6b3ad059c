"""The plan-only scale benchmark (ckptio bench plan) at tiny sizes: the simulated layout is what
ckptio would plan, every phase runs, the manifest it builds decodes and covers every tensor."""

from __future__ import annotations

import json

from ckptio import cli
from ckptio.format import manifest
from benchmarks import plan_scale


def test_layout_regions_tile_each_tensor():
    """The (dp, tp) chunks of every tensor cover it exactly once (replicas aside)."""
    tensors = plan_scale.model_tensors(20, optim=False)
    assert len(tensors) >= 20 and {t.tp for t in tensors} == {"0", "1", "r"}
    dp, tp = 3, 4
    for t in tensors:
        regions = {plan_scale.region(t, dp, tp, d, p) for d in range(dp) for p in range(tp)}
        covered = sum(c.numel for c in regions)
        total = 1
        for s in t.shape:
            total *= s
        assert covered == total, t
        if t.tp == "r":
            assert len(regions) == dp


def test_measure_small_worlds():
    tensors = plan_scale.model_tensors(30, optim=True)
    rows = [plan_scale.measure(w, 8, tensors, "float32", reps=1) for w in (8, 16)]
    n_rep = sum(t.tp == "r" for t in tensors)
    n_shard = len(tensors) - n_rep
    for row, dp in zip(rows, (1, 2)):
        # sharded tensors: one chunk per rank; tp-replicated ones once per dp group; rng per rank
        assert row["chunks"] == n_shard * row["world"] + n_rep * dp + row["world"]
        for field in plan_scale.PHASES + ("load_s", "save_total_s"):
            assert row[field] > 0, field
        assert row["manifest_bytes"] > 0 and row["bytes_per_chunk"] > 0
        assert row["reused"] >= 1 and row["decide_reused_s"] > 0  # the repeated save reused
    assert rows[1]["chunks"] > rows[0]["chunks"]


def test_manifest_is_valid_and_complete():
    """Through the coordinator's own functions: every tensor planned per tensor (one with 23
    rows over dp x tp = 24 nested pieces has an empty one), stored as one regular row, every
    rank's RNG state kept; rank 0's load reads only its dp group's index files and gets the
    chunks its regions need, each once."""
    from ckptio.distributed import collective
    from ckptio.distributed.dist import Solo
    from ckptio.loading.resolve_regular import overlapping

    tensors = plan_scale.model_tensors(12, optim=False)
    tensors[0] = plan_scale.Tensor(tensors[0].key, (23, 16), "0")  # 23 rows in 24 pieces
    dp, tp = 3, 8
    regular = plan_scale.regular_of(dp, tp, tensors, "bfloat16")
    assert len(regular.items) == len(tensors)
    group = Solo()
    messages = plan_scale.messages_of(dp * tp, dp, tp, tensors, "bfloat16",
                                      plan_scale.tree_of(tensors), regular, group)
    decision = collective.decide_plans(messages, collective.Memory(), group)
    commit = plan_scale.simulate_commit(decision, regular)
    record = manifest.decode(commit.build_manifest(), "m")
    assert record.version == 3 and record.world_size == dp * tp
    assert sorted(r.key for r in record.regular) == sorted(t.key for t in tensors)
    assert sorted(i.rank for i in record.indexes) == list(range(dp * tp))
    assert sorted(e.rank for e in record.tensors if e.key == "rng") == list(range(dp * tp))
    first = next(r for r in record.regular if r.key == tensors[0].key)
    assert len(list(overlapping(record.grids[first.grid], first, None))) == 23
    assert 0 in commit.need <= set(range(tp))  # its own, and its tp group's replica writers
    assert len(commit.need) < dp * tp
    loaded = plan_scale.load_metadata(commit.build_manifest(), commit.stored, rank=0)
    for t in tensors:
        got = [e.chunk for e in loaded.tensors if e.key == t.key]
        want = plan_scale.region(t, dp, tp, 0, 0)
        assert got == ([want] if want.numel else []), t.key


def test_cli_report(tmp_path):
    out = tmp_path / "p.json"
    md = tmp_path / "p.md"
    rc = cli.main(["bench", "plan", "--world", "8", "--tensors", "12", "--reps", "1",
                   "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["world"] == 8 and rows[0]["peak_rss_mib"] > 0
    assert "| 8 | 1 x 8 |" in md.read_text()


def test_dcp_planner_on_the_same_layout():
    """DCP's planner phases run on the simulated layout, and its .metadata holds one storage
    record per chunk ckptio's manifest holds (the RNG states under per-rank keys)."""
    from benchmarks import plan_scale_dcp

    tensors = plan_scale.model_tensors(30, optim=True)
    ours = plan_scale.measure(16, 8, tensors, "float32", reps=1)
    theirs = plan_scale_dcp.measure_dcp(16, 8, tensors, "float32", reps=1)
    assert theirs["chunks"] == ours["chunks"]
    for field in plan_scale.PHASES + ("load_s",):
        assert theirs[field] > 0, field


def test_reshard_plan_covers_each_wanted_region_as_dcp_does(capsys):
    """A (64 -> 48)-rank resharded load: ckptio plans one span per piece DCP reads (the same
    overlaps found from the grids as from DCP's chunk scan), on a first, middle and last rank."""
    from benchmarks import reshard_plan

    assert reshard_plan.main(["--save-world", "64", "--load-world", "48", "--tensors", "12",
                              "--reps", "1", "--ranks", "0,21,47"]) == 0
    ours, dcp = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert ours["engine"] == "ckptio" and dcp["engine"] == "dcp"
    for rank in (0, 21, 47):
        assert ours[f"rank{rank}_reads"] == dcp[f"rank{rank}_reads"] > 12, rank
    assert ours["chunks"] == dcp["chunks"] - 64  # DCP's count holds each rank's RNG item


def test_a_solo_group_counts_each_published_name_once():
    """Solo.published_nbytes, the published_bytes benchmarks/plan_scale.py reports."""
    from ckptio.distributed.dist import Solo

    group = Solo()
    assert group.published_nbytes() == 0
    group.publish("layout", b"abc")
    group.publish("layout", b"longer")  # a name is published once: the first kept
    group.publish("tree", b"z")
    assert group.published_nbytes() == 4 and group.fetch(["layout"]) == [b"abc"]
