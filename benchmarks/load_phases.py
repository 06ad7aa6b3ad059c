"""Per-phase timestamps of one ckptio load on each rank (benchmarks.ranks --trace): where a
many-rank load spends its time before, between and after its reads.

``install()`` wraps ckptio's load steps in this process (the manifest's open, the regular
chunks' resolution, the key step, the in-place plan, the read-plan step, the reads, the
read-done and final steps) to note when each was first entered and last left, in wall-clock
seconds (one clock for the ranks of one host); ``marks()`` returns them with the process's
start and the end of its imports. ``table()`` lays every rank's marks out, in seconds after
the earliest rank's load began; ``main`` prints them from a benchmarks.ranks JSON file.
With LOAD_PHASES_PROFILE=PREFIX set, each rank's first load also runs under cProfile, its
statistics written to PREFIX.<pid>.

Owns: the wrappers and the table. Does not own: the load (ckptio), the clock (ranks.py).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

__all__ = ["install", "main", "mark", "marks", "table"]

_marks: dict[str, float] = {}
_PHASES = (  # (label, module, attribute, "enter" | "exit" | "both")
    ("load", "ckptio.api", "Checkpointer.load", "both"),
    ("manifest", "ckptio.loading.opening", "open_manifest", "exit"),
    ("flatten", "ckptio.loading.load_session", "flatten", "exit"),
    ("wanted", "ckptio.loading.resolve_regular", "wanted_in_place", "exit"),
    ("resolve", "ckptio.loading.resolve_regular", "expand", "exit"),
    ("fill", "ckptio.loading.load_session", "fill_in_place", "both"),
    ("keys step", "ckptio.distributed.loadsteps", "UnexpectedKeys.__call__", "both"),
    ("match", "ckptio.loading.fill", "match", "exit"),
    ("plan", "ckptio.loading.fill", "plan", "exit"),
    ("read-plan step", "ckptio.distributed.readshare", "SharedReads._plan", "both"),
    ("reads", "ckptio.loading.read", "read_regions", "both"),
    ("read-done step", "ckptio.distributed.readshare", "SharedReads._read_done", "both"),
    ("exchange", "ckptio.distributed.readshare", "_Wire.exchange", "both"),
    ("final step", "ckptio.distributed.loadsteps", "agree_loaded", "both"),
)


def mark(label: str) -> None:
    """Note ``label`` now (the first time only)."""
    _marks.setdefault(label, time.time())


def _wrap(label: str, fn: Any, when: str) -> Any:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if when in ("enter", "both"):
            _marks.setdefault(f"{label} in", time.time())
        try:
            return fn(*args, **kwargs)
        finally:
            if when in ("exit", "both"):
                _marks[f"{label} out"] = time.time()
    return wrapped


def install() -> None:
    """Wrap the load's steps (module table above) in this process."""
    import importlib

    if os.environ.get("LOAD_PHASES_PROFILE"):
        _profile(os.environ["LOAD_PHASES_PROFILE"])

    mark("imports")
    for label, module, attribute, when in _PHASES:
        owner: Any = importlib.import_module(module)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        setattr(owner, name, _wrap(label, getattr(owner, name), when))


def _profile(where: str) -> None:
    import cProfile

    import ckptio.api

    fn = ckptio.api.Checkpointer.load

    def load(*args: Any, **kwargs: Any) -> Any:
        if _marks.get("load out"):  # the first load only
            return fn(*args, **kwargs)
        with cProfile.Profile() as prof:
            try:
                return fn(*args, **kwargs)
            finally:
                prof.dump_stats(f"{where}.{os.getpid()}")
    ckptio.api.Checkpointer.load = load  # type: ignore[method-assign]


def _process_start() -> float:
    """This process's start, wall clock (from /proc: to the kernel's clock tick)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def marks() -> dict[str, float]:
    return {"process start": _process_start(), **_marks}


def table(per_rank: list[dict[str, float]]) -> str:
    """Markdown: one row per phase, one column per rank, seconds after the earliest 'load in'."""
    zero = min(m.get("load in", float("inf")) for m in per_rank)
    labels = sorted({k for m in per_rank for k in m}, key=lambda k: min(
        m.get(k, float("inf")) for m in per_rank))
    rows = ["| phase | " + " | ".join(f"rank {r}" for r in range(len(per_rank))) + " |",
            "|---|" + "---:|" * len(per_rank)]
    for label in labels:
        cells = [f"{m[label] - zero:+.3f}" if label in m else "-" for m in per_rank]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.load_phases RUN.json``: the phase table of every traced ckptio
    first load in a benchmarks.ranks JSON file."""
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.load_phases RUN.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        runs = json.load(f)["runs"]
    for run in runs:
        if run.get("phases") and run.get("engine") == "ckptio":
            print(f"\n{run.get('layout')}, repetition {run.get('rep', 0) + 1}: load "
                  f"{run.get('load_s', 0):.2f} s\n\n{table(run['phases'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
