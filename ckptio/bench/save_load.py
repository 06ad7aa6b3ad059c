"""Save/load benchmark driver: every engine and the raw disk ceiling, one fresh process per run.

Owns: the protocol of docs/BENCHMARKING.md for durable saves and cold loads (fresh process per
(engine, state, repetition), alternating order, idle before each timed phase, peak extra RSS from
VmHWM, bitwise check), the summary (first save apart, median of the rest) and its markdown and
JSON reports. Does not own: the state (state.py), the engines (engines.py), the ceiling
(ceiling.py).

    python -m ckptio.bench.save_load --gb 0.2 --reps 2 --engines torch_save,dcp_t1,dcp_t2
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Run = dict[str, Any]
CEILING = "ceiling"
KINDS = ("gpt", "large")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
SCRATCH = re.compile(r"^(\w+-(gpt|large)-r\d+|ceiling-r\d+\.bin)$")  # what workers create


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptio.bench.save_load",
        description="Durable save and cold load of a GPT+AdamW state: ckptio vs its peers vs the "
        "raw O_DIRECT ceiling, one fresh process per (engine, repetition).",
    )
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB (1e9 bytes); default 2")
    p.add_argument("--dir", type=Path, default=Path("bench-data"), help="scratch directory on the "
                   "disk under test (default ./bench-data); everything written there is deleted")
    p.add_argument("--reps", type=int, default=3, help="repetitions per engine (default 3)")
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
    return args


# ---------------------------------------------------------------- memory accounting (worker side)


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return status_kib("VmHWM") <= status_kib("VmRSS") + 64


def release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc malloc_trim), so a phase's extra RSS is
    memory it really needed, not reuse of what the previous phase freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: RSS+ may then be understated by reused free heap


def timed_phase(fn: Callable[[], object], idle: float) -> tuple[float, float, object, bool]:
    """Idle, then time ``fn``: (seconds, peak extra RSS MiB, fn's result, peak was reset)."""
    gc.collect()
    release_free_heap()
    time.sleep(idle)
    before = status_kib("VmRSS")
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return seconds, (status_kib("VmHWM") - before) / 1024, out, reset


def disk_usage(root: Path) -> tuple[int, int, int]:
    """(files, bytes allocated on disk, apparent bytes) under ``root``."""
    files = [p for p in root.rglob("*") if p.is_file()]
    stats = [p.stat() for p in files]
    return len(files), sum(s.st_blocks * 512 for s in stats), sum(s.st_size for s in stats)


# ---------------------------------------------------------------- workers


def build(kind: str, gb: float, seed: int) -> Any:
    from . import state

    if kind == "large":
        return state.build_large_state(state.state_nbytes(state.gpt_config(gb)), seed)
    return state.build_state(gb, seed)


def engine_worker(args: argparse.Namespace) -> Run:
    from . import ceiling, engines, state

    engine = engines.ENGINES[args.worker]
    t0 = time.perf_counter()
    src = build(args.kind, args.gb, args.seed)
    build_s = time.perf_counter() - t0
    nbytes, n_tensors, want = state.tensor_nbytes(src), len(state.tensor_leaves(src)), state.digest(src)
    work = args.dir / f"{args.worker}-{args.kind}-r{args.rep}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ckpt = work / "ckpt"
    save_s, save_rss, _, reset = timed_phase(lambda: engine.save(src, ckpt), args.idle)
    dest = state.empty_destination(src)  # torch.empty: no pages touched while src is alive
    del src
    gc.collect()
    state.prefault(dest)  # a freshly built model is initialised: its pages exist before load
    cache_drop = ceiling.drop_page_cache([work])
    load_s, load_rss, report, reset2 = timed_phase(lambda: engine.load(ckpt, dest), args.idle)
    ok = state.digest(dest) == want
    files, on_disk, apparent = disk_usage(work)
    shutil.rmtree(work)
    return {
        "engine": args.worker, "kind": args.kind, "rep": args.rep, "bytes": nbytes,
        "tensors": n_tensors, "build_s": build_s, "save_s": save_s, "load_s": load_s,
        "save_rss_mib": save_rss, "load_rss_mib": load_rss, "peak_reset": reset and reset2,
        "cache_drop": cache_drop, "bitwise_ok": ok, "files": files, "disk_bytes": on_disk,
        "apparent_bytes": apparent, "report": None if report is None else repr(report)[:300],
    }


def ceiling_worker(args: argparse.Namespace) -> Run:
    from . import ceiling, state

    nbytes = state.state_nbytes(state.gpt_config(args.gb))
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"ceiling-r{args.rep}.bin"
    try:
        time.sleep(args.idle)
        w = ceiling.write_ceiling(path, nbytes)
        time.sleep(args.idle)
        r = ceiling.read_ceiling(path)
    finally:
        path.unlink(missing_ok=True)
    return {
        "engine": CEILING, "kind": "-", "rep": args.rep, "bytes": nbytes,
        "write_s": w["seconds"], "fallocate_s": w["fallocate_s"], "read_s": r["seconds"],
        "io_bytes": w["bytes"], "cache_drop": r["cache_drop"], "bitwise_ok": True,
    }


def worker_main(args: argparse.Namespace) -> int:
    run = ceiling_worker(args) if args.worker == CEILING else engine_worker(args)
    print(json.dumps(run), flush=True)
    return 0 if run["bitwise_ok"] else 3


# ---------------------------------------------------------------- driver


def spawn(args: argparse.Namespace, engine: str, kind: str, rep: int) -> Run:
    """Run one worker in a fresh interpreter; its last JSON line on stdout is the result."""
    cmd = [sys.executable, "-m", "ckptio.bench.save_load", "--worker", engine, "--kind", kind,
           "--gb", repr(args.gb), "--dir", str(args.dir), "--rep", str(rep),
           "--idle", repr(args.idle), "--seed", str(args.seed)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "kind": kind, "rep": rep, "error": f"timed out after {args.timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"engine": engine, "kind": kind, "rep": rep, "error": f"exit {proc.returncode}: {tail}"}
    run: Run = json.loads(lines[-1])
    run["wall_s"] = time.perf_counter() - t0
    return run


def schedule(engines: list[str], large: bool) -> list[tuple[str, str]]:
    items = [(e, "gpt") for e in engines]
    items += [(e, "large") for e in engines] if large else []
    return items + [(CEILING, "gpt")]  # the ceiling writes S bytes of the gpt state


def progress(run: Run, index: int, total: int) -> str:
    head = f"[{index}/{total} rep {run['rep'] + 1}] {run['engine']} {run['kind']}:"
    if "error" in run:
        return f"{head} FAILED {run['error']}"
    gb = run["bytes"] / 1e9
    if run["engine"] == CEILING:
        return f"{head} write {run['write_s']:.2f} s ({gb / run['write_s']:.2f} GB/s), read {run['read_s']:.2f} s ({gb / run['read_s']:.2f} GB/s)"
    return (f"{head} save {run['save_s']:.2f} s ({gb / run['save_s']:.2f} GB/s), load {run['load_s']:.2f} s "
            f"({gb / run['load_s']:.2f} GB/s), RSS+ {run['save_rss_mib']:.0f}/{run['load_rss_mib']:.0f} MiB, "
            f"bitwise {'ok' if run['bitwise_ok'] else 'MISMATCH'} (build {run['build_s']:.1f} s, wall {run['wall_s']:.1f} s)")


def run_all(args: argparse.Namespace, engines: list[str]) -> list[Run]:
    items = schedule(engines, args.large)
    total, runs = args.reps * len(items), []
    for rep in range(args.reps):
        for engine, kind in items if rep % 2 == 0 else items[::-1]:
            runs.append(spawn(args, engine, kind, rep))
            print(progress(runs[-1], len(runs), total), file=sys.stderr, flush=True)
    return runs


def choose_engines(spec: str) -> list[str]:
    from . import engines

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


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[Run], reps: int) -> dict[str, Any]:
    ceil = {r["rep"]: r for r in runs if r["engine"] == CEILING and "error" not in r}
    ceil_rest = [r for rep, r in ceil.items() if rep > 0 or reps < 2]
    out: dict[str, Any] = {
        "ceiling_write_gbps": median([r["bytes"] / 1e9 / r["write_s"] for r in ceil_rest]),
        "ceiling_read_gbps": median([r["bytes"] / 1e9 / r["read_s"] for r in ceil_rest]),
        "rows": [],
    }
    keys = sorted({(r["engine"], r["kind"]) for r in runs if r["engine"] != CEILING},
                  key=lambda k: (KINDS.index(k[1]), k[0]))
    for engine, kind in keys:
        mine = sorted((r for r in runs if (r["engine"], r["kind"]) == (engine, kind)), key=lambda r: r["rep"])
        out["rows"].append(summarize_engine(engine, kind, mine, ceil, reps))
    out["ratios"] = ratios(out["rows"])
    return out


def summarize_engine(engine: str, kind: str, runs: list[Run], ceil: dict[int, Run], reps: int) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    rest = [r for r in good if r["rep"] > 0 or reps < 2]
    first = next((r for r in good if r["rep"] == 0), None)

    def pct(r: Run, t: str, ct: str) -> float | None:
        c = ceil.get(r["rep"])
        return None if c is None else 100 * c[ct] / r[t] * r["bytes"] / c["bytes"]

    def med(fn: Callable[[Run], float | None]) -> float | None:
        return median([v for r in rest if (v := fn(r)) is not None])

    return {
        "engine": engine, "kind": kind, "runs": len(runs), "failed": len(runs) - len(good),
        "first_save_s": None if first is None else first["save_s"],
        "save_s": med(lambda r: r["save_s"]), "save_gbps": med(lambda r: r["bytes"] / 1e9 / r["save_s"]),
        "save_pct": med(lambda r: pct(r, "save_s", "write_s")),
        "load_s": med(lambda r: r["load_s"]), "load_gbps": med(lambda r: r["bytes"] / 1e9 / r["load_s"]),
        "load_pct": med(lambda r: pct(r, "load_s", "read_s")),
        "save_rss_mib": med(lambda r: r["save_rss_mib"]), "load_rss_mib": med(lambda r: r["load_rss_mib"]),
        "files": med(lambda r: r["files"]), "bitwise_ok": bool(good) and all(r["bitwise_ok"] for r in good),
        "bytes": good[0]["bytes"] if good else None, "tensors": good[0]["tensors"] if good else None,
    }


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ckptio GB/s over the best DCP variant's, per state kind, for save and for load."""
    out = []
    for kind in KINDS:
        mine = next((r for r in rows if r["engine"] == "ckptio" and r["kind"] == kind), None)
        dcp = [r for r in rows if r["engine"].startswith("dcp") and r["kind"] == kind]
        if mine is None or not dcp:
            continue
        for metric in ("save_gbps", "load_gbps"):
            best = max((r for r in dcp if r[metric]), key=lambda r: r[metric], default=None)
            if best is not None and mine[metric]:
                out.append({"kind": kind, "metric": metric, "vs": best["engine"], "ratio": mine[metric] / best[metric]})
    return out


# ---------------------------------------------------------------- markdown


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(summary: dict[str, Any], args: argparse.Namespace, argv: list[str], engines: list[str]) -> str:
    from . import ceiling, state
    from . import engines as eng

    cfg = state.gpt_config(args.gb)
    rest = "median of reps 2..N" if args.reps >= 2 else "median of all reps"
    lines = [
        "## Durable save and cold load", "",
        f"`{shlex.join([sys.executable.rsplit('/', 1)[-1], '-m', 'ckptio.bench.save_load', *argv])}`  ",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, dir `{args.dir.resolve()}`, reps {args.reps} ({rest}; first save apart)  ",
        f"gpt: S = {state.state_nbytes(cfg):,} bytes, d_model {cfg.d_model}, {cfg.n_layers} blocks, vocab {cfg.vocab}, "
        f"tied lm_head, fused AdamW after 1 step; large: {state.LARGE_TENSORS} fp32 tensors, same S  ",
        f"ceiling (O_DIRECT, 8 MiB x {ceiling.THREADS} threads, same S): write {fmt(summary['ceiling_write_gbps'])} GB/s, "
        f"read {fmt(summary['ceiling_read_gbps'])} GB/s", "",
        "| engine | state | 1st save s | save s | save GB/s | % write ceil | load s | load GB/s | % read ceil "
        "| RSS+ save MiB | RSS+ load MiB | files | bitwise |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in summary["rows"]:
        ok = ("ok" if r["bitwise_ok"] else "MISMATCH") + (f" ({r['failed']} failed)" if r["failed"] else "")
        lines.append(
            f"| {r['engine']} | {r['kind']} | {fmt(r['first_save_s'])} | {fmt(r['save_s'])} | {fmt(r['save_gbps'])} "
            f"| {fmt(r['save_pct'], '.0f')} | {fmt(r['load_s'])} | {fmt(r['load_gbps'])} | {fmt(r['load_pct'], '.0f')} "
            f"| {fmt(r['save_rss_mib'], '.0f')} | {fmt(r['load_rss_mib'], '.0f')} | {fmt(r['files'], '.0f')} | {ok} |")
    lines.append("")
    for q in summary["ratios"]:
        lines.append(f"- ckptio / best DCP ({q['kind']}, {q['metric'].split('_')[0]}): {q['ratio']:.2f}x vs {q['vs']}")
    lines += [f"- {e}: {eng.ENGINES[e].note}" for e in engines]
    lines += ["- load: page cache dropped first, destination allocated and touched before the clock; "
              "RSS+ = peak VmHWM (reset via clear_refs) minus VmRSS before the phase; bitwise = xxh3 digest "
              "of every tensor byte and non-tensor leaf, untimed", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
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
