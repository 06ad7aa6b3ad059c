"""The benchmarks' harness: fresh-process workers, repetitions, cold page cache, spreads, reports.

Owns: running one worker (``python -m benchmarks.X --worker ...``) in a fresh interpreter and
reading its result (its last JSON line on stdout, or an error record), the worker's side of that
(``emit``: the run and the process's peak RSS), the schedule (every item once per repetition, the
order reversed on odd repetitions so no engine always runs first), dropping the page cache
between phases (or a run's own files only), per-cell spreads (median, range, count) and the
markdown table. Does not own: timing a phase inside a worker (engines.timed_phase), the disk
ceiling (ckptio.tuning.ceiling), the JSON and markdown files (benchmarks.write_reports) or what a
script measures.

Why not pyperf: it fits a micro-benchmark (one function, calibrated loops, warmups, one value
per process) but not these runs. A worker here measures several phases in one process (save then
load, the RSS each needed) and pyperf keeps one value per benchmark per process; its memory
tracking replaces the timings rather than adding to them; it runs all processes of one benchmark
before the next, so engines cannot alternate within a repetition; and its Runner owns the
command line. Its statistics are the ones ``statistics`` gives. Measured: docs/BENCHMARKING.md.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import worker_env

__all__ = ["Run", "cold", "command", "emit", "markdown_table", "repeat", "schedule", "spawn",
           "spawn_ranks", "spread", "summarize", "worker_error"]

Run = dict[str, Any]
T = TypeVar("T")


# ---------------------------------------------------------------- the worker's side


def emit(run: Run) -> int:
    """Print ``run`` as the worker's result line, with the process's peak RSS (``peak_rss_mib``,
    kept if the run set it); returns 0, the worker's exit status."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"peak_rss_mib": round(peak, 1), **run}), flush=True)
    return 0


def cold(paths: Iterable[Path] = (), *, only: bool = False) -> str:
    """Drop the page cache (drop_caches as root, else POSIX_FADV_DONTNEED on the files under
    ``paths``); returns the method used, for the run's record. ``only``: those files alone,
    even as root, so the rest stays cached (a running job's code, its imports)."""
    if not only:
        from ckptio.tuning.ceiling import drop_page_cache

        return drop_page_cache(paths)
    for root in paths:
        for path in (p for p in Path(root).rglob("*") if p.is_file()):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


# ---------------------------------------------------------------- the driver's side


def command(module: str, *args: object) -> list[str]:
    """The command line of a fresh worker: ``python -m module --worker args...``."""
    return [sys.executable, "-m", module, "--worker", *(str(a) for a in args)]


def worker_error(returncode: int, stderr: str, lines: int = 1) -> str:
    """What went wrong in a worker that left no result: its exit and the last ``lines`` lines of
    its stderr (the last: the exception, for a Python error)."""
    last = "\n".join([ln.rstrip() for ln in stderr.splitlines() if ln.strip()][-lines:])
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exited {returncode}"
    return f"worker {how}: {last}" if last else f"worker {how} without a result or an error"


def spawn(cmd: Sequence[str], *, timeout: float = 600, label: Run | None = None,
          strict: bool = False, echo: int = 0, tail: int = 1, cwd: Path | None = None,
          env: dict[str, str] | None = None) -> Run:
    """Run ``cmd`` in a fresh process (``worker_env()``, this cwd) and return its last
    JSON line on stdout, with ``label`` and the wall time (``wall_s``) added. A worker that
    leaves no result (a non-zero exit, a time-out) gives ``{**label, "error": ...}``, or
    SystemExit with ``strict``, naming the last ``tail`` lines of its stderr. ``echo``: the
    last lines of its stderr passed on, indented, whatever the outcome."""
    label = dict(label or {})
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              env=env or worker_env(), cwd=cwd, check=False)
    except subprocess.TimeoutExpired:
        return _failed(label, f"timed out after {timeout} s", strict)
    for line in proc.stderr.strip().splitlines()[-echo:] if echo else ():
        print(f"    | {line}", file=sys.stderr)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines or (strict and proc.returncode != 0):
        return _failed(label, worker_error(proc.returncode, proc.stderr, tail), strict)
    return {**label, **json.loads(lines[-1]), "wall_s": time.perf_counter() - t0}


