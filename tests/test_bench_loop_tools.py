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


def test_call_overhead_smoke(tmp_path: Path) -> None:
    """Each repetition a fresh worker (benchmarks/harness.py): its lines, then the medians."""
    out = tmp_path / "c.json"
    text = _run("benchmarks.call_overhead", "--tensors", "40", "--saves", "4", "--freeze", "--gc",
                "--reps", "2", "--json", str(out))
    assert text.count("tensors, first call") == 4 and text.count("lazy: 40 tensors") == 2
    assert text.count("objects, 0 of ckptio's types") == 2
    assert "lazy: median over 2 runs of the later calls' median" in text
    runs = json.loads(out.read_text())["runs"]
    assert [r["rep"] for r in runs] == [0, 1] and all(r["peak_rss_mib"] > 0 for r in runs)
    assert all(len(r["eager"]["calls_ms"]) == 4 for r in runs)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="the memory tier uses /dev/shm")
def test_gc_pressure_smoke(tmp_path: Path) -> None:
    """Each mode in a fresh worker (benchmarks/harness.py), a JSON line per run, none left in
    /dev/shm."""
    out = tmp_path / "g.json"
    shm_before = set(os.listdir("/dev/shm"))
    text = _run("benchmarks.gc_pressure", "--tensors", "20", "--saves", "2", "--json", str(out))
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["none", "eager", "lazy"]
    assert [json.loads(line) for line in text.splitlines()] == rows
    assert all(r["peak_rss_mib"] > 0 and r["alive_tensors"] >= 0 for r in rows)
    assert not {n for n in set(os.listdir("/dev/shm")) - shm_before if "gc-pressure" in n}


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
