"""The redundancy benchmark's report (benchmarks/redundancy_report.py) over the run committed in
docs/results/redundancy/redundancy.json: the per-engine medians, the sources of each restore,
NVRx's failing restore named with its file and line, and issue 27's targets each marked met or
missed from the numbers. No benchmark is run here (tests/test_hosts.py runs the same jobs)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.redundancy import parse_args
from benchmarks.redundancy_report import markdown, summarize

RESULT = Path(__file__).resolve().parents[1] / "docs" / "results" / "redundancy" / \
    "redundancy.json"


def _result() -> dict:
    result = json.loads(RESULT.read_text())
    result["summary"] = summarize(result)
    return result


def test_summary_of_the_committed_run() -> None:
    s = _result()["summary"]
    assert [k for k in s if not k.startswith("_")] == ["none", "off", "partners", "parity",
                                                       "nvrx_clique"]
    assert s["parity"]["host_lost"]["lost"] == 0 and s["partners"]["host_lost"]["lost"] == 0
    assert s["off"]["host_lost"]["lost"] == 3  # 8 saved, the disk's copy at 5
    assert s["parity"]["host_lost"]["sources"] == ["lost host: parity, others: own"]
    assert s["partners"]["host_lost"]["sources"] == ["lost host: partner, others: own"]
    # rotating parity: each of the 4 hosts holds a third of a shard of parity (1 + 1/3)
    assert abs(s["partners"]["x_state"] - 2.0) < 0.02 and abs(s["parity"]["x_state"] - 4 / 3) < 0.02
    assert s["parity"]["superseded"] == 0  # the protection kept pace: no step passed over
    errors = s["nvrx_clique"]["host_lost"]["errors"]
    assert errors and "group_utils.py:394" in errors[0] and "ten.cuda()" in errors[0]
    assert s["_disk_restore_s"] > 0


def test_markdown_marks_each_target() -> None:
    text = markdown(_result(), "python -m benchmarks.redundancy ...")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ") and "|" in line[2:]}
    assert "| met |" in rows["a lost host costs 0 steps (parity)"]
    assert "**missed**" in rows["parity memory <= 1.34x the state (k = 3)"]
    assert "**missed**" in rows["overhead with parity <= 3 % (every step)"]
    assert "Torch not compiled with CUDA enabled" in rows["nvrx_clique"]


def test_defaults_parse() -> None:
    args = parse_args([])
    assert args.hosts == 4 and args.k == 3 and args.disk_restores == "off,parity"
