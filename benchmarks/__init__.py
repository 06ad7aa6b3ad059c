"""ckptio's peer benchmarks: ckptio against torch.save, DCP and the disk's ceiling.

They live in the repository, not in the installed package (ckptio never imports them; ``ckptio
bench save-load/train/plan`` runs them from a checkout). Run them from the repository root:

    python -m benchmarks.save_load --gb 2 --reps 3        # docs/BENCH_SAVE_LOAD.md
    python -m benchmarks.ranks --ranks 2 --gb 2 --reps 3  # docs/BENCH_RANKS.md
    python -m benchmarks.plan_scale --world 8,64,512      # docs/BENCH_RANKS.md
    python -m benchmarks.train --gb 1 --steps 50          # docs/BENCH_TRAIN.md
    python -m benchmarks.compress --reps 3                # docs/BENCH_COMPRESS.md
    python -m benchmarks.compress_study --reps 3          # docs/PROBES.md (codecs)
    python -m benchmarks.redundancy --hosts 4 --reps 3    # docs/BENCH_REDUNDANCY.md
    python -m benchmarks.recovery --hosts 4 --mb 256 --reps 3  # docs/BENCH_RECOVERY.md
    python -m benchmarks.node_budget --ranks 4 --gb 1 --budget-gb 2  # docs/BENCH_RANKS.md
    python -m benchmarks.read_once --ranks 4 --gb 0.4     # docs/BENCH_RANKS.md
    python -m benchmarks.read_once_hosts --gb 0.2         # docs/BENCH_RANKS.md
    python -m benchmarks.reshard_plan                     # docs/BENCH_RANKS.md

Each spawns fresh ``python -m benchmarks.X --worker ...`` processes with ``worker_env()``, which
puts this checkout first on PYTHONPATH, so they work from any working directory; the spawning,
repetitions, cold reads and spreads live in benchmarks/harness.py (docs/BENCHMARKING.md).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

__all__ = ["REPO_ROOT", "fmt", "gbps", "median", "shown_path", "worker_env", "write_reports"]

REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout holding benchmarks/ and ckptio/


def shown_path(path: Path) -> str:
    """``path`` as a report header names it: relative to the checkout when it lies inside it (a
    table's header then reads the same on every machine), else absolute."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(REPO_ROOT)) or "."
    except ValueError:
        return str(resolved)


def median(values: list[float]) -> float | None:
    """The median, None for no values."""
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".2f") -> str:
    """A table cell: ``value`` formatted, "-" for None."""
    return "-" if value is None else format(value, spec)


def gbps(run: dict[str, Any], seconds: str) -> float:
    """A run's GB/s: its ``bytes`` over its ``seconds`` field."""
    return run["bytes"] / 1e9 / run[seconds]


def worker_env() -> dict[str, str]:
    """os.environ with REPO_ROOT first on PYTHONPATH: a worker started as ``python -m
    benchmarks.X`` imports this checkout's benchmarks (and its ckptio) whatever its cwd."""
    path = [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def write_reports(doc: object, json_path: Path | None, markdown_path: Path | None,
                  text: str) -> None:
    """A driver's outputs: ``doc`` as JSON and ``text`` (its markdown) where asked (parent
    folders made), and ``text`` printed."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=1))
    if markdown_path:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(text)
    print(text)
