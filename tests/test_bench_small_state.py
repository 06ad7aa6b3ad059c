"""benchmarks/small_state.py's export phase in a tiny configuration, on real files: each exporter
(convert to torch.save, dcp_to_torch_save) in a fresh process writes a file that reads back bit
for bit, and the table sets each phase against its own peer. Warm only: a cold cell drops the
whole machine's page cache."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from benchmarks import REPO_ROOT, small_state, worker_env


def _worker(spec: str, directory) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.small_state", "--worker", spec, "--export-gb",
           "0.002", "--dir", str(directory), "--idle", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), cwd=REPO_ROOT,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])


@pytest.mark.parametrize("exporter", small_state.EXPORTERS)
def test_export_writes_a_torch_save_file_equal_to_the_model(tmp_path, exporter: str) -> None:
    setup = _worker("setup", tmp_path)
    assert setup["bytes"] > 1_000_000  # the model's weights, saved by ckptio and by DCP
    run = _worker(f"export:{exporter}:warm", tmp_path)
    assert run["bitwise_ok"] is True
    assert 0 < run["bare_s"] <= run["seconds"]
    assert (tmp_path / f"export-{exporter}.pt").stat().st_size > setup["bytes"]


def test_table_sets_each_phase_against_its_peer() -> None:
    runs = [{"what": "setup", "bytes": 91}]
    runs += [{"what": "export", "mode": "cold", "engine": e, "seconds": s}
             for e, s in (("dcp", 0.4), ("ckptio", 0.2), ("dcp", 0.6), ("ckptio", 0.3))]
    runs += [{"what": "save", "engine": e, "seconds": s} for e, s in (("torch_save", 0.1),
                                                                      ("ckptio", 0.2))]
    summary = small_state.summarize(runs)
    assert summary == {"export:cold": {"dcp": 0.5, "ckptio": 0.25},
                       "save": {"torch_save": 0.1, "ckptio": 0.2}}
    text = small_state.table(summary, argparse.Namespace(gb=0.1, reps=2), runs)
    assert "| export:cold | dcp_to_torch_save + fsync | 0.500 | 0.250 | 0.50x |" in text
    assert "| save | torch | 0.100 | 0.200 | 2.00x |" in text
