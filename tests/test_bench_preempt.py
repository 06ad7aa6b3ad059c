"""The preemption benchmark (benchmarks.preempt), tiny: one fresh training child per
configuration, SIGTERM in a step, and the report has every configuration's row, exit code 0,
and the step at the signal durable on disk (and in memory for the tiered ones). No timing is
asserted: only that every clock is there and not negative."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import preempt

CLOCKS = ("to_durable_s", "to_close_s", "to_exit_s")  # to_save_call_s: < 0 in a save


def test_tiny_run_reports_each_configuration_durable(tmp_path: Path) -> None:
    scratch, out, md = tmp_path / "scratch", tmp_path / "preempt.json", tmp_path / "preempt.md"
    argv = ["--gb", "0.01", "--reps", "1", "--every", "3", "--dir", str(scratch),
            "--json", str(out), "--markdown", str(md)]
    assert preempt.main(argv) == 0
    assert not scratch.exists(), "the scratch directory must be removed"
    report = json.loads(out.read_text())
    runs = {r["config"]: r for r in report["runs"]}
    assert sorted(runs) == sorted(preempt.CONFIGS)
    for config, run in runs.items():
        assert "error" not in run, run
        assert run["exit_code"] == 0, run
        assert run["final_step"] in (run["signal_in_step"], run["signal_in_step"] + 1), run
        assert run["on_disk"] and run["verified_bytes"] > 0, run
        assert config == "disk" or run["in_memory"], run
        assert all(run[k] >= 0 for k in CLOCKS), run
        assert config == "disk" or 0 <= run["to_memory_s"] <= run["to_durable_s"], run
        assert report["summary"][config]["durable"] == "1/1"
    text = md.read_text()
    assert text.startswith("`python -m benchmarks.preempt ")
    for config in preempt.CONFIGS:
        assert f"| {config} | 1 |" in text and f"| {config} | 0 |" in text
