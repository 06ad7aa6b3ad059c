"""Save/load benchmark driver: every engine and the raw disk ceiling, one fresh process per run.

Owns: the protocol of docs/BENCHMARKING.md for durable saves and cold loads (fresh process per
(engine, state, repetition), alternating order, idle before each timed phase, peak extra RSS from
VmHWM, bitwise check), the summary (first save apart from the steady one, medians) and its markdown and
JSON reports. Does not own: the state (state.py), the engines (engines.py), the ceiling
(ceiling.py).

    python -m benchmarks.save_load --gb 0.2 --reps 2 --engines torch_save,dcp_t1,dcp_t2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import fmt, gbps, harness, median, shown_path

Run = dict[str, Any]
CEILING = "ceiling"
KINDS = ("gpt", "large")
SCRATCH = re.compile(r"^(\w+-(gpt|large)-r\d+|ceiling-r\d+\.bin)$")  # what workers create


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.save_load",
        description="Durable save and cold load of a GPT+AdamW state: ckptio vs its peers vs the "
        "raw O_DIRECT ceiling, one fresh process per (engine, repetition).",
    )
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB (1e9 bytes); default 2")
    p.add_argument("--dir", type=Path, default=Path("bench-data"), help="scratch directory on the "
                   "disk under test (default ./bench-data); everything written there is deleted")
    p.add_argument("--reps", type=int, default=3, help="repetitions per engine (default 3)")
    p.add_argument("--ranks", type=int, default=1, help="1 (many ranks: python -m "
                   "benchmarks.ranks, where `ckptio bench save-load --ranks N` goes)")
    p.add_argument("--engines", default="", help="comma list (default: all available): "
                   "torch_save,dcp_t1,dcp_t2,dcp_t4,torchsnapshot,ckptio")
    p.add_argument("--large", action="store_true", help="also run the all-large-tensor state")
    p.add_argument("--json", type=Path, help="write runs and summary as JSON here")
    p.add_argument("--markdown", type=Path, help="write the markdown report here")
    p.add_argument("--idle", type=float, default=2.0, help="idle seconds before each timed phase")
    p.add_argument("--seed", type=int, default=0, help="seed of the state (default 0)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per worker")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=KINDS, default="gpt", help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1 or args.gb <= 0:
        p.error("--reps must be >= 1 and --gb > 0")
    if args.ranks != 1:
        p.error(f"--ranks {args.ranks}: this is the one-rank benchmark; many ranks: python -m "
                "benchmarks.ranks with the same options")
    return args


# ---------------------------------------------------------------- workers


def disk_usage(root: Path) -> tuple[int, int, int]:
    """(files, bytes allocated on disk, apparent bytes) under ``root``."""
    files = [p for p in root.rglob("*") if p.is_file()]
    stats = [p.stat() for p in files]
    return len(files), sum(s.st_blocks * 512 for s in stats), sum(s.st_size for s in stats)


def build(kind: str, gb: float, seed: int) -> Any:
    from ckptio.tuning import state

    if kind == "large":
        return state.build_large_state(state.state_nbytes(state.gpt_config(gb)), seed)
    return state.build_state(gb, seed)


def report_fields(report: object) -> object:
    """A load report as JSON, compact: a dataclass's sequences become their lengths."""
    if report is None or not dataclasses.is_dataclass(report):
        return None if report is None else repr(report)[:300]
    out: dict[str, object] = {}
    for f in dataclasses.fields(report):
        value = getattr(report, f.name)
        if isinstance(value, (list, tuple, dict, set)):
            value = len(value)
        out[f.name] = value if isinstance(value, (int, float, str, bool, type(None))) else repr(value)
    return out


def engine_worker(args: argparse.Namespace) -> Run:
    from benchmarks import engines
    from ckptio.tuning import state

    engine = engines.ENGINES[args.worker]
    engine.prepare()
    t0 = time.perf_counter()
    src = build(args.kind, args.gb, args.seed)
    build_s = time.perf_counter() - t0
    nbytes, want = state.tensor_nbytes(src), state.digest(src)
    n_tensors = len(state.tensor_leaves(src))
    work = args.dir / f"{args.worker}-{args.kind}-r{args.rep}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt = work / "ckpt"
    # Two saves per process: the first pays one-time costs (imports warmed already, but
    # allocations, thread pools, planning); the second is what a training job sees every time.
    # Extra RSS spans both: a pool allocated by the first save is extra memory too.
    rss_before = engines.status_kib("VmRSS")
    first = engines.timed_save(engine, src, work / "first", args.idle)
    shutil.rmtree(work / "first")
    save = engines.timed_save(engine, src, ckpt, args.idle, reset_peak=False)
    save_rss_mib = (engines.status_kib("VmHWM") - rss_before) / 1024
    dest = state.empty_destination(src)  # torch.empty: no page is touched while src is alive
    del src
    gc.collect()
    state.prefault(dest)  # a freshly built model is initialised: its pages exist before load
    cache_drop = harness.cold([work])
    load = engines.timed_load(engine, ckpt, dest, args.idle)
    ok = state.digest(dest) == want
    files, on_disk, apparent = disk_usage(work)
    shutil.rmtree(work)
    return {
        "engine": args.worker, "kind": args.kind, "rep": args.rep, "bytes": nbytes,
        "tensors": n_tensors, "build_s": build_s, "first_save_s": first.seconds,
        "save_s": save.seconds, "load_s": load.seconds,
        "save_rss_mib": save_rss_mib, "load_rss_mib": load.extra_rss_mib,
        "peak_reset": first.peak_reset and load.peak_reset, "cache_drop": cache_drop,
        "bitwise_ok": ok, "files": files, "disk_bytes": on_disk, "apparent_bytes": apparent,
        "report": report_fields(load.result),
    }


