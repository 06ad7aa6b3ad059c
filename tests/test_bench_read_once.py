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


def test_the_hosts_benchmark_runs_and_reads_once_from_s3(tmp_path):
    """benchmarks/read_once_hosts.py at a tiny size: 4 namespace hosts and a SeaweedFS server
    on a fifth behind shaped links; with shared reads the ranks fetch the checkpoint once."""
    from benchmarks import read_once_hosts
    from ckptio.testing.multihost import netns_possible
    from ckptio.testing.s3server import ServerError, weed_binary

    if (why := netns_possible()) is not None:
        pytest.skip(f"namespace hosts: {why}")
    try:
        weed_binary()
    except ServerError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "r.json"
    assert read_once_hosts.main(["--gb", "0.01", "--tensors", "4", "--reps", "1",
                                 "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    rows = {(r["layout"], r["source"], r["engine"]): r
            for r in json.loads(out.read_text())["summary"]}
    assert all(r["bitwise_ok"] for r in rows.values())
    assert rows[("replicated", "s3", "ckptio")]["read_x"] <= 1.1
    assert rows[("replicated", "s3", "ckptio_each_reads")]["read_x"] >= 3.9
    assert rows[("hsdp", "s3", "ckptio")]["read_x"] <= 1.1
    assert rows[("hsdp", "s3", "ckptio_each_reads")]["read_x"] >= 1.9
