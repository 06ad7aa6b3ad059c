"""benchmarks/node_budget.py in a tiny configuration: 2 ranks of one host, each async-saving
its own state larger than its share of a given host budget; the job's JSON says every rank
loaded its state back bit for bit and the host's staging stayed within the budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import REPO_ROOT, worker_env


def test_two_ranks_stay_within_the_hosts_budget(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    env = {**worker_env(), "CKPTIO_POOL_BYTES": str(2 << 20), "CKPTIO_BUFFER_BYTES": str(1 << 20)}
    for name in ("LOCAL_WORLD_SIZE", "CKPTIO_HOST_BUDGET_BYTES"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "benchmarks.node_budget", "--ranks", "2", "--gb", "0.02",
           "--budget-gb", "0.016", "--saves", "1", "--dir", str(tmp_path / "d"),
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads(out.read_text())["run"]
    assert [r["exact"] for r in run["ranks"]] == [True, True]
    staging = [r["staging_bytes"] for r in run["ranks"]]
    assert all(r["bytes"] > run["budget_bytes"] // 2 for r in run["ranks"])  # over its share
    assert sum(staging) <= run["budget_bytes"] == 16_000_000, staging
    assert "staging held (sum of staging_nbytes)" in done.stdout
    assert not os.path.exists(tmp_path / "d")