def ceiling_worker(args: argparse.Namespace) -> Run:
    from ckptio.tuning import ceiling
    from benchmarks import engines
    from ckptio.tuning import state

    nbytes = state.state_nbytes(state.gpt_config(args.gb))
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"ceiling-r{args.rep}.bin"
    tries = []
    for chunk, threads in ceiling.GEOMETRIES:  # the best geometry of each direction counts
        try:
            engines.settle_disk()
            time.sleep(args.idle)
            w = ceiling.write_ceiling(path, nbytes, chunk, threads)
            r = ceiling.read_ceiling(path, args.idle, chunk, threads)
        finally:
            path.unlink(missing_ok=True)
        tries.append({"chunk": chunk, "threads": threads, "write_s": w["seconds"],
                      "read_s": r["seconds"], "fallocate_s": w["fallocate_s"],
                      "io_bytes": w["bytes"], "cache_drop": r["cache_drop"]})
    return {
        "engine": CEILING, "kind": "-", "rep": args.rep, "bytes": nbytes,
        "write_s": min(t["write_s"] for t in tries), "read_s": min(t["read_s"] for t in tries),
        "fallocate_s": tries[0]["fallocate_s"], "io_bytes": tries[0]["io_bytes"],
        "cache_drop": tries[0]["cache_drop"], "geometries": tries, "bitwise_ok": True,
    }


def worker_main(args: argparse.Namespace) -> int:
    run = ceiling_worker(args) if args.worker == CEILING else engine_worker(args)
    harness.emit(run)
    return 0 if run["bitwise_ok"] else 3


# ---------------------------------------------------------------- driver


def worker_command(args: argparse.Namespace, engine: str, kind: str, rep: int) -> list[str]:
    return harness.command("benchmarks.save_load", engine, "--kind", kind, "--gb", repr(args.gb),
                           "--dir", args.dir, "--rep", rep, "--idle", repr(args.idle),
                           "--seed", args.seed)


def spawn(args: argparse.Namespace, engine: str, kind: str, rep: int) -> Run:
    """Run one worker in a fresh interpreter; its last JSON line on stdout is the result.
    Its stderr (warnings, fallbacks an engine logs) is passed on, indented."""
    return harness.spawn(worker_command(args, engine, kind, rep), timeout=args.timeout, echo=20,
                         label={"engine": engine, "kind": kind, "rep": rep})


def schedule(engines: list[str], large: bool) -> list[tuple[str, str]]:
    items = [(e, "gpt") for e in engines]
    items += [(e, "large") for e in engines] if large else []
    return items + [(CEILING, "gpt")]  # the ceiling moves S bytes of the gpt state


def progress(run: Run, index: int, total: int) -> str:
    head = f"[{index}/{total} rep {run['rep'] + 1}] {run['engine']} {run['kind']}:"
    if "error" in run:
        return f"{head} FAILED: {run['error']}"
    gb = run["bytes"] / 1e9
    if run["engine"] == CEILING:
        return (f"{head} write {run['write_s']:.2f} s ({gb / run['write_s']:.2f} GB/s), "
                f"read {run['read_s']:.2f} s ({gb / run['read_s']:.2f} GB/s)")
    ok = "ok" if run["bitwise_ok"] else "MISMATCH"
    return (f"{head} save {run['save_s']:.2f} s ({gb / run['save_s']:.2f} GB/s), "
            f"load {run['load_s']:.2f} s ({gb / run['load_s']:.2f} GB/s), "
            f"RSS+ {run['save_rss_mib']:.0f}/{run['load_rss_mib']:.0f} MiB, bitwise {ok} "
            f"(build {run['build_s']:.1f} s, wall {run['wall_s']:.1f} s)")


