"""Small-state benchmark: the first durable save and the first load of a ~100 MB state, each in a
fresh process, ckptio against torch.save + fsync and torch.load; and the export of a ~91 MB model
to one torch.save file, ``ckptio.convert.convert(to="torch.save")`` from a ckptio checkpoint
against DCP's ``dcp_to_torch_save`` from a DCP checkpoint of the same weights
(docs/BENCH_LIMIT.md, issue 29).

Owns: the protocol for a small state's fixed costs: one fresh interpreter per measurement (the
engine's modules imported before the clock, as save_load.py does; the import time is reported
apart), the engines alternating rep by rep, a load or export either cold (page cache dropped) or
warm (the files read once just before), the bitwise check of every load and every exported file,
and the medians. An export is durable on both sides: convert fsyncs its file before it returns,
dcp_to_torch_save does not, so its file is fsynced inside the clock (its time before that fsync
is kept too, ``bare_s``). Does not own: the engines (engines.py), the state
(ckptio/tuning/state.py), the page-cache drop (ckptio/tuning/ceiling.py).

    python -m benchmarks.small_state --gb 0.1 --export-gb 0.091 --reps 5 --dir bench-data/small
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

ENGINES = ("torch_save", "ckptio")
EXPORTERS = ("dcp", "ckptio")  # dcp_to_torch_save from DCP; convert(to="torch.save") from ckptio
PHASES = ("save", "load", "export")
Run = dict[str, Any]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.small_state", description=__doc__)
    p.add_argument("--gb", type=float, default=0.1, help="state size in GB (default 0.1)")
    p.add_argument("--export-gb", type=float, default=0.091,
                   help="model weights exported, in GB (default 0.091)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated, of {', '.join(PHASES)} (default: all)")
    p.add_argument("--reps", type=int, default=5, help="fresh processes per cell (default 5)")
    p.add_argument("--dir", type=Path, default=Path("bench-data/small"),
                   help="scratch directory (deleted afterwards)")
    p.add_argument("--idle", type=float, default=1.0, help="idle seconds before each clock")
    p.add_argument("--json", type=Path, help="write every run and the medians here")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # save:E, load:E:MODE, export:E:MODE, setup
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- one fresh process


def worker(args: argparse.Namespace) -> Run:
    from benchmarks import engines
    from ckptio.tuning import state

    what, name, *rest = args.worker.split(":") + ["", ""]
    if what in ("export", "setup"):
        return export_worker(args, what, name, rest[0])
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
    run["cache_drop"] = page_cache(path, rest[0])
    run["seconds"] = engines.timed_load(engine, path, dest, args.idle).seconds
    run["bitwise_ok"] = state.digest(dest) == want
    return run


def page_cache(path: Path, mode: str) -> str:
    """cold: the page cache dropped (-> the method); warm: every file under ``path`` read once."""
    from ckptio.tuning import ceiling

    if mode == "cold":
        return ceiling.drop_page_cache([path])
    for f in path.rglob("*") if path.is_dir() else [path]:
        if f.is_file():
            f.read_bytes()
    return "warm"


def export_model(gb: float) -> dict[str, Any]:
    """The weights of ``build_state``'s GPT (a third of its state: weights and two moments),
    ``gb`` of them."""
    from ckptio.tuning import state

    return state.build_state(3 * gb, 0)["model"]


def export_worker(args: argparse.Namespace, what: str, name: str, mode: str) -> Run:
    """setup: the model saved by ckptio and by DCP (untimed); export: one timed export, durable
    (fsynced), and its file read back with torch.load and compared bit for bit."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import ckptio
    import ckptio.api  # imported before any clock, as engines.prepare does
    import ckptio.shared  # convert's load, imported before the clock
    from benchmarks import engines
    from ckptio.convert import convert
    from ckptio.tuning import state

    model = export_model(args.export_gb)
    src = {e: args.dir / f"export-{e}" for e in EXPORTERS}
    if what == "setup":
        ckptio.save(model, src["ckptio"])
        dcp.save(model, storage_writer=dcp.FileSystemWriter(str(src["dcp"])), no_dist=True)
        return {"what": what, "bytes": state.tensor_nbytes(model)}
    want, out = state.digest(model), args.dir / f"export-{name}.pt"
    del model
    out.unlink(missing_ok=True)
    run: Run = {"what": what, "engine": name, "rep": args.rep, "mode": mode,
                "cache_drop": page_cache(src[name], mode)}
    bare: list[float] = []

    def dcp_export() -> None:
        t0 = time.perf_counter()
        dcp_to_torch_save(src["dcp"], out)
        bare.append(time.perf_counter() - t0)
        fd = os.open(out, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def ckptio_export() -> None:
        convert(src["ckptio"], out, to="torch.save")

    run["seconds"] = engines.timed_phase(ckptio_export if name == "ckptio" else dcp_export,
                                         args.idle).seconds
    run["bare_s"] = bare[0] if bare else run["seconds"]
    run["bitwise_ok"] = state.digest(torch.load(out, weights_only=True)) == want
    return run


# ---------------------------------------------------------------- driver


def spawn(args: argparse.Namespace, spec: str, rep: int) -> Run:
    return harness.spawn(harness.command(
        "benchmarks.small_state", spec, "--gb", repr(args.gb), "--export-gb", repr(args.export_gb),
        "--dir", args.dir, "--idle", repr(args.idle), "--rep", rep), strict=True)


def specs(phases: list[str], rep: int) -> list[str]:
    """One rep's workers, the engines in alternating order rep by rep."""
    engines, exporters = (ENGINES, EXPORTERS) if rep % 2 == 0 else (ENGINES[::-1], EXPORTERS[::-1])
    out = [f"save:{e}" for e in engines] if "save" in phases else []
    if "load" in phases:
        out += [f"load:{e}:{m}" for m in ("cold", "warm") for e in engines]
    if "export" in phases:
        out += [f"export:{e}:{m}" for m in ("cold", "warm") for e in exporters]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return harness.emit(worker(args))
    phases = args.phases.split(",")
    if not set(phases) <= set(PHASES) or ("load" in phases and "save" not in phases):
        raise SystemExit(f"--phases {args.phases}: of {', '.join(PHASES)} (load reads what "
                         "save wrote)")
    args.dir.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    try:
        if "export" in phases:
            runs.append(spawn(args, "setup", 0))
        for rep in range(args.reps):
            for spec in specs(phases, rep):
                run = spawn(args, spec, rep)
                runs.append(run)
                print(json.dumps(run), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    summary = summarize(runs)
    print(table(summary, args, runs))
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "runs": runs, "summary": summary},
                                        indent=1))
    return 0 if all(r.get("bitwise_ok", True) for r in runs) else 3


