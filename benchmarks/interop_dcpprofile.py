"""Where a cold ``ckptio.load`` (or ``dcp.load`` through ``ckptio.DcpReader``) of a DCP directory
spends its time, per rank: the open (its rounds of reads and the parsing between them), the
heads resolved, the data pass (reads waited on, CRC-32 checks, copies into the
destination) and, with ``--cprofile``, each rank's top functions.

    python -m benchmarks.interop_dcpprofile --dir bench-data/dcpprof --ranks 2 --reps 2

The directory is interop_dcpload.py's (``dcp-<ranks>`` and ``expect-<ranks>.pkl``, made by its
setup worker: ``--setup`` runs it first). Each rep is fresh ranks over tcp://127.0.0.1, the page
cache dropped before the load, a barrier before and after, every rank's destination checked
bitwise. The clocks are wrappers around module functions (a few microseconds each): the numbers
are wall time on the rank's loading thread, not CPU time, and the phases nest (open contains its
rounds; the data pass contains the CRC and copy time spent on the loading thread). Since
round five a CRC-32 by ISA-L is checked, and its entries copied, on the I/O threads: those
clocks then sum the I/O threads' wall time too, overlapping the loading thread's.

Owns: the timers and the report. Does not own: the inputs or the load (interop_dcpload.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pickle
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interop_dcpprofile")
    p.add_argument("--dir", type=Path, default=Path("bench-data/dcpprof"))
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--engine", default="ckptio_load", choices=("ckptio_load", "dcp_load_ckptio_reader"))
    p.add_argument("--cprofile", action="store_true", help="also a cProfile of each rank's load")
    p.add_argument("--setup", action="store_true", help="write the DCP directory first")
    p.add_argument("--idle", type=float, default=1.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


class Clocks:
    """Wall time and calls per named phase, from wrappers around module attributes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.marks: list[tuple[str, float]] = []

    def wrap(self, owner: Any, name: str, label: str, mark: bool = False) -> None:
        real = getattr(owner, name)
        clocks = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            if mark:
                clocks.marks.append((f"{label} start", t0))
            try:
                return real(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                clocks.seconds[label] += t1 - t0
                clocks.calls[label] += 1
                if mark:
                    clocks.marks.append((f"{label} end", t1))

        setattr(owner, name, timed)


def instrument(clocks: Clocks) -> None:
    """Clocks around the open, its rounds of reads, the head parsing, the data pass and the work
    the data pass does on the loading thread."""
    from ckptio.format import torchzip
    from ckptio.loading import checks, opening
    from ckptio.loading import read as reading

    try:  # round four: the DCP Manifest in dcpdir.py, items opened where a read needs them
        from ckptio.loading import dcpdir as home
    except ImportError:  # before: foreign.py opened every item
        from ckptio.loading import foreign_common as home

    clocks.wrap(opening, "open_manifest", "open (whole)", mark=True)
    clocks.wrap(torchzip, "parse_head", "heads parsed")

    def counted(label: str, read: Callable[[list[Any]], int]) -> Callable[[list[Any]], int]:
        def reads_of(reads: list[Any]) -> int:
            t0 = time.perf_counter()
            try:
                return read(reads)
            finally:
                clocks.seconds[f"{label}: reads"] += time.perf_counter() - t0
                clocks.calls[f"{label}: reads"] += 1
                clocks.calls[f"{label}: regions read"] += len(reads)
        return reads_of

    real_open = home.open_dcp
    home.open_dcp = lambda store, read, **kw: real_open(store, counted("open", read), **kw)
    if hasattr(home, "resolve_reads"):
        real_resolve = home.resolve_reads
        home.resolve_reads = lambda store, read, reads: real_resolve(
            store, counted("items opened", read), reads)
        clocks.wrap(home, "resolve_reads", "items opened (whole)", mark=True)
    clocks.wrap(reading, "read_regions", "data pass (read_regions)", mark=True)
    clocks.wrap(reading, "plan_spans", "data: plan_spans")
    clocks.wrap(reading, "coalesce_reads", "data: coalesce")
    clocks.wrap(checks.Checker, "whole", "data: CRC-32 checks (any thread)")
    clocks.wrap(checks.Checker, "blocks", "data: block checks (any thread)")
    clocks.wrap(reading, "_copy_whole", "data: copy (whole entries)")
    clocks.wrap(reading, "_copy_pieces", "data: copy (pieces)")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    warnings.simplefilter("ignore")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp  # noqa: F401  (imports before the clock)

    import ckptio
    import ckptio.dcp
    import ckptio.shared
    from benchmarks.interop_dcpload import barrier, init_group, load
    from benchmarks.ranks_state import destination, local_digest
    from ckptio.tuning import ceiling

    ns = argparse.Namespace(world=args.ranks, rank=args.rank, port=args.port)
    mesh = init_group(ns)
    with open(args.dir / f"expect-{args.ranks}.pkl", "rb") as f:
        expect = pickle.load(f)
    dest = destination(expect["skeleton"], args.rank, args.ranks, mesh)
    path = args.dir / f"dcp-{args.ranks}"
    clocks = Clocks()
    instrument(clocks)
    barrier()
    if args.rank == 0:
        ceiling.drop_page_cache([path])
    time.sleep(args.idle)
    barrier()
    profiler = cProfile.Profile() if args.cprofile else None
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    load(args.engine, path, dest, args.ranks)
    if profiler is not None:
        profiler.disable()
    t_mine = time.perf_counter() - t0
    barrier()
    seconds = time.perf_counter() - t0
    top = ""
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(22)
        top = out.getvalue()
    ok = local_digest(dest) == expect["digests"][args.rank]
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"rank": args.rank, "seconds": seconds, "own_seconds": t_mine, "bitwise_ok": ok,
            "phases": {k: [round(v, 4), clocks.calls[k]] for k, v in clocks.seconds.items()},
            "counts": {k: v for k, v in clocks.calls.items() if k not in clocks.seconds},
            "marks": [(label, round(t - t0, 4)) for label, t in clocks.marks],
            "cprofile": top, "ckptio": ckptio.__file__}