def run_all(args: argparse.Namespace, engines: list[str]) -> list[Run]:
    """Every item once per repetition, the order reversed on odd repetitions."""
    return harness.repeat(schedule(engines, args.large), args.reps,
                          lambda item, rep: spawn(args, *item, rep), progress)


def choose_engines(spec: str) -> list[str]:
    from benchmarks import engines

    if not spec:
        for name in engines.ENGINES:
            if (why := engines.unavailable_reason(name)) is not None:
                print(f"skipping {name}: {why}", file=sys.stderr)
        return engines.available()
    names = [s.strip() for s in spec.split(",") if s.strip()]
    problems = [f"{n}: {why}" for n in names if (why := engines.unavailable_reason(n)) is not None]
    if problems:
        raise SystemExit("cannot run: " + "; ".join(problems))
    return names


# ---------------------------------------------------------------- summary


def summarize(runs: list[Run], reps: int) -> dict[str, Any]:
    """Per (engine, state): medians over all reps, of the first and of the second save in each
    fresh process, of the load, and of the ceiling measured in the same repetition."""
    ceil = {r["rep"]: r for r in runs if r["engine"] == CEILING and "error" not in r}
    rest = list(ceil.values())
    out: dict[str, Any] = {
        "ceiling_first_write_s": ceil[0]["write_s"] if 0 in ceil else None,
        "ceiling_write_s": median([r["write_s"] for r in rest]),
        "ceiling_read_s": median([r["read_s"] for r in rest]),
        "ceiling_write_gbps": median([gbps(r, "write_s") for r in rest]),
        "ceiling_read_gbps": median([gbps(r, "read_s") for r in rest]),
    }
    keys = sorted({(r["engine"], r["kind"]) for r in runs if r["engine"] != CEILING},
                  key=lambda k: (KINDS.index(k[1]), k[0]))
    out["rows"] = [summarize_engine([r for r in runs if (r["engine"], r["kind"]) == key], ceil, reps)
                   for key in keys]
    out["ratios"] = ratios(out["rows"])
    return out


def summarize_engine(runs: list[Run], ceil: dict[int, Run], reps: int) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    rest = good  # every process measures its first save apart (first_save_s) from a second one

    def pct(r: Run, seconds: str, ceil_seconds: str) -> float | None:
        """% of the ceiling measured in the same repetition."""
        c = ceil.get(r["rep"])
        return None if c is None else 100 * gbps(r, seconds) / gbps(c, ceil_seconds)

    def med(fn: Callable[[Run], float | None]) -> float | None:
        return median([v for r in rest if (v := fn(r)) is not None])

    return {
        "engine": runs[0]["engine"], "kind": runs[0]["kind"], "runs": len(runs),
        "failed": len(runs) - len(good), "first_save_s": med(lambda r: r["first_save_s"]),
        "save_s": med(lambda r: r["save_s"]), "save_gbps": med(lambda r: gbps(r, "save_s")),
        "save_pct": med(lambda r: pct(r, "save_s", "write_s")),
        "load_s": med(lambda r: r["load_s"]), "load_gbps": med(lambda r: gbps(r, "load_s")),
        "load_pct": med(lambda r: pct(r, "load_s", "read_s")),
        "save_rss_mib": med(lambda r: r["save_rss_mib"]),
        "load_rss_mib": med(lambda r: r["load_rss_mib"]),
        "files": med(lambda r: r["files"]), "disk_mb": med(lambda r: r["disk_bytes"] / 1e6),
        "bitwise_ok": bool(good) and all(r["bitwise_ok"] for r in good),
        "error": next((r["error"] for r in runs if "error" in r), None),
        "bytes": good[0]["bytes"] if good else None, "tensors": good[0]["tensors"] if good else None,
    }


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ckptio GB/s over the best DCP variant's, per state kind, for save and for load."""
    out = []
    for kind in KINDS:
        mine = next((r for r in rows if r["engine"] == "ckptio" and r["kind"] == kind), None)
        dcp = [r for r in rows if r["engine"].startswith("dcp") and r["kind"] == kind]
        for metric in ("save_gbps", "load_gbps"):
            best = max((r for r in dcp if r[metric]), key=lambda r: r[metric], default=None)
            if mine and mine[metric] and best:
                out.append({"kind": kind, "metric": metric, "vs": best["engine"],
                            "ratio": mine[metric] / best[metric]})
    return out


# ---------------------------------------------------------------- markdown

