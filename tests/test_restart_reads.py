"""A restarting job's load reads each rank's part in few large requests: a small replicated
tensor (a bias, a norm) that several ranks want is read by the rank whose reads of its data
file take it in (planning/shared_reads.assign), not by whichever rank had the fewest bytes,
which read it alone, one small request among another rank's large reads (docs/BENCH_RESTART.md,
round six). Real gloo ranks, fresh processes, the defaults; bodies in restart_reads_cases.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import restart_reads_cases as cases
from ckptio.testing.rank_processes import run_ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("restart_reads") / "ck"
    run_ranks(2, cases.save, str(path))
    return path


def test_each_rank_reads_its_part_in_few_requests(saved: Path) -> None:
    path = str(saved)
    data = sum(f.stat().st_size for f in Path(path).glob("data-*"))
    got = run_ranks(2, cases.load, path)
    assert all(g["equal"] for g in got), got
    # before: each rank read about half the small tensors of the other rank's file, one
    # request each (11 per rank here)
    assert all(g["requests"] <= 4 for g in got), got
    assert sum(g["read"] for g in got) <= data + (64 << 10), ([g["read"] for g in got], data)


def test_a_flipped_byte_in_a_small_replicated_tensor_is_still_caught(saved: Path,
                                                                     tmp_path: Path) -> None:
    """The rank that now reads a bias checks it: the load fails on both ranks, naming it."""
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    body = json.loads((path / "manifest.json").read_bytes().split(b"\n", 1)[1])
    entry = next(t for t in body["tensors"] if t["key"] == "l5.b")
    with open(path / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + 7)
        byte = f.read(1)[0]
        f.seek(entry["offset"] + 7)
        f.write(bytes([byte ^ 0x04]))
    got = run_ranks(2, cases.load_error, str(path))
    assert all(g is not None for g in got), got
    assert any(kind == "CorruptCheckpointError" and "l5.b" in message for kind, message in got), got


def test_the_manifest_is_read_once_and_handed_to_the_other_ranks(saved: Path) -> None:
    """One rank reads the manifest and checks the data files' sizes; the other decodes the
    bytes it was sent (distributed/loadsteps.SharedManifest; before: every rank read it and
    checked every data file, on shared storage one read and one listing per rank). Each index
    file is opened by one rank (the same layout: each its own writer's). Options.
    broadcast_replicated=False: every rank reads for itself, as before."""
    got = run_ranks(2, cases.load_opens, str(saved))
    assert all(g["equal"] for g in got), got
    assert [g["manifest"] for g in got] == [1, 0], got
    assert got[1]["sizes"] == 0, got
    opened = [name for g in got for name in g["index"]]
    assert len(opened) == len(set(opened)) == 2, got
    alone = run_ranks(2, cases.load_opens, str(saved), False)
    assert all(g["equal"] for g in alone), alone
    assert [g["manifest"] for g in alone] == [1, 1], alone


def test_no_checkpoint_is_said_on_every_rank(tmp_path: Path) -> None:
    """The rank that reads the manifest finds none: every rank reads for itself and raises
    the same error (the foreign formats' dispatch behind it unchanged)."""
    got = run_ranks(2, cases.load_missing, str(tmp_path / "nothing"))
    assert got == ["CheckpointNotFoundError"] * 2, got


def test_a_rank_that_opens_a_file_leaves_no_rank_waiting(saved: Path, tmp_path: Path) -> None:
    """Rank 1's path names a file (no manifest step of its own): it still takes its part of
    the step, so rank 0 goes on and fails at the next step, naming rank 1, well within the
    run's deadline (before, rank 0 waited for rank 1 to read the manifest until the group's
    timeout, here longer than the run's)."""
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint" * 64)
    got = run_ranks(2, cases.load_one_other_path, str(saved), str(junk), timeout_s=120)
    assert got[0] == "RankFailedError" and got[1] is not None, got
