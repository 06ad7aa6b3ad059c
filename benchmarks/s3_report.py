"""Summary and markdown report of benchmarks/s3.py.

Owns: medians with min/max per engine and per raw-sweep cell, % of the ceiling measured in the
same repetition, CPU seconds per GB (client process and server), the targets (ckptio >= 85 % of
the client ceiling, >= 2x DCP over fsspec, extra RSS bounded by the staging pool), the machine
description and the markdown. Does not own: running anything (s3.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks import shown_path

Run = dict[str, Any]
CEILING = "ceiling"
TARGET_PCT = 85.0
TARGET_DCP = 2.0
POOL_MIB = 256  # Options.pool_bytes default
RSS_SLACK = 1.25  # extra RSS within this factor of the pool counts as bounded by it


# ---------------------------------------------------------------- ceiling helpers


def cells_of(run: Run, phase: str) -> list[Run]:
    part = run.get(phase) or {}
    return [] if "error" in part else list(part.get("cells", []))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / 1e9 / seconds


def best_cell(run: Run, phase: str) -> Run | None:
    cells = cells_of(run, phase)
    return min(cells, key=lambda c: c["seconds"]) if cells else None


def best_concurrency(run: Run) -> tuple[int, int] | None:
    """(write, read) concurrency of the best cells of one ceiling repetition."""
    w, r = best_cell(run, "write"), best_cell(run, "read")
    if w is None or r is None:
        return None
    return w["concurrency"], r["concurrency"]


def top_cells(runs: list[Run], n: int) -> list[str]:
    """The best ``n`` cells of each direction in the first ceiling repetition (union)."""
    first = next(r for r in runs if r["engine"] == CEILING)
    keep: list[str] = []
    for phase in (p for p in PHASES if p != "read_cold"):  # a context row never picks cells
        for cell in sorted(cells_of(first, phase), key=lambda c: c["seconds"])[:n]:
            if cell["cell"] not in keep:
                keep.append(cell["cell"])
    return keep


# read_direct: http.client readinto (as ckptio reads); read_cold: boto3's read in a process that
# makes its client inside the clock (context: the fixed cost of a fresh process, never a ceiling)
PHASES = ("write", "read", "read_direct", "read_cold")


def read_ok(run: Run) -> bool:
    want = (run.get("write") or {}).get("digest")
    return all(c.get("digest") == want for p in PHASES[1:] for c in cells_of(run, p))


# ---------------------------------------------------------------- progress and failure


def progress(run: Run) -> str:
    head = f"[rep {run['rep'] + 1}] {run['engine']}:"
    if run["engine"] == CEILING:
        out = []
        for phase in (p for p in PHASES if p in run):
            if "error" in (run.get(phase) or {}):
                out.append(f"{phase} FAILED: {run[phase]['error']}")
                continue
            nbytes = run[phase]["bytes"]
            cells = ", ".join(f"{c['cell']} {gbps(nbytes, c['seconds']):.2f}"
                              for c in cells_of(run, phase))
            out.append(f"{phase} GB/s {cells}")
        return f"{head} " + "; ".join(out) + ("" if read_ok(run) else " MISMATCH")
    parts = []
    for phase in ("save", "load"):
        r = run[phase]
        if "error" in r:
            parts.append(f"{phase} FAILED: {r['error']}")
        else:
            gb = r["bytes"] / 1e9
            parts.append(f"{phase} {r['seconds']:.2f} s ({gb / r['seconds']:.3f} GB/s, cpu "
                         f"{r['cpu_s'] / gb:.1f}+{r['server_cpu_s'] / gb:.1f} s/GB, other "
                         f"{r.get('other_cpu_s', 0):.1f} s, RSS+ {r['rss_mib']:.0f} MiB)")
    ok = run["load"].get("bitwise_ok")
    return f"{head} " + ", ".join(parts) + ("" if ok in (None, True) else " MISMATCH")


def failed(runs: list[Run]) -> bool:
    for run in runs:
        if run["engine"] == CEILING:
            if any("error" in part or part.get("errors")
                   for p in PHASES if (part := run.get(p)) is not None) or not read_ok(run):
                return True
        elif "error" in run["save"] or "error" in run["load"] or not run["load"].get("bitwise_ok"):
            return True
    return False


# ---------------------------------------------------------------- summary


def stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize(runs: list[Run]) -> dict[str, Any]:
    ceil = {r["rep"]: r for r in runs if r["engine"] == CEILING}
    ceiling: dict[str, Any] = {}
    for phase in PHASES:
        best = [(rep, b, r[phase]["bytes"]) for rep, r in ceil.items()
                if (b := best_cell(r, phase)) is not None]
        if not best:
            continue
        ceiling[phase] = {
            "gbps": stats([gbps(n, b["seconds"]) for _, b, n in best]),
            "cells": [b["cell"] for _, b, _ in best],
            "cpu_s_per_gb": stats([b["cpu_s"] / (n / 1e9) for _, b, n in best]),
            "server_cpu_s_per_gb": stats([b["server_cpu_s"] / (n / 1e9) for _, b, n in best]),
        }
    sweep = sweep_table(list(ceil.values()))
    names = list(dict.fromkeys(r["engine"] for r in runs if r["engine"] != CEILING))
    rows = [engine_row([r for r in runs if r["engine"] == n], ceil) for n in names]
    return {"ceiling": ceiling, "sweep": sweep, "rows": rows, "targets": targets(rows)}


def sweep_table(ceil: list[Run]) -> list[dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for run in ceil:
        for phase in (p for p in PHASES if cells_of(run, p)):
            nbytes = run[phase]["bytes"]
            for c in cells_of(run, phase):
                row = out.setdefault(c["cell"], {"cell": c["cell"], "concurrency": c["concurrency"],
                                                 "part_mib": c["part_mib"]})
                row.setdefault(phase, []).append(gbps(nbytes, c["seconds"]))
                row.setdefault(phase + "_cpu", []).append(c["cpu_s"] / (nbytes / 1e9))
                row.setdefault(phase + "_srv", []).append(c["server_cpu_s"] / (nbytes / 1e9))
    return [{k: (stats(v) if isinstance(v, list) else v) for k, v in row.items()}
            for row in sorted(out.values(), key=lambda r: (r["part_mib"], r["concurrency"]))]


def engine_row(runs: list[Run], ceil: dict[int, Run]) -> dict[str, Any]:
    row: dict[str, Any] = {"engine": runs[0]["engine"], "runs": len(runs)}
    # the ceiling of a load is the faster raw read: botocore's, or http.client's readinto (what
    # ckptio's reads do since storage/s3/body.py read_body reads the socket into the staging buffer)
    for phase, cphase in (("save", ("write",)), ("load", ("read", "read_direct"))):
        good = [r for r in runs if "error" not in r[phase]]
        row[phase + "_failed"] = len(runs) - len(good)
        row[phase + "_error"] = next((r[phase]["error"] for r in runs if "error" in r[phase]), None)
        row[phase] = phase_stats(good, phase, cphase, ceil)
    row["bitwise_ok"] = all(r["load"].get("bitwise_ok") for r in runs if "error" not in r["load"])
    row["concurrency"] = [r.get("concurrency") for r in runs]
    return row


def phase_stats(good: list[Run], phase: str, cphases: tuple[str, ...],
                ceil: dict[int, Run]) -> dict[str, Any]:
    """Medians (min/max) of one phase's runs; % of the ceiling (the best of ``cphases``) of the
    same repetition."""

    def metric(fn: Callable[[Run, Run], float | None]) -> dict[str, float] | None:
        return stats([v for r in good if (v := fn(r[phase], r)) is not None])

    def pct(p: Run, r: Run) -> float | None:
        c = ceil.get(r["rep"])
        rates = [c[cp]["bytes"] / b["seconds"] for cp in cphases
                 if c and cp in c and (b := best_cell(c, cp)) is not None]
        return 100 * p["bytes"] / p["seconds"] / max(rates) if rates else None

    return {
        "seconds": metric(lambda p, r: p["seconds"]),
        "gbps": metric(lambda p, r: gbps(p["bytes"], p["seconds"])),
        "pct": metric(pct),
        "cpu_s_per_gb": metric(lambda p, r: p["cpu_s"] / (p["bytes"] / 1e9)),
        "server_cpu_s_per_gb": metric(lambda p, r: p["server_cpu_s"] / (p["bytes"] / 1e9)),
        "rss_mib": metric(lambda p, r: p["rss_mib"]),
        "other_cpu_s": metric(lambda p, r: p.get("other_cpu_s")),
    }


def med(row: dict[str, Any], phase: str, key: str) -> float | None:
    s = (row.get(phase) or {}).get(key)
    return None if s is None else s["median"]


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ckptio row against the targets."""
    out = []
    dcp = [r for r in rows if r["engine"].startswith("dcp_fsspec")]
    for r in (r for r in rows if r["engine"].startswith("ckptio")):
        for phase in ("save", "load"):
            pct = med(r, phase, "pct")
            out.append({"engine": r["engine"], "target": f"{phase} >= {TARGET_PCT:.0f}% of ceiling",
                        "value": pct, "met": pct is not None and pct >= TARGET_PCT})
            best = max((d for d in dcp if med(d, phase, "gbps")), default=None,
                       key=lambda d: med(d, phase, "gbps") or 0)
            mine = med(r, phase, "gbps")
            if best is not None and mine:
                ratio = mine / (med(best, phase, "gbps") or 1)
                out.append({"engine": r["engine"], "target": f"{phase} >= {TARGET_DCP:.0f}x "
                            f"best DCP/fsspec ({best['engine']})", "value": ratio,
                            "met": ratio >= TARGET_DCP})
            rss = med(r, phase, "rss_mib")
            out.append({"engine": r["engine"], "target": f"{phase} RSS+ <= {RSS_SLACK} x pool",
                        "value": rss, "met": rss is not None and rss <= RSS_SLACK * POOL_MIB})
    return out


