"""A resharded load reads no more than its pieces need: a checksum block that the pieces of
two ranks share (a cut inside it) is read from storage by one of them and sent to the other,
which checks it against the block's checksum (Options.broadcast_replicated, on by default).
Real gloo ranks loading a one-process checkpoint; bodies in reshard_once_cases.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import reshard_once_cases as cases
from ckptio.testing.rank_processes import run_ranks

SLACK = 64 << 10  # the index and 4 KiB-aligned edges of each shared block
# Reads split where the staging buffers fall, which depends on the pace of the reads before them:
# on a loaded machine (CI) a 1 -> 3 load read 1.057x. Before shared blocks: 1.11x (1 -> 2) and
# 1.23x (1 -> 3), both still over this bound.
BOUND = 1.08


def _saved(tmp_path: Path) -> tuple[str, int]:
    path = str(tmp_path / "ck")
    cases.save_one(path)
    data = sum(f.stat().st_size for f in Path(path).iterdir() if f.name != "manifest.json")
    return path, data


@pytest.mark.parametrize("world", [2, 3])
def test_a_load_onto_more_ranks_reads_each_block_once(tmp_path, world):
    path, data = _saved(tmp_path)
    got = run_ranks(world, cases.load_sharded, path)
    read = [g["read"] for g in got]
    assert all(g["equal"] and not g["warnings"] for g in got), got
    assert sum(read) <= BOUND * data + SLACK, (read, data)


def test_with_the_option_off_each_rank_reads_whole_blocks(tmp_path):
    path, data = _saved(tmp_path)
    got = run_ranks(2, cases.load_sharded, path, False)
    assert all(g["equal"] for g in got), got
    assert sum(g["read"] for g in got) > 1.1 * data, ([g["read"] for g in got], data)


def test_reads_go_on_while_the_shared_blocks_are_exchanged(tmp_path):
    """A rank reads what needs no block from another rank while the blocks are exchanged (each
    rank's first exchange is held until that rank reads from storage): before, every read
    waited for the exchange to end, and the exchange, not the disk, set the pace."""
    path, data = _saved(tmp_path)
    got = run_ranks(2, cases.load_reading_during_exchange, path)
    assert all(g["equal"] and not g["warnings"] for g in got), got
    assert any(g["read_during_exchange"] for g in got), got
    assert sum(g["read"] for g in got) <= BOUND * data + SLACK, ([g["read"] for g in got], data)


def test_a_shared_block_damaged_between_ranks_is_caught_by_its_receiver(tmp_path):
    """The blocks are exchanged on a thread of their own: its error is raised by the load,
    once, and the sender learns the load failed."""
    path, _data = _saved(tmp_path)
    got = run_ranks(2, cases.load_flipped, path)
    kind, message = got[0]["error"]
    assert kind == "CorruptCheckpointError" and "received from rank 1" in message, got
    assert got[1]["error"] is not None and got[1]["error"][0] == "RankFailedError", got


def test_torch_box_arithmetic_runs_once_per_shape(tmp_path):
    """A DTensor's region is torch's arithmetic (compute_local_shape_and_global_offset, which
    builds index tensors per call): a load of many same-shaped DTensors runs it once per shape
    and mesh, not once per tensor (before: at least once per tensor, before any read)."""
    path, n = str(tmp_path / "ck"), 40
    cases.save_alike(path, n)
    got = run_ranks(2, cases.count_boxes, path, n)
    assert all(g["equal"] for g in got), got
    assert all(g["calls"] <= 2 for g in got), got
