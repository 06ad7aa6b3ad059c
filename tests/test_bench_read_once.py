"""benchmarks/read_once.py at a tiny size: with shared reads the ranks read the replicated
checkpoint from storage once in all, without them once each; every load bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import read_once


def test_two_ranks_read_the_replicated_state_once_in_all(tmp_path: Path) -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w"):
            pass
    except OSError:
        pytest.skip("dropping the page cache needs root")
    out = tmp_path / "r.json"
    assert read_once.main(["--ranks", "2", "--gb", "0.01", "--tensors", "6", "--reps", "1",
                           "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    rows = {r["engine"]: r for r in json.loads(out.read_text())["summary"]}
    assert all(r["bitwise_ok"] for r in rows.values())
    assert 0.95 <= rows["ckptio"]["read_x"] <= 1.1, rows["ckptio"]
    assert 1.9 <= rows["ckptio_each_reads"]["read_x"] <= 2.2, rows["ckptio_each_reads"]
    assert rows["ckptio_dcp_dir"]["read_x"] <= 1.2, rows["ckptio_dcp_dir"]  # DCP's files, once