def spawn_ranks(cmd: Sequence[str] | Callable[[int], Sequence[str]], world: int, *,
                env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
                timeout: float = 600, strict: bool = False, tail: int = 1,
                cwd: Path | None = None, sample: Callable[[list[int]], None] | None = None,
                every_s: float = 0.02, ok: Collection[int] = (0,), echo: int = 0) -> list[Run]:
    """``world`` fresh processes of ``cmd`` (or of ``cmd(rank)``), started together (a job's
    ranks: RANK and LOCAL_RANK set in each one's ``env`` or ``env(rank)``, default
    ``worker_env()``), and each one's result as ``spawn`` reads it, in rank order. A time-out
    kills them all; a rank without a result, or exiting with a status not in ``ok``, is
    ``{"rank": r, "error": ...}``, or SystemExit with ``strict``. ``sample``: called with the
    ranks' pids every ``every_s`` seconds while any runs (e.g. to read their /proc status).
    ``echo``: the last lines of each rank's stderr passed on, indented and marked ``r<rank>``."""
    procs = [subprocess.Popen(list(cmd(r) if callable(cmd) else cmd), cwd=cwd, text=True,
                              env={**(env(r) if callable(env) else env or worker_env()),
                                   "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(world)]
    deadline = time.monotonic() + timeout
    while sample is not None and time.monotonic() < deadline and any(
            p.poll() is None for p in procs):
        sample([p.pid for p in procs])
        time.sleep(every_s)
    runs: list[Run] = []
    for r, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            runs += [{"rank": q, "error": f"timed out after {timeout} s"} for q in range(r, world)]
            break
        for line in err.strip().splitlines()[-echo:] if echo else ():
            print(f"    | r{r} {line}", file=sys.stderr)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if not lines or proc.returncode not in ok:
            runs.append({"rank": r, "error": worker_error(proc.returncode, err, tail)})
        else:
            runs.append(json.loads(lines[-1]))
    failed = [run for run in runs if "error" in run]
    if strict and failed:
        raise SystemExit("\n".join(f"rank {run['rank']} failed: {run['error']}" for run in failed))
    return runs


def _failed(label: Run, error: str, strict: bool) -> Run:
    if strict:
        raise SystemExit(f"worker {label or ''} failed: {error}")
    return {**label, "error": error}


def schedule(items: Sequence[T], reps: int) -> Iterator[tuple[int, T]]:
    """(rep, item) for every item once per repetition, in order on even repetitions and
    reversed on odd ones (engines alternate, so none always runs first or last)."""
    for rep in range(reps):
        for item in items if rep % 2 == 0 else items[::-1]:
            yield rep, item


def repeat(items: Sequence[T], reps: int, run_one: Callable[[T, int], Run],
           progress: Callable[[Run, int, int], str] | None = None) -> list[Run]:
    """Every item ``reps`` times on ``schedule``'s order, each through ``run_one(item, rep)``
    (a spawn); after each run a progress line on stderr (``progress(run, index, total)``, by
    default the run's JSON)."""
    total, runs = reps * len(items), []
    for rep, item in schedule(items, reps):
        runs.append(run_one(item, rep))
        line = progress(runs[-1], len(runs), total) if progress else json.dumps(runs[-1])
        print(line, file=sys.stderr, flush=True)
    return runs


# ---------------------------------------------------------------- summaries and tables


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """The median, the range and the count of ``values`` (None left out); None for none."""
    got = [float(v) for v in values if v is not None]
    if not got:
        return None
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def summarize(runs: Iterable[Run], by: Sequence[str], fields: Sequence[str]) -> list[Run]:
    """One row per distinct ``by`` key (in first-seen order) of the runs without an error:
    the key's fields, then each of ``fields``' spread over the runs."""
    cells: dict[tuple[Any, ...], list[Run]] = {}
    for run in runs:
        if "error" not in run:
            cells.setdefault(tuple(run.get(k) for k in by), []).append(run)
    return [{**dict(zip(by, key)), **{f: spread(r.get(f) for r in got) for f in fields}}
            for key, got in cells.items()]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]],
                   align: str = "") -> str:
    """A markdown table; ``align`` one letter per column (l or r, default l for the first
    column and r for the rest)."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *([str(c) for c in row] for row in rows)]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
