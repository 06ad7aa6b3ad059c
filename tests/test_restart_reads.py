"""A restarting job's load reads each rank's part in few large requests: a small replicated
tensor (a bias, a norm) that several ranks want is read by the rank whose reads of its data
file take it in (planning/shared_reads.assign), not by whichever rank had the fewest bytes,
which read it alone, one small request among another rank's large reads (docs/BENCH_RESTART.md,
round six). Real gloo ranks, fresh processes, the defaults; bodies in restart_reads_cases.py."""

from __future__ import annotations

from pathlib import Path

import restart_reads_cases as cases
from ckptio.testing.rank_processes import run_ranks


def test_each_rank_reads_its_part_in_few_requests(tmp_path: Path) -> None:
    path = str(tmp_path / "ck")
    run_ranks(2, cases.save, path)
    data = sum(f.stat().st_size for f in Path(path).glob("data-*"))
    got = run_ranks(2, cases.load, path)
    assert all(g["equal"] for g in got), got
    # before: each rank read about half the small tensors of the other rank's file, one
    # request each (11 per rank here)
    assert all(g["requests"] <= 4 for g in got), got
    assert sum(g["read"] for g in got) <= data + (64 << 10), ([g["read"] for g in got], data)