HEADER = ("| engine | state | 1st save s | save s | save GB/s | % write ceil | load s | load GB/s "
          "| % read ceil | RSS+ save MiB | RSS+ load MiB | files | disk MB | bitwise |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def outcome(r: dict[str, Any]) -> str:
    """The bitwise cell: ok, MISMATCH (loaded bytes differ), or FAILED: the first error (a
    worker that crashed compared nothing: it is not a mismatch)."""
    if r["failed"]:
        share = "" if r["failed"] == r["runs"] else f" ({r['failed']} of {r['runs']} runs)"
        error = str(r.get("error") or "no result").replace("|", "/").replace("\n", " ")
        return f"FAILED{share}: {error}"
    return "ok" if r["bitwise_ok"] else "MISMATCH"


def table_row(r: dict[str, Any]) -> str:
    ok = outcome(r)
    cells = [r["engine"], r["kind"], fmt(r["first_save_s"]), fmt(r["save_s"]), fmt(r["save_gbps"]),
             fmt(r["save_pct"], ".0f"), fmt(r["load_s"]), fmt(r["load_gbps"]), fmt(r["load_pct"], ".0f"),
             fmt(r["save_rss_mib"], ".0f"), fmt(r["load_rss_mib"], ".0f"), fmt(r["files"], ".0f"),
             fmt(r["disk_mb"], ".0f"), ok]
    return "| " + " | ".join(cells) + " |"


def ceiling_row(c: dict[str, Any], nbytes: int) -> str:
    cells = ["O_DIRECT ceiling", "-", fmt(c["ceiling_first_write_s"]), fmt(c["ceiling_write_s"]),
             fmt(c["ceiling_write_gbps"]), "100", fmt(c["ceiling_read_s"]), fmt(c["ceiling_read_gbps"]),
             "100", "-", "-", "1", f"{nbytes / 1e6:.0f}", "-"]
    return "| " + " | ".join(cells) + " |"


def markdown(summary: dict[str, Any], args: argparse.Namespace, argv: list[str], engines: list[str]) -> str:
    from ckptio.tuning import ceiling
    from ckptio.tuning import state
    from benchmarks import engines as eng

    cfg = state.gpt_config(args.gb)
    nbytes = state.state_nbytes(cfg)
    command = shlex.join(["python", "-m", "benchmarks.save_load", *argv])
    lines = [
        "## Durable save and cold load", "", f"`{command}`  ",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, dir `{shown_path(args.dir)}`, "
        f"{args.reps} reps, one fresh process each; medians. 1st save: the first save in the "
        "process (allocations, thread pools); save: a second save in the same process, what a "
        "training job pays every time; RSS+ save spans both  ",
        f"gpt: S = {nbytes:,} bytes (tied weights once), d_model {cfg.d_model}, {cfg.n_layers} blocks, "
        f"vocab {cfg.vocab}, fused AdamW after 1 step; large: {state.LARGE_TENSORS} fp32 tensors, same S  ",
        "ceiling: O_DIRECT, S bytes, every rep, best of "
        + ", ".join(f"{c >> 20} MiB x {t} threads" for c, t in ceiling.GEOMETRIES)
        + " (each written, fsynced, then read cold)", "",
        HEADER, *[table_row(r) for r in summary["rows"]], ceiling_row(summary, nbytes), "",
    ]
    for q in summary["ratios"]:
        what = q["metric"].split("_")[0]
        lines.append(f"- ckptio / best DCP, {q['kind']} {what}: {q['ratio']:.2f}x (vs {q['vs']})")
    lines += [f"- {e}: {eng.ENGINES[e].note}" for e in engines]
    lines += ["- load: page cache dropped, destination allocated and touched, then the clock; "
              "RSS+ = peak VmHWM (reset via clear_refs) minus VmRSS before the phase; "
              "bitwise = xxh3 of every tensor byte and non-tensor leaf (untimed)", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if (missing := missing_numpy()) is not None:
        print(missing, file=sys.stderr)
        return 2
    engines = choose_engines(args.engines)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        runs = run_all(args, engines)
    finally:
        cleanup(args.dir, created)
    print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    summary = summarize(runs, args.reps)
    text = markdown(summary, args, argv, engines)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "summary": summary}, indent=1))
    failed = any("error" in r or not r["bitwise_ok"] for r in runs)
    return 1 if failed else 0


def missing_numpy() -> str | None:
    """Why the benchmark cannot run without numpy, or None when numpy is there: its bitwise
    check hashes every tensor's bytes through Tensor.numpy() (bench/state.py)."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return ("ckptio bench save-load needs numpy, which is not installed (its bitwise check "
                "reads tensor bytes through it): pip install 'ckptio[bench]' (or pip install numpy)")
    return None


def cleanup(root: Path, created: bool) -> None:
    """Remove what the workers left (crashed runs) and the directory itself if we made it."""
    for p in root.glob("*"):
        if SCRATCH.match(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif SCRATCH.match(p.name):
            p.unlink(missing_ok=True)
    if created:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
