"""The many-rank save/load benchmark (ckptio bench save-load --ranks 2) at a tiny size, 1 rep.

Checks the report's fields and that every load was bitwise-correct; no timing assertions.
"""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks import load_phases, ranks
from benchmarks import ranks_state
from ckptio import cli

pytest.importorskip("torch.distributed.checkpoint")


def test_ranks_smoke(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    data = tmp_path / "data"
    argv = ["--ranks", "2", "--gb", "0.004", "--reps", "1", "--idle", "0", "--dcp-threads", "1",
            "--loads", "same,to2n", "--dir", str(data), "--timeout", "120",
            "--json", str(out / "r.json"), "--markdown", str(out / "r.md")]
    # DCP saves (the ratio's peer) but is not loaded, to keep the test short: the real run's
    # default --loads adds the DCP load and the N->1 load
    rc = cli.main(["bench", "save-load", *argv])  # the --ranks route of `ckptio bench save-load`
    report = json.loads((out / "r.json").read_text())
    errors = [r for r in report["runs"] if "error" in r]
    assert not errors, errors
    assert rc == 0
    summary = report["summary"]
    assert summary["bytes"] > 0 and summary["ranks"] == 2
    assert summary["ceiling_write_gbps"] > 0 and summary["ceiling_read_gbps"] > 0
    saves = {s["engine"]: s for s in summary["saves"]}
    assert set(saves) == {"ckptio", "dcp_t1"}
    for s in saves.values():
        assert s["failed"] == 0
        for field in ("first_save_s", "save_s", "save_gbps", "save_pct", "save_rss_mib"):
            assert s[field] is not None, (s["engine"], field)
    loads = {(ld["engine"], ld["layout"]): ld for ld in summary["loads"]}
    assert set(loads) == {("ckptio", "2->2"), ("ckptio", "2->4")}
    for ld in loads.values():
        assert ld["bitwise_ok"] and ld["failed"] == 0, ld
        assert ld["load_s"] > 0 and ld["load_gbps"] > 0 and ld["load_pct"] is not None
        assert ld["read_mb"] is not None  # ckptio's LoadReport.nbytes_read, all ranks
    load_runs = [r for r in report["runs"] if r["job"] == "load"]
    assert len(load_runs) == 2 and all(all(r["bitwise_by_rank"]) for r in load_runs)
    assert {len(r["bitwise_by_rank"]) for r in load_runs} == {2, 4}
    checks = {c["what"]: c for c in summary["checks"]}
    assert any(k.startswith("ckptio save / best DCP save") for k in checks)
    assert "ckptio load 2->4 / 2->2 (time)" in checks
    assert "ckptio save, % of write ceiling" in checks
    text = (out / "r.md").read_text()
    assert "2->4" in text and "dcp_t1" in text and "MISMATCH" not in text
    assert not data.exists() or not any(p.name.startswith(ranks.PREFIX) for p in data.iterdir())


def test_ranks_restart_smoke(tmp_path, capsys):
    """--restart: ckptio.load with the defaults, a later load in the same processes, each
    rank's read timeline, and fio's ceilings (its own file; ckptio's data files) beside the
    project's where fio is installed. --trace: each rank's load phases, printed from the JSON."""
    out = tmp_path / "r.json"
    argv = ["--ranks", "2", "--gb", "0.004", "--reps", "1", "--idle", "0", "--dcp-threads", "1",
            "--loads", "same", "--restart", "--trace", "--dir", str(tmp_path / "data"),
            "--timeout", "120", "--json", str(out)]
    assert ranks.main(argv) == 0
    report = json.loads(out.read_text())
    (load,) = [r for r in report["runs"] if r["job"] == "load"]
    assert len(load["phases"]) == 2 and all(
        {"load in", "read-plan step out", "reads in", "final step out"} <= set(p)
        for p in load["phases"]), load["phases"]
    assert load_phases.main([str(out)]) == 0 and "| read-plan step in |" in capsys.readouterr().out
    assert load["bitwise_ok"] and load["later_bitwise_ok"] and load["later_load_s"] > 0
    assert len(load["timelines"]) == 2 and len(load["later_timelines"]) == 2
    for timeline in load["timelines"]:
        assert {"first_read_s", "last_read_s", "read_bytes", "series"} <= set(timeline)
    (ceiling,) = [r for r in report["runs"] if r["job"] == "ceiling"]
    if shutil.which("fio"):
        assert ceiling["fio_read_s"] > 0 and report["summary"]["fio_read_s"] > 0
        (files,) = [r for r in report["runs"] if r["job"] == "fio_files"]
        assert files["read_bytes"] >= 0.004e9 and report["summary"]["fio_files_s"] > 0
        assert report["summary"]["loads"][0]["fio_files_pct"] > 0


def test_layout_helpers():
    """Shard(0) pieces cover the dim exactly, as torch.chunk cuts it (trailing pieces empty)."""
    import torch

    for size in (1, 5, 8, 13):
        for parts in (1, 2, 3, 4, 8):
            pieces = [ranks_state.split(size, parts, i) for i in range(parts)]
            assert sum(n for _, n in pieces) == size
            chunks = torch.arange(size).chunk(parts)
            for i, (start, n) in enumerate(pieces):
                want = chunks[i].tolist() if i < len(chunks) else []
                assert list(range(start, start + n)) == want
