"""The issue-45 benchmark drivers (benchmarks/drain_copy.py, restore_memory.py,
call_overhead.py): a tiny run of each in a fresh process, checked for its report and for the
files it leaves (none). No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import REPO_ROOT, worker_env


def _run(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", *argv], cwd=REPO_ROOT, env=worker_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_drain_copy_smoke(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    _run("benchmarks.drain_copy", "--gb", "0.01", "--tensors", "20", "--reps", "2", "--dir",
         str(tmp_path / "scratch"), "--json", str(out))
    report = json.loads(out.read_text())
    assert len(report["reps"]) == 2 and report["median"]["s"] > 0 and report["median"]["gbps"] > 0
    assert not list((tmp_path / "scratch").iterdir())


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/dev/shm"),
                    reason="drops the page cache (root) and uses /dev/shm")
def test_restore_memory_smoke(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    _run("benchmarks.restore_memory", "--quick", "--dir", str(tmp_path / "scratch"), "--json",
         str(out))
    median = json.loads(out.read_text())["median"]
    assert {"memory_s", "cold_disk_s", "memcpy_s", "memory_vs_cold_disk", "rollback_s",
            "rollback_load_s", "rollback_vs_memcpy_bandwidth", "mlp_restore_s", "mlp_memcpy_s",
            "mlp_memcpys"} <= set(median)
    assert all(median[k] > 0 for k in ("rollback_load_s", "mlp_restore_s", "mlp_memcpys"))
    assert not list((tmp_path / "scratch").iterdir())


def test_call_overhead_smoke() -> None:
    text = _run("benchmarks.call_overhead", "--tensors", "40", "--saves", "4", "--freeze", "--gc")
    assert text.count("later calls' median") == 2 and "lazy: 40 tensors" in text
    assert "objects, 0 of ckptio's types" in text


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not os.path.isdir("/dev/shm"),
                    reason="--pin needs cores 0 and 1; the memory tier uses /dev/shm")
def test_tiers_pinned_smoke(tmp_path: Path) -> None:
    """The loop benchmark in the GPU-node model (--pin), the floor and a lazy memory tier (the
    peers need packages CI does not install: they are skipped by name, not failed)."""
    out = tmp_path / "t.json"
    _run("benchmarks.tiers", "--pin", "--gb", "0.01", "--steps", "3", "--every", "2", "--reps",
         "1", "--batch", "1", "--seq", "16", "--engines", "none,floor_step,tiers_lazy,tcp_step",
         "--kills", "0", "--restores", "0", "--flat-saves", "0", "--dir",
         str(tmp_path / "scratch"), "--json", str(out))
    runs = {r["engine"]: r for r in json.loads(out.read_text())["runs"]}
    assert {"none", "floor_step", "tiers_lazy"} <= set(runs)
    assert all("error" not in r for r in runs.values()), runs
    assert len(runs["floor_step"]["call_s"]) == 3 and len(runs["tiers_lazy"]["call_s"]) == 3
