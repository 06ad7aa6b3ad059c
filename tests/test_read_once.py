"""Read once, send to the others (Options.broadcast_replicated): real gloo ranks loading a
replicated state in place read its bytes from storage about once in all, not once per rank, and
each gets them bitwise; a byte damaged between ranks is caught by the receiver; a sender that
dies is read around; the option off reads everything on every rank. Bodies in
readshare_cases.py. The time bound only says nothing hung (rank_timeout_s is 3 s there)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import readshare_cases as cases
from ckptio.testing.rank_processes import run_ranks

NOT_HUNG_S = 60.0


def _data_nbytes(path: str) -> int:
    """The bytes of the checkpoint's data files (all but its manifest)."""
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.name != "manifest.json")


def _saved(tmp_path: Path) -> str:
    path = str(tmp_path / "ck")
    run_ranks(cases.WORLD, cases.save, path)
    return path


def test_a_replicated_load_reads_each_byte_once_across_ranks(tmp_path):
    path = _saved(tmp_path)
    data = _data_nbytes(path)
    got = run_ranks(cases.WORLD, cases.load, path)
    read = [g["read"] for g in got]
    assert all(g["equal"] and g["error"] is None and not g["warnings"] for g in got), got
    # once in all (reads are whole 4 KiB blocks, through small gaps), not once per rank
    assert 0.9 * data <= sum(read) <= 1.25 * data, (read, data)
    assert max(read) <= 0.7 * data, (read, data)  # shared out, not all on one rank


def test_a_dcp_directory_is_read_once_across_ranks(tmp_path):
    """A DCP checkpoint of replicated tensors, loaded in place by ckptio on every rank: each
    of its items read from storage by one rank and sent to the others, checked against the
    item's CRC-32 by each receiver."""
    path = str(tmp_path / "dcp")
    run_ranks(cases.WORLD, cases.save_dcp, path)
    data = sum(f.stat().st_size for f in Path(path).iterdir() if f.name.endswith(".distcp"))
    got = run_ranks(cases.WORLD, cases.load, path, "", 1, "", True, True)
    read = [g["read"] for g in got]
    assert all(g["equal"] and g["error"] is None and not g["warnings"] for g in got), got
    assert sum(read) <= 1.25 * data, (read, data)  # once in all, not once per rank
    assert max(read) <= 0.7 * data, (read, data)


def test_a_dcp_item_damaged_between_ranks_is_caught_by_its_receiver(tmp_path):
    path = str(tmp_path / "dcp")
    run_ranks(cases.WORLD, cases.save_dcp, path)
    got = run_ranks(cases.WORLD, cases.load, path, "flip", 1, "", True, True)
    damaged = [g["error"][1] for r, g in enumerate(got) if r != 1 and g["error"] is not None
               and g["error"][0] == "CorruptCheckpointError"]
    assert damaged, got
    assert all("received from rank 1" in m and str(Path(path)) in m for m in damaged), damaged


def test_the_option_off_reads_everything_on_every_rank(tmp_path):
    path = _saved(tmp_path)
    data = _data_nbytes(path)
    got = run_ranks(cases.WORLD, cases.load, path, "", 1, "", False)
    assert all(g["equal"] and g["error"] is None for g in got), got
    assert all(g["read"] >= 0.9 * data for g in got), ([g["read"] for g in got], data)


def test_a_byte_damaged_between_ranks_is_caught_by_its_receiver(tmp_path):
    path = _saved(tmp_path)
    got = run_ranks(cases.WORLD, cases.load, path, "flip", 1)
    caught = [g["error"] for r, g in enumerate(got) if r != 1]
    assert all(e is not None for e in caught), got
    damaged = [m for kind, m in caught if kind == "CorruptCheckpointError"]
    assert damaged, got
    for message in damaged:
        assert "checksum mismatch for key '" in message and "received from rank 1" in message
        assert str(Path(path)) in message
    assert got[1]["error"] is not None and got[1]["error"][0] == "RankFailedError", got[1]


def test_a_sender_killed_mid_load_is_read_around_and_named(tmp_path):
    path, mark = _saved(tmp_path), str(tmp_path / "died")
    got = run_ranks(cases.WORLD, cases.load, path, "die", 1, mark, may_die=(1,),
                    timeout_s=2 * NOT_HUNG_S)
    died_at = float(Path(mark).read_text())
    assert got[1] is None
    for rank in (0, 2):
        g = got[rank]
        assert g["equal"], (rank, g)  # what rank 1 was to send was read from storage
        # rank 1 named among the peers it could not exchange with (with the block exchange
        # beside the reads, a survivor's exchange with another survivor may break too)
        assert any(re.search(r"exchange .* with .*\brank 1 \(", w) and "from storage instead" in w
                   for w in g["warnings"]), (rank, g)
        kind, message = g["error"]  # the load's final agreement: a rank of the job is gone
        assert kind == "RankFailedError" and "rank 1" in message, (rank, g)
        assert g["ended"] - died_at < NOT_HUNG_S, (rank, g["ended"] - died_at)
    assert os.path.exists(mark)
