"""Many ranks on real gloo processes: round trips, resharding N -> M, replicas written once,
per-rank values, failures raised everywhere, plan reuse. Bodies in dist_cases.py."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import xxhash

import ckptio
from ckptio.testing.rank_processes import run_ranks

import dist_cases as cases
from special_values import bits_equal


def _manifest(path) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        f.readline()
        return json.loads(f.readline())


def test_ranks_start_with_ckptio_imported_once_by_the_forkserver():
    """Each rank is forked with ckptio's API modules already imported (``import ckptio`` alone
    imports none of them) and torch._dynamo (which a process's first optimizer imports): no rank
    imports them again (docs/TESTS.md, "Where the time goes (per file)")."""
    want = ["torch._dynamo", "ckptio.api", "ckptio.shared", "ckptio.managing.manager"]
    assert run_ranks(2, cases.api_imported) == [want, want]


def test_two_ranks_round_trip_replicas_once_and_per_rank_values(tmp_path):
    path = str(tmp_path / "ck")
    body = run_ranks(2, cases.roundtrip, path)[0]
    tensors = ckptio.Checkpointer().manifest(path).tensors  # regular DTensors' from index files
    by_key: dict[str, list] = {}
    for t in tensors:
        by_key.setdefault(t.key, []).append(t)
    # replicated tensors: stored once each. Replicated DTensors by the replica their key's hash
    # names (a regular layout: every rank knows it without asking; tests/test_grid.py checks
    # the spread over many keys)
    assert len(by_key["r1"]) == 1 and len(by_key["r2"]) == 1 and len(by_key["same"]) == 1
    assert len(by_key["nan_same"]) == 1  # NaN payloads: equal bytes, so a replica
    for key in ("r1", "r2"):
        writer = int(by_key[key][0].file.split("-r")[1][:5])
        assert writer == xxhash.xxh3_64_intdigest(key.encode()) % 2, key
    # sharded: one chunk per rank; per-rank plain tensors: one entry per rank, marked
    assert sorted(t.chunk.offsets[0] for t in by_key["w"]) == [0, 4]
    assert sorted(t.rank for t in by_key["rng"]) == [0, 1]
    assert sorted(t.rank for t in by_key["mine"]) == [0, 1]
    objects = {(o["key"], o.get("rank")) for o in body["objects"]}
    assert ("step", None) in objects and ("loader.position", 0) in objects
    # bytes on disk: every stored byte once (no replica twice)
    unique = sum(t.nbytes for t in tensors)
    expected = (7 * 5 * 4 + 2 * 64 * 64 * 4 + 4096 * 4 + 9 * 4 * 4
                + 2 * torch.get_rng_state().numel() + 2 * 3 * 4)
    assert unique == expected


def test_per_rank_values_need_a_rule_on_another_world_size(tmp_path):
    path = str(tmp_path / "ck")
    run_ranks(2, cases.roundtrip, path)
    with pytest.raises(ckptio.StateMismatchError, match="rng") as info:
        ckptio.load(path)
    assert "per_rank_from" in str(info.value)
    taken = ckptio.load(path, per_rank_from=1)
    assert bits_equal(taken["mine"], torch.full((3,), 1.0))
    assert taken["loader"]["position"] == 1001
    assert bits_equal(taken["w"], cases.reference("a"))  # consolidated from both shards
    assert bits_equal(taken["nan_same"], cases.special_reference("nan32"))


MATRIX = [
    (2, "shard0", 1, "full"),
    (1, "full", 4, "shard0"),
    (4, "shard0", 2, "shard1"),
    (2, "shard0", 4, "mesh2d"),
    (4, "mesh2d", 2, "replicate"),
    (2, "flat", 4, "flat2"),
    (4, "flat", 1, "full"),
    (2, "shard1", 2, "flat"),
    (4, "box", 2, "shard0"),
    (3, "checkpointable", 2, "shard1"),
    (2, "mesh2d", 3, "checkpointable"),
]


@pytest.mark.parametrize("saved_on,saved_as,loaded_on,loaded_as", MATRIX,
                         ids=[f"{a}{b}-to-{c}{d}" for a, b, c, d in MATRIX])
def test_reshard_matrix_bitwise(tmp_path, saved_on, saved_as, loaded_on, loaded_as):
    path = str(tmp_path / "ck")
    run_ranks(saved_on, cases.save_layout, path, saved_as)
    run_ranks(loaded_on, cases.load_layout, path, loaded_as)
    whole = ckptio.load(path)  # consolidation on one process, no torch.distributed
    for name in cases.SHAPES:
        assert bits_equal(whole["model"][name], cases.reference(name)), name
    for name in cases.SPECIALS:  # NaN payloads, -0.0, subnormals, float8, complex64, bool
        assert bits_equal(whole["special"][name], cases.special_reference(name)), name


def test_a_rank_reads_only_what_overlaps(tmp_path):
    """Load one small box of a big sharded tensor: far fewer bytes are read than stored."""
    path = str(tmp_path / "ck")
    run_ranks(2, cases.save_layout, path, "shard0")
    big = torch.arange(4096 * 1024, dtype=torch.float32).reshape(4096, 1024)
    ckptio.save({"t": ckptio.TensorShard(big, (4096, 1024), (0, 0))}, str(tmp_path / "big"))
    part = ckptio.TensorShard(torch.zeros(16, 1024), (4096, 1024), (2000, 0))
    report = ckptio.load(str(tmp_path / "big"), {"t": part})
    assert bits_equal(part.local, big[2000:2016])
    assert report.nbytes_read <= 2 * (1 << 20)  # the 64 KiB wanted, widened to checksum blocks


def test_flipped_byte_in_a_partial_read_is_caught(tmp_path):
    big = torch.arange(4096 * 1024, dtype=torch.float32).reshape(4096, 1024)
    path = tmp_path / "big"
    ckptio.save({"t": big}, str(path))
    entry = _manifest(path)["tensors"][0]
    data = os.path.join(path, entry["file"])
    wanted_byte = entry["offset"] + 2000 * 1024 * 4 + 100  # inside rows 2000..2015
    far_byte = entry["offset"] + 100  # row 0: outside what the partial load reads
    for where, should_fail in ((far_byte, False), (wanted_byte, True)):
        with open(data, "r+b") as f:
            f.seek(where)
            old = f.read(1)
            f.seek(where)
            f.write(bytes([old[0] ^ 0xFF]))
        part = ckptio.TensorShard(torch.zeros(16, 1024), (4096, 1024), (2000, 0))
        if should_fail:
            with pytest.raises(ckptio.CorruptCheckpointError, match="checksum mismatch"):
                ckptio.load(str(path), {"t": part})
        else:
            ckptio.load(str(path), {"t": part})
            assert bits_equal(part.local, big[2000:2016])


@pytest.mark.parametrize("where", ["plan", "write"])
def test_failure_on_one_rank_raises_everywhere_and_commits_nothing(tmp_path, where):
    path = str(tmp_path / "ck")
    errors = run_ranks(2, cases.fault_on_one_rank, path, where)
    assert all(e != "no error" for e in errors), errors
    assert "rank 1" in errors[0], errors[0]
    assert "RankFailedError" in errors[0]
    # the first checkpoint is intact and is what loads; the failed save left no data file
    whole = ckptio.load(path)
    for name in cases.SHAPES:
        assert bits_equal(whole[name], cases.reference(name)), name
    named = {f["name"] for f in _manifest(path)["files"]}
    assert {n for n in os.listdir(path) if n.startswith("data-")} == named


def test_plan_reuse_never_writes_stale_values(tmp_path):
    root = str(tmp_path)
    reused = run_ranks(2, cases.reuse, root)
    assert reused[0] == [1]  # the second save reused the plan; the third re-planned (plain split)
    run_ranks(2, cases.check_reuse, root)


def test_consolidation_reads_each_stored_byte_once(tmp_path):
    """Whole small entries and parts of sharded ones go through one read plan: a read that
    coalesces through a gap must not fetch bytes another read fetches again."""
    path = str(tmp_path / "ck")
    run_ranks(2, cases.save_interleaved, path)
    full = cases.interleaved_full()
    state = {k: torch.zeros_like(v) for k, v in full.items()}
    report = ckptio.load(path, state)
    assert all(bits_equal(state[k], v) for k, v in full.items())
    stored = sum(t.nbytes for t in ckptio.Checkpointer().manifest(path).tensors)
    assert report.nbytes_read <= 1.05 * stored, (report.nbytes_read, stored)


def test_lazy_save_of_dtensor_parameters_holds_the_values_before_the_step(tmp_path):
    run_ranks(2, cases.lazy_dtensor, str(tmp_path / "ck"))


def test_an_error_seen_by_some_ranks_only_does_not_hang_the_next_save(tmp_path):
    outcome = run_ranks(2, cases.unreported_error_on_one_rank, str(tmp_path / "ck"), timeout_s=120)
    assert outcome == ["RankFailedError", "StorageIOError"], outcome


def test_a_load_failing_on_one_rank_raises_on_every_rank(tmp_path):
    outcome = run_ranks(2, cases.load_fails_on_one_rank, str(tmp_path / "ck"))
    assert outcome == ["RankFailedError", "StateMismatchError"], outcome


def test_ranks_passing_different_paths_are_refused_on_every_rank(tmp_path):
    """A save whose ranks name different checkpoints used to "succeed" on every rank, rank 0
    committing a manifest that names rank 1's file in the other directory (a damaged
    checkpoint); a load gave rank 1 rank 0's manifest (an unrelated missing-file error). Both
    now fail on every rank naming both paths; a manager keeps its previous step."""
    root = str(tmp_path)
    out = run_ranks(2, cases.paths_disagree, root)
    for rank, got in enumerate(out):
        for what in ("save", "load", "manager"):
            assert "ranks disagree on the checkpoint" in got[what], (rank, what, got[what])
            assert "pass the same path on every rank" in got[what], (rank, what, got[what])
        assert "step-0" in got["save"] and "step-1" in got["save"], got["save"]
        assert f"{root}/A" in got["load"] and f"{root}/B" in got["load"], got["load"]
        assert "step-2" in got["manager"] and "step-3" in got["manager"], got["manager"]
        assert got["committed"] == ["A", "B"], got["committed"]  # neither step-0 nor step-1
        assert got["restored"] == 1 and got["same"], got
    assert sorted(os.listdir(tmp_path / "run")) == ["step-1"]


def _reshard_runs_exit_cleanly(tmp_path, runs: int) -> None:
    """``runs`` runs of 4 spawned savers and 2 spawned loaders; run_ranks fails a run if any
    rank exits with a status other than 0."""
    for run in range(runs):
        path = str(tmp_path / f"ck{run}")
        run_ranks(4, cases.save_layout, path, "shard0", spawn=True)
        run_ranks(2, cases.load_layout, path, "shard1", spawn=True)


def test_a_4_to_2_reshard_run_exits_cleanly(tmp_path):
    """Issue 16: a rank that had saved or loaded and destroyed its process group aborted at
    interpreter exit (SIGABRT) in about 1 of 10 such runs: ckptio's private gloo group
    (gone: ranks talk through the job's store) outlived destroy_process_group, and its worker
    thread freed a tensor after the interpreter began finalizing. Spawned ranks finalize as a
    torchrun job's do. One run of 4 savers and 2 loaders; the slow tier repeats it."""
    _reshard_runs_exit_cleanly(tmp_path, 1)


@pytest.mark.slow
def test_repeated_4_to_2_reshard_runs_exit_cleanly(tmp_path):
    """The run above three times (issue 16's abort came in about 1 of 10 runs)."""
    _reshard_runs_exit_cleanly(tmp_path, 3)


def test_subgroups_save_and_load_their_own_checkpoints(tmp_path):
    """process_group= a subgroup: its ranks talk among themselves (keys of their own in the
    job's store), two subgroups at once do not mix."""
    results = run_ranks(4, cases.save_load_in_subgroups, str(tmp_path))
    for rank, got in enumerate(results):
        half = rank // 2
        assert got["w"] == (torch.arange(16.0).reshape(4, 4) * (half + 1)).tolist()
        assert got["mine"] == torch.full((4, 4), float(rank)).tolist() and got["step"] == 3
    assert ckptio.load(str(tmp_path / "half1"))["r3"][0, 0] == 3.0


def test_regular_dtensor_layouts_planned_per_tensor_round_trip(tmp_path):
    """FSDP x TP-like DTensors on a 2 x 2 mesh (nested Shard(0), Shard(1), Replicate, uneven
    sizes, empty pieces, a tie the rank with the empty piece cannot see): planned per tensor
    (every rank computes its writes), each non-empty chunk stored exactly once, loaded back in
    place on 4 ranks and whole in one process."""
    path = str(tmp_path / "ck")
    bodies = run_ranks(4, cases.grid_roundtrip, path)
    regular = sorted(cases.GRID_LAYOUTS)
    assert [b["regular"] for b in bodies].count(regular) == 3  # "head": a tie, seen by 3 ranks
    assert sorted([*regular, "head"]) in [b["regular"] for b in bodies]
    body = bodies[0]["manifest"]
    assert body["version"] == 3 and body["aliases"] == [["head", "small"]]
    # stored per tensor: a row each in the manifest, none per chunk; an index file per writer
    assert sorted(r["key"] for r in body["regular"]) == regular
    assert not {t["key"] for t in body["tensors"]} & set(regular)
    assert sorted(i["rank"] for i in body["indexes"]) == [0, 1, 2, 3]
    entries: dict[str, list] = {}
    for t in ckptio.Checkpointer().manifest(path).tensors:  # every chunk, from the index files
        entries.setdefault(t.key, []).append(t)
    for key, (shape, _kinds) in cases.GRID_LAYOUTS.items():
        chunks = {(t.chunk.offsets, t.chunk.sizes) for t in entries[key]}
        assert len(chunks) == len(entries[key]), key  # no chunk twice
        assert sum(math.prod(s) for _o, s in chunks) == math.prod(shape), key
        assert all(math.prod(s) for _o, s in chunks), key  # empty pieces are not stored
    assert len(entries["norm"]) == 1 and len(entries["col"]) == 4 and len(entries["half"]) == 2
    whole = ckptio.load(path)
    assert whole["head"] is whole["small"]
    for n, (key, (shape, _kinds)) in enumerate(cases.GRID_LAYOUTS.items()):
        want = torch.arange(n * 1000, n * 1000 + math.prod(shape), dtype=torch.float32)
        assert bits_equal(whole[key], want.reshape(shape)), key


def test_regular_layouts_across_groups_and_subgroups(tmp_path):
    """Review findings: a layout reused from the plan cache after another group saved a
    different layout of the same shapes recorded the stale regions (loaded "fine", wrong);
    a subgroup 0..k-1 saving DTensors of a mesh beyond it was refused."""
    bodies = run_ranks(4, cases.regular_edges, str(tmp_path))
    assert bodies[:2] == ["saved", "saved"]
    full = torch.arange(64.0).reshape(8, 8)
    for name in "abcd":
        assert bits_equal(ckptio.load(str(tmp_path / name))["w"], full), name


def _listing(path) -> dict[str, bytes | int]:
    """What a directory holds: the manifest's bytes and every other file's size."""
    folder = Path(path)
    if not folder.is_dir():
        return {}
    return {f.name: f.read_bytes() if f.name == "manifest.json" else f.stat().st_size
            for f in sorted(folder.iterdir())}


@pytest.mark.parametrize("kind", ["partial", "interleaved"])
def test_placements_that_are_not_regions_are_refused_before_anything_is_written(tmp_path, kind):
    """A Partial DTensor (an addend per rank: ckptio does not reduce on save), and a hand-made
    _StridedShard whose rows interleave (no box of the tensor): refused on every rank, naming
    the key, the placement and the fix; no file is written, the previous checkpoint stays as it
    was and still loads. (FSDP2 over tensor parallelism saves: tests/test_strided_shard.py.)"""
    prev = str(tmp_path / "prev")
    run_ranks(2, cases.save_layout, prev, "shard0")
    before = _listing(prev)
    results = run_ranks(2, cases.refused_placement, str(tmp_path), kind)
    assert results[0]["placements"] == {"partial": "(Partial(sum),)",
                                        "interleaved": "(_StridedShard(dim=0, sf=2),)"}[kind]
    want = {"partial": ("'grad'", "DTensor placement Partial(sum) holds a pending reduction",
                        "t.redistribute(placements=[Replicate()]"),
            "interleaved": ("'model.0.weight'", "give this rank indices [0, 1, 4, 5] of dim 0",
                            "Redistribute it first")}[kind]
    for rank, result in enumerate(results):
        for where, error in result["errors"].items():
            assert error.startswith("UnsupportedStateError: "), (rank, where, error)
            if kind == "interleaved" and rank == 1:
                want = (want[0], "give this rank indices [2, 3, 6, 7] of dim 0", want[2])
            assert all(part in error for part in want), (rank, where, error)
    assert _listing(prev) == before
    assert _listing(tmp_path / "fresh") == {}
    whole = ckptio.load(prev)
    for name in cases.SHAPES:
        assert bits_equal(whole["model"][name], cases.reference(name)), name


def test_per_rank_from_a_mapping_or_a_function_picks_each_ranks_saved_rank(tmp_path):
    """Saved by 2 ranks (per-rank values: a tensor, a loader position, the RNG state), loaded
    in place on 3: each new rank takes the saved rank its mapping or function names."""
    path = str(tmp_path / "ck")
    run_ranks(2, cases.roundtrip, path)
    saved_rng = [ckptio.load(path, keys="rng", per_rank_from=r)["rng"].tolist() for r in (0, 1)]
    assert saved_rng[0] != saved_rng[1]
    mapping = {0: 1, 1: 1, 2: 0}
    got = run_ranks(3, cases.per_rank_values_from, path, mapping)
    for rank, loaded in enumerate(got):
        for name, source in (("mapping", mapping[rank]), ("function", (rank + 1) % 2)):
            assert loaded[name] == {"mine": [float(source)] * 3, "position": 1000 + source,
                                    "rng": saved_rng[source]}, (rank, name)
    # one process: the same rules, and a rank the rule does not name (or names wrongly) refused
    assert ckptio.load(path, keys="mine", per_rank_from={0: 1})["mine"].tolist() == [1.0] * 3
    assert ckptio.load(path, keys="mine", per_rank_from=lambda r: r)["mine"].tolist() == [0.0] * 3
    for policy, said in (({0: None}, "None"), (lambda r: 2, "2")):
        with pytest.raises(ckptio.StateMismatchError,
                           match=f"per_rank_from gave saved rank {said} for rank 0; .* ranks 0..1"):
            ckptio.load(path, keys="mine", per_rank_from=policy)
    with pytest.raises(ckptio.StateMismatchError,
                       match=r"per_rank_from \(a mapping .*\) has no entry for rank 0 of 1; .*"
                             r"ranks 0..1"):
        ckptio.load(path, keys="mine", per_rank_from={1: 0})
