"""Small-state benchmark: the first durable save and the first load of a ~100 MB state, each in a
fresh process, ckptio against torch.save + fsync and torch.load (docs/BENCH_LIMIT.md, issue 29).

Owns: the protocol for a small state's fixed costs: one fresh interpreter per measurement (the
engine's modules imported before the clock, as save_load.py does; the import time is reported
apart), the saves and the loads alternating between engines rep by rep, a load either cold (page
cache dropped) or warm (the files read once just before), the bitwise check of every load, and
the medians. Does not own: the engines (engines.py), the state (ckptio/tuning/state.py), the
page-cache drop (ckptio/tuning/ceiling.py).

    python -m benchmarks.small_state --gb 0.1 --reps 5 --dir bench-data/small
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import worker_env

ENGINES = ("torch_save", "ckptio")
Run = dict[str, Any]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.small_state", description=__doc__)
    p.add_argument("--gb", type=float, default=0.1, help="state size in GB (default 0.1)")
    p.add_argument("--reps", type=int, default=5, help="fresh processes per cell (default 5)")
    p.add_argument("--dir", type=Path, default=Path("bench-data/small"),
                   help="scratch directory (deleted afterwards)")
    p.add_argument("--idle", type=float, default=1.0, help="idle seconds before each clock")
    p.add_argument("--json", type=Path, help="write every run and the medians here")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # save:ENGINE or load:ENGINE:cold|warm
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- one fresh process


def worker(args: argparse.Namespace) -> Run:
    from benchmarks import engines
    from ckptio.tuning import ceiling, state

    what, name, *rest = args.worker.split(":")
    engine = engines.ENGINES[name]
    t0 = time.perf_counter()
    engine.prepare()
    import_s = time.perf_counter() - t0
    src = state.build_state(args.gb, 0)
    nbytes, want = state.tensor_nbytes(src), state.digest(src)
    path = args.dir / f"{name}-ckpt"
    run: Run = {"what": what, "engine": name, "rep": args.rep, "bytes": nbytes,
                "import_s": import_s}
    if what == "save":
        shutil.rmtree(path, ignore_errors=True)
        run["seconds"] = engines.timed_save(engine, src, path, args.idle).seconds
        return run
    dest = state.empty_destination(src)
    del src
    state.prefault(dest)  # a freshly built model is initialised: its pages exist before load
    run["mode"] = rest[0]
    if rest[0] == "cold":
        run["cache_drop"] = ceiling.drop_page_cache([path])
    else:  # warm: every file read once through the page cache
        for f in path.rglob("*"):
            if f.is_file():
                f.read_bytes()
    run["seconds"] = engines.timed_load(engine, path, dest, args.idle).seconds
    run["bitwise_ok"] = state.digest(dest) == want
    return run


# ---------------------------------------------------------------- driver


def spawn(args: argparse.Namespace, spec: str, rep: int) -> Run:
    cmd = [sys.executable, "-m", "benchmarks.small_state", "--worker", spec, "--gb",
           repr(args.gb), "--dir", str(args.dir), "--idle", repr(args.idle), "--rep", str(rep)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"worker {spec} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    try:
        for rep in range(args.reps):  # alternate the engines, rep by rep
            order = ENGINES if rep % 2 == 0 else ENGINES[::-1]
            for spec in [f"save:{e}" for e in order] + [f"load:{e}:{m}" for m in ("cold", "warm")
                                                        for e in order]:
                run = spawn(args, spec, rep)
                runs.append(run)
                print(json.dumps(run), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    summary = summarize(runs)
    print(table(summary, args))
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "runs": runs, "summary": summary},
                                        indent=1))
    return 0 if all(r.get("bitwise_ok", True) for r in runs) else 3


def summarize(runs: list[Run]) -> dict[str, dict[str, float]]:
    cells: dict[str, dict[str, float]] = {}
    for cell in ("save", "load:cold", "load:warm"):
        for engine in ENGINES:
            got = [r["seconds"] for r in runs if r["engine"] == engine and
                   ":".join(x for x in (r["what"], r.get("mode")) if x) == cell]
            if got:
                cells.setdefault(cell, {})[engine] = statistics.median(got)
    return cells


def table(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    rows = [f"# {args.gb} GB state, medians of {args.reps} fresh processes", "",
            "| phase | torch s | ckptio s | ckptio / torch |", "|---|---:|---:|---:|"]
    for cell, by in summary.items():
        t, c = by.get("torch_save"), by.get("ckptio")
        if t and c:
            rows.append(f"| {cell} | {t:.3f} | {c:.3f} | {c / t:.2f}x |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