# ---------------------------------------------------------------- machine

VERSIONS = "import importlib.metadata as m; print(' '.join(f'{{p}} {{m.version(p)}}' for p in {}))"
MAIN_PACKAGES = ("torch", "boto3", "botocore")
PEER_PACKAGES = ("torch", "s3fs", "aiobotocore", "botocore", "s3torchconnector",
                 "s3torchconnectorclient", "torchsnapshot")


def machine(args: argparse.Namespace) -> dict[str, Any]:
    def cmd(argv: list[str]) -> str:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                  check=False).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "?"

    from ckptio.testing.s3server import weed_binary

    with open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    with open("/proc/meminfo") as f:
        mem = next((ln.split()[1] for ln in f if ln.startswith("MemTotal")), "0")
    peer = cmd([str(args.peer_python), "-c", VERSIONS.format(PEER_PACKAGES)])
    main = cmd([sys.executable, "-c", VERSIONS.format(MAIN_PACKAGES)])
    return {"nproc": os.cpu_count(), "cpu": model, "mem_gib": int(mem) / 2**20,
            "kernel": platform.release(), "weed": cmd([weed_binary(), "version"]),
            "main_venv": main, "peer_venv": peer, "date": time.strftime("%Y-%m-%d %H:%M")}


# ---------------------------------------------------------------- markdown


