"""Does pyperf fit the benchmarks' runs? One cold-read phase (a file written, fsynced and evicted,
then read and timed) in fresh processes, driven by pyperf and by benchmarks.harness.

Owns: the probe behind the harness's choice (docs/BENCHMARKING.md, "Why not pyperf"). It prints
the wall time of N fresh processes each way and what pyperf recorded (processes, values,
warmups, loops, unit) with one value per process, with its own calibration (--fast) and with
its memory tracking. Needs ``pip install pyperf`` (not a dependency of ckptio).

    python -m benchmarks.pyperf_probe --processes 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness, worker_env

__all__ = ["main"]

SIZE = 64 << 20
FILE = Path(tempfile.gettempdir()) / "ckptio-pyperf-probe.bin"


def cold_read(loops: int) -> float:
    """``loops`` times: write ``SIZE`` bytes, fsync, evict; the reads' total seconds."""
    total = 0.0
    for _ in range(loops):
        with open(FILE, "wb") as f:
            f.write(os.urandom(SIZE))
            f.flush()
            os.fsync(f.fileno())
        harness.cold([FILE])
        t0 = time.perf_counter()
        with open(FILE, "rb") as f:
            while f.read(8 << 20):
                pass
        total += time.perf_counter() - t0
    return total


def under_pyperf(flags: list[str], out: Path) -> dict[str, object]:
    """This module under pyperf's Runner with ``flags``: what pyperf recorded, the wall time."""
    import pyperf

    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "benchmarks.pyperf_probe", "--runner", *flags, "-o",
                    str(out), "--quiet"], check=True, env=worker_env(), timeout=900)
    wall = time.perf_counter() - t0
    bench = pyperf.Benchmark.load(str(out))
    return {"how": "pyperf " + " ".join(flags), "wall_s": round(wall, 2),
            "processes": bench.get_nrun(), "values": bench.get_nvalue(),
            "loops": bench.get_loops(), "unit": bench.get_unit(),
            "warmups": [len(r.warmups or ()) for r in bench.get_runs()]}


def by_harness(processes: int) -> dict[str, object]:
    t0 = time.perf_counter()
    runs = harness.repeat(["cold_read"], processes, lambda _item, _rep: harness.spawn(
        harness.command("benchmarks.pyperf_probe", "cold_read"), strict=True), lambda *_: ".")
    return {"how": "benchmarks.harness", "wall_s": round(time.perf_counter() - t0, 2),
            "processes": len(runs), "values": len(runs),
            "median_s": harness.spread(r["seconds"] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--runner" in argv:  # pyperf's own command line, in its driver and its workers
        import pyperf

        runner = pyperf.Runner(program_args=("-m", "benchmarks.pyperf_probe", "--runner"))
        runner.argparser.add_argument("--runner", action="store_true")
        runner.bench_time_func("cold_read", cold_read)
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.pyperf_probe", description=__doc__)
    p.add_argument("--processes", type=int, default=5)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return harness.emit({"seconds": cold_read(1)})
    one = ["--processes", str(args.processes), "--values", "1", "--warmups", "0", "--loops", "1"]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [by_harness(args.processes), under_pyperf(one, Path(tmp) / "one.json"),
                under_pyperf([*one, "--track-memory"], Path(tmp) / "memory.json"),
                under_pyperf(["--fast"], Path(tmp) / "fast.json")]
    FILE.unlink(missing_ok=True)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
