"""Per-phase timestamps of one ckptio load on each rank (benchmarks.ranks --trace): where a
many-rank load spends its time before, between and after its reads.

``install()`` wraps ckptio's load steps in this process (the manifest's open, the regular
chunks' resolution, the key step, the in-place plan, the read-plan step, the reads, the
read-done and final steps) to note when each was first entered and last left, in wall-clock
seconds (one clock for the ranks of one host), and the read loop's reads (``read_stats``: count,
sizes, how many in flight, seconds checking and copying, CPU seconds; LOAD_PHASES_READS=PREFIX
writes every read to PREFIX.<pid>); ``marks()`` returns them with the process's start and the
end of its imports (the read statistics under keys starting with '#'). ``table()`` lays every
rank's marks out, in seconds after the earliest rank's load began; ``main`` prints them from a
benchmarks.ranks JSON file.
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
_reads: list[tuple[float, float, int, int]] = []  # (submitted, done, bytes, in flight at submit)
_applies: list[tuple[float, float, int]] = []  # (start, end, thread id): check + copy of a read
_checks: list[float] = []  # seconds in the checksum comparisons (Checker.blocks / whole)
_cpu: dict[str, float] = {}
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
    ("exchange", "ckptio.distributed.wiregroup", "Wire.exchange", "both"),
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
    _install_reads()


def _install_reads() -> None:
    """Wrap the read loop's submit, apply and checks: each read's size, when it was submitted
    and done, how many were in flight then, and the seconds spent checking and copying."""
    import threading

    from ckptio.loading import checks, read

    submit, apply = read._submit, read._apply
    live: list[int] = [0]

    def traced_submit(rng: Any, *args: Any, **kwargs: Any) -> Any:
        if "reads cpu" not in _cpu:
            _cpu["reads cpu"], _cpu["reads sys"] = sum(os.times()[:2]), os.times()[1]
            _cpu["reads t0"] = time.time()
        flight = submit(rng, *args, **kwargs)
        if flight is not None:
            at, depth = time.time(), live[0]
            live[0] += 1

            def done(_f: Any) -> None:
                live[0] -= 1
                _reads.append((at, time.time(), rng.nbytes, depth))
            flight.future.add_done_callback(done)
        return flight

    def traced_apply(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return apply(*args, **kwargs)
        finally:
            _applies.append((t0, time.time(), threading.get_ident()))
            _cpu["reads cpu end"], _cpu["reads sys end"] = sum(os.times()[:2]), os.times()[1]
            _cpu["reads t1"] = time.time()

    read._submit, read._apply = traced_submit, traced_apply
    for name in ("blocks", "whole"):
        fn = getattr(checks.Checker, name)

        def timed(*args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _checks.append(time.perf_counter() - t0)
        setattr(checks.Checker, name, timed)


def read_stats() -> dict[str, float]:
    """This process's reads: count, MiB, sizes, in flight, seconds reading, checking, copying."""
    if not _reads:
        return {}
    if os.environ.get("LOAD_PHASES_READS"):  # every read, for a closer look
        import json
        with open(f"{os.environ['LOAD_PHASES_READS']}.{os.getpid()}", "w") as f:
            json.dump({"reads": _reads, "applies": _applies}, f)
    sizes = sorted(n for _a, _b, n, _d in _reads)
    span = max(b for _a, b, _n, _d in _reads) - min(a for a, _b, _n, _d in _reads)
    wall = _cpu.get("reads t1", 0.0) - _cpu.get("reads t0", 0.0)
    return {"reads": len(_reads), "MiB": sum(sizes) / 2**20,
            "median read MiB": sizes[len(sizes) // 2] / 2**20, "min read KiB": sizes[0] / 1024,
            "mean in flight": sum(d + 1 for *_x, d in _reads) / len(_reads),
            "max in flight": max(d + 1 for *_x, d in _reads),
            "mean read s": sum(b - a for a, b, _n, _d in _reads) / len(_reads),
            "reads span s": span, "check s": sum(_checks),
            "apply s (check+copy)": sum(b - a for a, b, _t in _applies),
            "apply threads": len({t for *_x, t in _applies}),
            "cpu s in reads": _cpu.get("reads cpu end", 0.0) - _cpu.get("reads cpu", 0.0),
            "of which sys s": _cpu.get("reads sys end", 0.0) - _cpu.get("reads sys", 0.0),
            "cpu/wall in reads": (_cpu.get("reads cpu end", 0.0) - _cpu.get("reads cpu", 0.0))
            / wall if wall > 0 else 0.0}


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
    """The phases' marks, with the read statistics under keys starting with '#'."""
    return {"process start": _process_start(), **_marks,
            **{f"#{k}": v for k, v in read_stats().items()}}


def table(per_rank: list[dict[str, float]]) -> str:
    """Markdown: one row per phase, one column per rank, seconds after the earliest 'load in'."""
    zero = min(m.get("load in", float("inf")) for m in per_rank)
    stats = sorted({k for m in per_rank for k in m if k.startswith("#")})
    labels = sorted({k for m in per_rank for k in m if not k.startswith("#")}, key=lambda k: min(
        m.get(k, float("inf")) for m in per_rank))
    rows = ["| phase | " + " | ".join(f"rank {r}" for r in range(len(per_rank))) + " |",
            "|---|" + "---:|" * len(per_rank)]
    for label in labels:
        cells = [f"{m[label] - zero:+.3f}" if label in m else "-" for m in per_rank]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    for label in stats:
        cells = [f"{m[label]:.3f}" if label in m else "-" for m in per_rank]
        rows.append(f"| {label[1:]} | " + " | ".join(cells) + " |")
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