def launch(args: argparse.Namespace, extra: list[str]) -> list[dict[str, Any]]:
    from benchmarks.interop_dcpload import free_port
    from benchmarks import harness

    port = free_port() if args.ranks > 1 else 0
    env = {**os.environ, "PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}
    return harness.spawn_ranks(lambda r: [
        sys.executable, "-P", "-m", "benchmarks.interop_dcpprofile", "--worker", "--dir",
        str(args.dir.resolve()), "--ranks", str(args.ranks), "--rank", str(r), "--port",
        str(port), "--engine", args.engine, "--idle", repr(args.idle), *extra],
        args.ranks, env=env, cwd=HERE, strict=True, tail=30)


def report(rep: int, outs: list[dict[str, Any]]) -> str:
    lines = [f"## rep {rep}: load {outs[0]['seconds']:.3f} s (rank 0's clock, barrier to barrier)"]
    for o in outs:
        lines.append(f"\nrank {o['rank']}: own load {o['own_seconds']:.3f} s, bitwise "
                     f"{'ok' if o['bitwise_ok'] else 'MISMATCH'}")
        for label, (s, calls) in o["phases"].items():
            lines.append(f"  {label:<42} {s:8.4f} s  ({calls} calls)")
        for label, n in o["counts"].items():
            lines.append(f"  {label:<42} {n}")
        lines.append("  timeline: " + ", ".join(f"{label} {t:.3f}" for label, t in o["marks"]))
        if o["cprofile"]:
            lines.append("\n  cProfile (tottime):\n" + "\n".join(
                "    " + ln for ln in o["cprofile"].splitlines() if ln.strip()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    if args.setup:
        from benchmarks.interop_dcpload import launch as dcp_launch
        from benchmarks.interop_dcpload import parse_args as dcp_args

        setup = dcp_launch(dcp_args(["--gb", repr(args.gb), "--dir", str(args.dir)]), HERE,
                           "setup", args.ranks)
        if "error" in setup:
            raise SystemExit(f"setup failed: {setup['error']}")
    print(f"# {args.engine}, {args.ranks} rank(s), {args.dir}, {time.strftime('%Y-%m-%d %H:%M')}")
    for rep in range(args.reps):
        print(report(rep, launch(args, ["--cprofile"] if args.cprofile else [])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
