"""Reports of the checkpoint I/O study: progress lines, medians, markdown tables and JSON.

Owns: the machine description, the progress line of each cell, grouping the study's runs by cell,
medians over repetitions, % of the ceiling measured in the same repetition, the markdown report,
the JSON file, and writing every output (PREFIX.json, PREFIX.md, the plots).
Does not own: drawing the plots (io_plots.py) or measuring anything (io_study.py, io_cells.py).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptio.options import GiB, KiB, MiB
from ckptio.tuning.io_cells import ENGINES, MODES, Cell, Run
from ckptio.tuning.profile import filesystem_key

__all__ = ["Row", "configs", "engine_label", "fmt_nbytes", "machine", "mix_stats", "progress",
           "select", "summarize", "write_all"]

Row = dict[str, Any]
CELL_FIELDS = tuple(Cell.__dataclass_fields__)


def machine(directory: Path, unaligned_direct: str) -> dict[str, Any]:
    device, kind = filesystem_key(directory)
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            "kernel": os.uname().release, "dir": str(directory.resolve()), "fs_type": kind,
            "device": f"{os.major(device)}:{os.minor(device)}", "unaligned_direct": unaligned_direct}


def mix_stats(sizes: Sequence[int]) -> dict[str, Any]:
    return {"tensors": len(sizes), "nbytes": sum(sizes), "median_nbytes": statistics.median(sizes),
            "under_64k": sum(n < 64 * KiB for n in sizes), "largest_nbytes": max(sizes)}


# ---------------------------------------------------------------- progress


def label(cell: Cell) -> str:
    depth = "" if cell.engine == "posix1" else f" d{cell.depth}"
    extra = ("" if cell.aligned else " unaligned") + ("" if cell.prealloc else " extending")
    return (f"{cell.workload} {cell.layout} {cell.engine}{depth} {cell.mode} "
            f"{fmt_nbytes(cell.write_nbytes)}{extra}")


def fmt_nbytes(nbytes: int) -> str:
    for unit, size in (("G", GiB), ("M", MiB), ("K", KiB)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def progress(run: Run, index: int, total: int) -> str:
    """One line per measured cell (or ceiling) for stderr."""
    if "write_nbytes" not in run:
        return f"[rep {run['rep'] + 1}] ceiling: {ceiling_text(run)}"
    head = f"[{index}/{total} rep {run['rep'] + 1}] {label(Cell(**{k: run[k] for k in CELL_FIELDS}))}:"
    if "error" in run:
        return f"{head} FAILED {run['error']}"
    return (f"{head} write {run['write_gbps']:.2f} GB/s (fsync {run['sync_s']:.2f} s), "
            f"read {run['read_gbps']:.2f} GB/s, {run['files']} files, {run['requests']} requests")


def ceiling_text(c: Run) -> str:
    if "error" in c:
        return f"FAILED {c['error']}"
    return f"write {c['write_gbps']:.2f} GB/s, read {c['read_gbps']:.2f} GB/s"


# ---------------------------------------------------------------- summary


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: Sequence[Run], ceilings: Sequence[Run]) -> dict[str, Any]:
    """Medians per cell; % of ceiling is each run over the ceiling of its own repetition."""
    ceil = {c["rep"]: c for c in ceilings if "error" not in c}
    groups: dict[tuple[Any, ...], list[Run]] = {}
    for r in runs:
        groups.setdefault(tuple(r[k] for k in CELL_FIELDS), []).append(r)
    return {"ceiling": {"write_gbps": median([c["write_gbps"] for c in ceil.values()]),
                        "read_gbps": median([c["read_gbps"] for c in ceil.values()])},
            "rows": sorted((summarize_cell(rs, ceil) for rs in groups.values()), key=row_order)}


def row_order(row: Row) -> tuple[Any, ...]:
    return (row["workload"], row["layout"], MODES.index(row["mode"]) if row["mode"] in MODES else 9,
            ENGINES.index(row["engine"]) if row["engine"] in ENGINES else 9, row["depth"],
            row["write_nbytes"], not row["aligned"], not row["prealloc"])


def summarize_cell(runs: Sequence[Run], ceil: dict[int, Run]) -> Row:
    good = [r for r in runs if "error" not in r]

    def med(fn: Callable[[Run], float | None]) -> float | None:
        return median([v for r in good if (v := fn(r)) is not None])

    def pct(r: Run, key: str) -> float | None:
        c = ceil.get(r["rep"])
        return None if c is None else 100 * r[key] / c[key]

    row: Row = {k: runs[0][k] for k in CELL_FIELDS}
    row.update({k: runs[0][k] for k in ("payload_nbytes", "io_nbytes", "files", "requests")})
    row.update(reps=len(runs), failed=len(runs) - len(good),
               error=next((r["error"] for r in runs if "error" in r), None))
    for key in ("write_gbps", "read_gbps", "write_s", "read_s", "open_s", "sync_s"):
        row[key] = med(lambda r, k=key: r[k])  # type: ignore[misc]
    row["write_pct"] = med(lambda r: pct(r, "write_gbps"))
    row["read_pct"] = med(lambda r: pct(r, "read_gbps"))
    return row


def select(rows: Sequence[Row], **want: Any) -> list[Row]:
    return [r for r in rows if all(r[k] == v for k, v in want.items())]


def first(rows: Sequence[Row], **want: Any) -> Row | None:
    found = select(rows, **want)
    return found[0] if found else None


def engine_label(row: Row) -> str:
    return row["engine"] if row["engine"] == "posix1" else f"{row['engine']} d{row['depth']}"


def configs(rows: Sequence[Row]) -> list[tuple[str, int]]:
    order = {engine: i for i, engine in enumerate(ENGINES)}
    return sorted({(r["engine"], r["depth"]) for r in rows}, key=lambda e: (order.get(e[0], 9), e[1]))


# ---------------------------------------------------------------- markdown


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def gbps_cell(row: Row | None, direction: str) -> str:
    if row is None:
        return "-"
    if row[f"{direction}_gbps"] is None:
        return "failed"
    pct = row[f"{direction}_pct"]
    return fmt(row[f"{direction}_gbps"]) + ("" if pct is None else f" ({pct:.0f}%)")


def table(head: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *["| " + " | ".join(cells) + " |" for cells in body], ""]


def sweep_tables(rows: Sequence[Row]) -> list[str]:
    sweep = select(rows, workload="equal", layout="aggregated", aligned=True, prealloc=True)
    sizes = sorted({r["write_nbytes"] for r in sweep})
    out = ["### Write size sweep", "", "Equal-size tensors, one file, 4 KiB-aligned, preallocated. "
           "GB/s (% of the ceiling of the same repetition).", ""]
    for direction in ("write", "read"):
        body = []
        for mode in ("direct", "buffered"):
            for engine, depth in configs(select(sweep, mode=mode)):
                cells = {r["write_nbytes"]: r for r in select(sweep, mode=mode, engine=engine, depth=depth)}
                body.append([engine_label({"engine": engine, "depth": depth}), mode,
                             *[gbps_cell(cells.get(n), direction) for n in sizes]])
        out += [f"{direction}:", "", *table(["engine", "mode", *map(fmt_nbytes, sizes)], body)]
    return out


def align_table(rows: Sequence[Row], probe: str) -> list[str]:
    pairs = [(r, first(rows, **{**{k: r[k] for k in CELL_FIELDS}, "aligned": True}))
             for r in select(rows, aligned=False)]
    body = [[engine_label(r), r["mode"], fmt_nbytes(r["write_nbytes"]), gbps_cell(a, "write"),
             gbps_cell(r, "write"), gbps_cell(a, "read"), gbps_cell(r, "read"), "n/a"]
            for r, a in pairs]
    if not body:
        return []
    return ["### Aligned vs unaligned", "", "Unaligned: buffer address and every file offset one "
            f"byte off 4 KiB. O_DIRECT unaligned is n/a: O_DIRECT needs 4 KiB-aligned buffers, "
            f"offsets and lengths; this filesystem's answer to one such write: {probe}.", "",
            *table(["engine", "mode", "size", "aligned write", "unaligned write", "aligned read",
                    "unaligned read", "O_DIRECT unaligned"], body)]


def layout_table(rows: Sequence[Row]) -> list[str]:
    body = []
    for fpt in select(rows, workload="equal", layout="file_per_tensor"):
        key = {k: fpt[k] for k in CELL_FIELDS if k != "layout"}
        agg = first(rows, layout="aggregated", **key)
        ok = agg and agg["write_gbps"] and fpt["write_gbps"]
        ratio = fpt["write_gbps"] / agg["write_gbps"] if agg and ok else None
        body.append([engine_label(fpt), fpt["mode"], fmt_nbytes(fpt["write_nbytes"]), str(fpt["files"]),
                     gbps_cell(agg, "write"), gbps_cell(fpt, "write"), fmt(ratio),
                     gbps_cell(agg, "read"), gbps_cell(fpt, "read")])
    if not body:
        return []
    return ["### File per tensor vs aggregated", "", "Equal-size tensors: one file each "
            "(created, preallocated, written, fsynced) vs one aggregated file.", "",
            *table(["engine", "mode", "tensor", "files", "aggregated write", "per-tensor write",
                    "per-tensor / aggregated", "aggregated read", "per-tensor read"], body)]


def mix_table(rows: Sequence[Row], stats: dict[str, Any] | None) -> list[str]:
    mix = select(rows, workload="gpt")
    if not mix or stats is None:
        return []
    order = {"file_per_tensor": 0, "aggregated": 1, "coalesced": 2}
    engines = configs(mix)  # computed first: list.sort empties the list while it sorts
    mix.sort(key=lambda r: (r["mode"], engines.index((r["engine"], r["depth"])), order[r["layout"]]))
    body = [[engine_label(r), r["mode"], r["layout"], str(r["files"]), str(r["requests"]),
             gbps_cell(r, "write"), gbps_cell(r, "read")] for r in mix]
    coalesced = next((r for r in mix if r["layout"] == "coalesced"), None)
    return ["### Realistic mix: GPT + AdamW tensor sizes", "",
            f"{stats['tensors']} tensors, {stats['nbytes'] / 1e6:.0f} MB; median "
            f"{stats['median_nbytes'] / KiB:.1f} KiB, {stats['under_64k']} under 64 KiB, largest "
            f"{stats['largest_nbytes'] / MiB:.0f} MiB. aggregated: one file, each tensor at a 4 KiB-"
            "aligned offset, one request per tensor; coalesced: the same file written in "
            f"{fmt_nbytes(coalesced['write_nbytes']) if coalesced else '-'} requests (no staging "
            "copy timed).", "",
            *table(["engine", "mode", "layout", "files", "requests", "write GB/s", "read GB/s"], body)]


def extend_table(rows: Sequence[Row]) -> list[str]:
    body = []
    for ext in select(rows, prealloc=False):
        pre = first(rows, **{**{k: ext[k] for k in CELL_FIELDS}, "prealloc": True})
        body.append([engine_label(ext), ext["mode"], fmt_nbytes(ext["write_nbytes"]),
                     gbps_cell(pre, "write"), gbps_cell(ext, "write")])
    if not body:
        return []
    return ["### Preallocated vs extending writes", "", *table(
        ["engine", "mode", "size", "preallocated write", "extending write"], body)]


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    rows, ceil, cfg = summary["rows"], summary["ceiling"], meta["config"]
    lines = [
        "## Checkpoint I/O study", "", f"`{shlex.join(['ckptio', 'bench', 'io', *meta['argv']])}`  ",
        f"{meta['date']}, {meta['cpus']} CPUs, kernel {meta['kernel']}, `{meta['dir']}` "
        f"({meta['fs_type']}, device {meta['device']}); {fmt_nbytes(cfg['total_nbytes'])} per cell, "
        f"{cfg['reps']} rep(s), medians; {meta['seconds']:.0f} s in all  ",
        f"Ceiling (ceiling.py: O_DIRECT, threads, same run): write {fmt(ceil['write_gbps'])} GB/s, "
        f"read {fmt(ceil['read_gbps'])} GB/s", "",
    ]
    lines += [f"- {e}: unavailable ({why})" for e, why in meta["unavailable"].items()]
    if cfg["total_nbytes"] < 256 * MiB:
        lines += [f"- {fmt_nbytes(cfg['total_nbytes'])} per cell is latency-bound and noisy "
                  "(a % over 100 means the cell beat this run's ceiling): indicative only; the study "
                  "proper uses --total 1G or more.", ""]
    lines += sweep_tables(rows) + align_table(rows, meta["unaligned_direct"]) + layout_table(rows)
    lines += mix_table(rows, meta.get("gpt_mix")) + extend_table(rows)
    lines += [
        "Notes: write = create + fallocate + writes + fsync of every file (both modes; durable), "
        "read = open + reads after dropping the page cache; GB/s counts tensor bytes (O_DIRECT "
        "pads each tensor to 4 KiB); one source and one sink buffer, mmap'd and pre-faulted once, "
        "serve every request; posix1 = one thread of os.pwrite/os.preadv, posix_pool dN = "
        "ckptio's posix backend with N threads, uring dN = ckptio's io_uring backend at queue "
        "depth N; at most N requests in flight, oldest awaited first. Buffers registered as "
        f"io_uring fixed buffers: {fixed_text(meta.get('fixed_buffers', {}))}.", ""]
    failed = [r for r in rows if r["failed"]]
    lines += [f"- failed: {r['engine']} {r['mode']} {r['layout']} {fmt_nbytes(r['write_nbytes'])}: "
              f"{r['error']}" for r in failed]
    return "\n".join(lines)


def fixed_text(fixed: dict[str, bool]) -> str:
    if not fixed:
        return "none (no backend offers it)"
    if all(fixed.values()):
        return "yes, by every uring backend"
    return "refused for " + ", ".join(k for k, ok in fixed.items() if not ok)

# ---------------------------------------------------------------- outputs


def write_all(runs: Sequence[Run], ceilings: Sequence[Run], meta: dict[str, Any], prefix: Path,
              plots: Callable[[dict[str, Any], Path], list[Path]]) -> None:
    """Print the markdown; write PREFIX.json, PREFIX.md and the ``plots`` (io_plots.plots, which
    imports this module; skipped, said so, without matplotlib)."""
    summary = summarize(runs, ceilings)
    text = markdown(summary, meta)
    print(text)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = [prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".md")]
    written[0].write_text(json.dumps({"meta": meta, "summary": summary, "ceilings": list(ceilings),
                                      "runs": list(runs)}, indent=1))
    written[1].write_text(text)
    try:
        written += plots(summary, prefix)
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