def fmt(s: dict[str, float] | None, spec: str = ".2f", spread: bool = True) -> str:
    if s is None:
        return "-"
    mid = format(s["median"], spec)
    if not spread or s["n"] < 2:
        return mid
    return f"{mid} ({format(s['min'], spec)}-{format(s['max'], spec)})"


def engine_table(rows: list[dict[str, Any]], ceiling: dict[str, Any]) -> list[str]:
    out = [("| engine | phase | s | GB/s (min-max) | % ceiling | client CPU s/GB "
            "| server CPU s/GB | RSS+ MiB | other CPU s | bitwise |"),
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        for phase in ("save", "load"):
            p = r[phase]
            if r[phase + "_failed"] == r["runs"]:
                err = str(r[phase + "_error"]).replace("|", "/")[:160]
                out.append(f"| {r['engine']} | {phase} | FAILED: {err} | | | | | | | |")
                continue
            ok = "ok" if r["bitwise_ok"] else "MISMATCH"
            if r[phase + "_failed"]:
                ok += f" ({r[phase + '_failed']} failed)"
            out.append(f"| {r['engine']} | {phase} | {fmt(p['seconds'], spread=False)} | "
                       f"{fmt(p['gbps'], '.3f')} | {fmt(p['pct'], '.0f')} | "
                       f"{fmt(p['cpu_s_per_gb'], '.1f', False)} | "
                       f"{fmt(p['server_cpu_s_per_gb'], '.1f', False)} | "
                       f"{fmt(p['rss_mib'], '.0f')} | {fmt(p['other_cpu_s'], '.1f', False)} | "
                       f"{ok if phase == 'load' else '-'} |")
    for phase, what, label in (("write", "save", "raw boto3 ceiling"),
                               ("read", "load", "raw boto3 ceiling"),
                               ("read_direct", "load", "raw, http.client readinto"),
                               ("read_cold", "load", "raw boto3, fresh process, client made "
                                "inside the clock (context)")):
        c = ceiling.get(phase) or {}
        if c.get("gbps"):
            pct = "100" if phase in ("write", "read") else fmt(pct_of(c, _faster_read(
                ceiling, ("read",) if phase == "read_direct" else ("read", "read_direct"))), ".0f")
            out.append(f"| {label} ({', '.join(c['cells'])}) | {what} | - | "
                       f"{fmt(c['gbps'], '.3f')} | {pct} | {fmt(c['cpu_s_per_gb'], '.1f', False)} | "
                       f"{fmt(c['server_cpu_s_per_gb'], '.1f', False)} | - | - | - |")
    return out


def _faster_read(ceiling: dict[str, Any], phases: tuple[str, ...]) -> dict[str, Any] | None:
    """The ceiling phase of ``phases`` with the higher median (a load's ceiling: the faster of
    boto3's read and http.client's readinto)."""
    found = [ceiling[p] for p in phases if (ceiling.get(p) or {}).get("gbps")]
    return max(found, key=lambda c: c["gbps"]["median"], default=None)


def pct_of(c: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, float] | None:
    if not ref or not ref.get("gbps") or not c.get("gbps"):
        return None
    return {"median": 100 * c["gbps"]["median"] / ref["gbps"]["median"], "n": 1,
            "min": 0.0, "max": 0.0}


def sweep_lines(sweep: list[dict[str, Any]]) -> list[str]:
    direct = any(row.get("read_direct") for row in sweep)
    extra = (" read http.client GB/s | CPU s/GB client+server |", "---:|---:|") if direct else ("", "")
    out = [("| concurrency x part MiB | write GB/s | read GB/s | write CPU s/GB client+server "
            f"| read CPU s/GB client+server |{extra[0]}"), f"|---|---:|---:|---:|---:|{extra[1]}"]
    for row in sweep:
        more = (f" {fmt(row.get('read_direct'), '.3f')} | {cpu_pair(row, 'read_direct')} |"
                if direct else "")
        out.append(f"| {row['cell']} | {fmt(row.get('write'), '.3f')} | "
                   f"{fmt(row.get('read'), '.3f')} | {cpu_pair(row, 'write')} | "
                   f"{cpu_pair(row, 'read')} |{more}")
    return out


def cpu_pair(row: dict[str, Any], phase: str) -> str:
    a, b = row.get(phase + "_cpu"), row.get(phase + "_srv")
    return "-" if a is None or b is None else f"{a['median']:.1f}+{b['median']:.1f}"


def markdown(summary: dict[str, Any], args: argparse.Namespace, argv: list[str],
             names: list[str], machine: dict[str, Any]) -> str:
    from benchmarks.s3_peers import engine
    from ckptio.tuning import state

    nbytes = state.state_nbytes(state.gpt_config(args.gb))
    command = shlex.join(["python", "-m", "benchmarks.s3", *argv])
    notes = [f"- {n}: {engine(n.split('@')[0]).note}"
             + (f"; environment {', '.join(n.split('@')[1:])}" if "@" in n else "")
             for n in names]
    lines = [
        "## S3 (SeaweedFS on loopback): durable save and cold load", "", f"`{command}`  ",
        (f"{machine['date']}; {machine['nproc']} CPUs ({machine['cpu']}), "
         f"{machine['mem_gib']:.0f} GiB, kernel {machine['kernel']}; client and `weed mini` "
         "share these CPUs  "),
        (f"server: {machine['weed']}, data on `{shown_path(args.dir)}` (local disk), fresh and "
         "empty per (engine, rep), restarted + page cache dropped before every load  "),
        f"main venv: {machine['main_venv']}; peer venv: {machine['peer_venv']}  ",
        (f"state: GPT + AdamW, S = {nbytes:,} bytes; {args.reps} reps, medians (min-max); "
         "one fresh process per save and per load; GB = 1e9 bytes"), "",
        *engine_table(summary["rows"], summary["ceiling"]), "",
        "Targets:", "",
        *[f"- {t['engine']} {t['target']}: "
          f"{'-' if t['value'] is None else format(t['value'], '.2f')} -> "
          f"{'met' if t['met'] else 'MISSED'}" for t in summary["targets"]], "",
        "Raw client sweep (medians over the reps that measured the cell):", "",
        *sweep_lines(summary["sweep"]), "",
        *notes,
        ("- save: untimed warm-up save of a 1 MiB state first (clients, pools, the volume); "
         "the clock runs from the call to its return (ckptio: committed); RSS+ = peak VmHWM "
         "minus RSS before the warm-up (spans both); CPU = the process's user+sys (os.times) "
         "and weed's (/proc/PID/stat) over the timed call; other CPU = the machine's busy CPU "
         "(/proc/stat) minus both: anything else that ran meanwhile"),
        ("- load: server restarted, page cache dropped, destination allocated and touched; "
         "the clock runs around the in-place load; bitwise = xxh3 of every leaf (untimed)"), "",
    ]
    return "\n".join(lines)