def summarize(runs: list[Run]) -> dict[str, dict[str, float]]:
    """cell ("save", "load:cold", "export:warm", ...) -> engine -> median seconds."""
    got: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        if "seconds" in r:
            cell = ":".join(x for x in (r["what"], r.get("mode")) if x)
            got.setdefault(cell, {}).setdefault(r["engine"], []).append(r["seconds"])
    return {cell: {e: statistics.median(v) for e, v in by.items()} for cell, by in got.items()}


def table(summary: dict[str, dict[str, float]], args: argparse.Namespace, runs: list[Run]) -> str:
    model = next((r["bytes"] for r in runs if r["what"] == "setup"), None)
    head = (f"# {args.gb} GB state, {model or 0:,} bytes of exported weights, medians of "
            f"{args.reps} fresh processes")
    rows = [head, "",
            "| phase | peer | peer s | ckptio s | ckptio / peer |", "|---|---|---:|---:|---:|"]
    for cell, by in summary.items():
        peer = "dcp" if cell.startswith("export") else "torch_save"
        t, c = by.get(peer), by.get("ckptio")
        if t and c:
            name = "dcp_to_torch_save + fsync" if peer == "dcp" else "torch"
            rows.append(f"| {cell} | {name} | {t:.3f} | {c:.3f} | {c / t:.2f}x |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
