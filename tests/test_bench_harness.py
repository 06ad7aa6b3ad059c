"""benchmarks/harness.py, the harness every benchmark runs its workers through: each run is a
fresh process, every item runs once per repetition with the order reversed on odd repetitions,
a worker's result is its last JSON line with its peak RSS, a failed worker is an error record
(or SystemExit when strict), and the summary's medians, ranges and counts and the written JSON
and markdown have the shape the reports read."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import harness, worker_env, write_reports

# A toy worker: its result names its process and echoes its item and repetition.
TOY = ("import os, sys; from benchmarks import harness; "
       "harness.emit({'pid': os.getpid(), 'engine': sys.argv[1], 'rep': int(sys.argv[2]), "
       "'seconds': {'a': 1.0, 'b': 2.0}[sys.argv[1]] + int(sys.argv[2])})")


def _toy(engine: str, rep: int) -> harness.Run:
    return harness.spawn([sys.executable, "-c", TOY, engine, str(rep)], timeout=60)


def test_each_run_is_a_fresh_process_in_alternating_order(tmp_path, capsys) -> None:
    runs = harness.repeat(["a", "b"], 3, _toy)
    assert [(r["engine"], r["rep"]) for r in runs] == [
        ("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert len({r["pid"] for r in runs}) == 6  # a fresh interpreter each
    assert all(r["peak_rss_mib"] > 1 and r["wall_s"] > 0 for r in runs)
    assert len(capsys.readouterr().err.strip().splitlines()) == 6  # one progress line a run

    rows = harness.summarize(runs, by=("engine",), fields=("seconds", "missing"))
    assert rows == [
        {"engine": "a", "seconds": {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}, "missing": None},
        {"engine": "b", "seconds": {"median": 3.0, "min": 2.0, "max": 4.0, "n": 3}, "missing": None}]
    table = harness.markdown_table(["engine", "median s"],
                                   [(r["engine"], r["seconds"]["median"]) for r in rows])
    assert table.splitlines() == ["| engine | median s |", "| --- | ---: |",
                                  "| a | 2.0 |", "| b | 3.0 |"]
    write_reports({"runs": runs, "summary": rows}, tmp_path / "r.json", tmp_path / "r.md", table)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["runs"]) == 6 and doc["summary"][1]["seconds"]["n"] == 3
    assert (tmp_path / "r.md").read_text() == table


def test_a_failed_worker_is_an_error_record_naming_its_exit_or_a_system_exit() -> None:
    cmd = [sys.executable, "-c", "raise ValueError('no disk here')"]
    run = harness.spawn(cmd, timeout=60, label={"engine": "x", "rep": 1})
    assert run == {"engine": "x", "rep": 1,
                   "error": "worker exited 1: ValueError: no disk here"}
    with pytest.raises(SystemExit, match="no disk here"):
        harness.spawn(cmd, timeout=60, strict=True)
    slow = harness.spawn([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert slow == {"error": "timed out after 0.5 s"}
    # a worker that printed its result and then exited non-zero (a bitwise mismatch) keeps it
    mismatch = harness.spawn([sys.executable, "-c", "print('{\"ok\": false}'); raise SystemExit(3)"])
    assert mismatch["ok"] is False and "error" not in mismatch


def test_spread_leaves_out_missing_values() -> None:
    assert harness.spread([3, None, 1, 2]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert harness.spread([None]) is None


def test_ranks_start_together_each_with_its_rank(tmp_path) -> None:
    # each rank waits for the other's file: they only finish if both run at once
    code = ("import os, sys, time, json; d = sys.argv[1]; r = os.environ['RANK']; "
            "open(os.path.join(d, r), 'w').close(); "
            "[time.sleep(0.01) for _ in range(2000) if len(os.listdir(d)) < 2]; "
            "print(json.dumps({'rank': int(r), 'local': int(os.environ['LOCAL_RANK']), "
            "'saw': len(os.listdir(d))}))")
    runs = harness.spawn_ranks([sys.executable, "-c", code, str(tmp_path)], 2, timeout=60)
    assert runs == [{"rank": 0, "local": 0, "saw": 2}, {"rank": 1, "local": 1, "saw": 2}]
    fail = [sys.executable, "-c", "import os; raise SystemExit(int(os.environ['RANK']) + 4)"]
    assert harness.spawn_ranks(fail, 2) == [{"rank": 0, "error": "worker exited 4 without a "
                                             "result or an error"},
                                            {"rank": 1, "error": "worker exited 5 without a "
                                             "result or an error"}]
    with pytest.raises(SystemExit, match="rank 1 failed: worker exited 5"):
        harness.spawn_ranks(fail, 2, strict=True)


def test_ranks_are_sampled_while_they_run() -> None:
    """``sample`` sees every rank's pid while they run (benchmarks/node_budget.py reads their
    /proc status through it); the results come back as without it."""
    seen: list[list[int]] = []
    code = "import os, time, json; time.sleep(0.5); print(json.dumps({'rank': int(os.environ['RANK'])}))"
    runs = harness.spawn_ranks([sys.executable, "-c", code], 2, timeout=60,
                               sample=seen.append, every_s=0.05)
    assert runs == [{"rank": 0}, {"rank": 1}]
    assert len(seen) >= 2 and all(len(pids) == 2 for pids in seen)


def test_a_rank_has_its_own_environment_and_may_keep_a_result_with_a_listed_status(capsys) -> None:
    """benchmarks/ranks.py: a host id per rank (``env(rank)``), exit status 3 for a result that
    mismatched (kept through ``ok``), each rank's last stderr lines passed on (``echo``)."""
    code = ("import os, sys, json; print(json.dumps({'host': os.environ['BENCH_HOST']})); "
            "print('note', file=sys.stderr); raise SystemExit(3)")
    cmd = [sys.executable, "-c", code]
    runs = harness.spawn_ranks(cmd, 2, env=lambda r: {**worker_env(), "BENCH_HOST": f"h{r}"},
                               ok=(0, 3), echo=1, timeout=60)
    assert runs == [{"host": "h0"}, {"host": "h1"}]
    assert "    | r1 note" in capsys.readouterr().err
    (refused,) = harness.spawn_ranks(cmd, 1, env={**worker_env(), "BENCH_HOST": "h"}, timeout=60)
    assert refused == {"rank": 0, "error": "worker exited 3: note"}
