"""The jobs of the many-rank benchmark (ranks.py) and the summary and markdown report of their
runs: medians, GB/s, % of the disk ceiling, and the issue's targets checked; the one-line
progress of each run.

Owns: which jobs a run holds (schedule) and how runs become tables. Does not own: running them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from typing import Any

from benchmarks import fmt, gbps, median, shown_path

Run = dict[str, Any]


def load_worlds(args: argparse.Namespace) -> dict[str, int]:
    worlds = {"same": args.ranks, "to1": 1, "to2n": 2 * args.ranks}  # ckptio's loads
    return {k: worlds[k] for k in args.load_kinds if k in worlds}


def peer_worlds(args: argparse.Namespace, peer: str) -> list[int]:
    """The worlds DCP's ("dcp") or torch_checkpointing's ("tcp") loads run on: the saving
    layout (``dcp``/``tcp``), one rank (``*_to1``), twice the ranks (``*_to2n``)."""
    worlds = {peer: args.ranks, f"{peer}_to1": 1, f"{peer}_to2n": 2 * args.ranks}
    return [w for k, w in worlds.items() if k in args.load_kinds]


def save_engines(args: argparse.Namespace) -> list[str]:
    raw = [RAW] if getattr(args, "raw_writers", False) else []
    tcp = [TCP] if any(k.startswith("tcp") for k in getattr(args, "load_kinds", ())) else []
    return ["ckptio", *[f"dcp_t{t}" for t in args.threads], *raw, *tcp]  # [1]: the DCP loaded


RAW = "raw_writers"  # N processes each write S/N bytes with O_DIRECT, timed like a save
TCP = "tcp"  # Meta's torch_checkpointing, sync CheckpointManager, DefaultResharder on 2+ ranks


def schedule(args: argparse.Namespace) -> tuple[list[str], list[tuple[str, int]]]:
    saves = save_engines(args)
    loads = [("ckptio", w) for w in load_worlds(args).values()]
    if args.threads:
        loads += [("dcp", w) for w in peer_worlds(args, "dcp")]
    loads += [(TCP, w) for w in peer_worlds(args, TCP)]
    return saves, loads


TARGET_SAVE_PCT = 95.0  # issue 29 item 3 (issue 15 had 90 and 1.15)
TARGET_SAVE_VS_DCP = 3.0
TARGET_RESHARD = 1.1
TARGET_LOAD_VS_DCP = 1.5  # issue 51: the first cold load in fresh processes
TARGET_LOAD_FIO_PCT = 90.0


def summarize(runs: list[Run], args: argparse.Namespace) -> dict[str, Any]:

    good = [r for r in runs if "error" not in r]
    expect = next((r for r in good if r["job"] == "expect"), None)
    ceil = {r["rep"]: r for r in good if r["job"] == "ceiling"}
    files = {r["rep"]: r for r in good if r["job"] == "fio_files"}
    out: dict[str, Any] = {
        "ranks": args.ranks, "bytes": expect["bytes"] if expect else None,
        "tensors": expect["tensors"] if expect else None,
        "ceiling_write_gbps": median([gbps(r, "write_s") for r in ceil.values()]),
        "ceiling_read_gbps": median([gbps(r, "read_s") for r in ceil.values()]),
        "ceiling_write_s": median([r["write_s"] for r in ceil.values()]),
        "ceiling_read_s": median([r["read_s"] for r in ceil.values()]),
        "fio_read_s": median([r["fio_read_s"] for r in ceil.values() if "fio_read_s" in r]),
        "fio_command": next((r["fio_command"] for r in ceil.values() if "fio_command" in r), None),
        "fio_files_s": median([r["read_s"] for r in files.values()]),
        "fio_files_command": next((r["command"] for r in files.values()), None),
    }

    def pct(r: Run, seconds: str, ceil_seconds: str) -> float | None:
        c = ceil.get(r["rep"])
        return None if c is None else 100 * gbps(r, seconds) / gbps(c, ceil_seconds)

    def med(rs: list[Run], fn: Any) -> float | None:
        return median([v for r in rs if (v := fn(r)) is not None])

    saves = []
    for engine in save_engines(args):
        all_rs = [r for r in runs if r.get("job") == "save" and r.get("engine") == engine]
        rs = [r for r in all_rs if "error" not in r]
        saves.append({
            "engine": engine, "ranks": args.ranks, "runs": len(all_rs), "failed": len(all_rs) - len(rs),
            "first_save_s": med(rs, lambda r: r["first_save_s"]), "save_s": med(rs, lambda r: r["save_s"]),
            "save_gbps": med(rs, lambda r: gbps(r, "save_s")),
            "save_pct": med(rs, lambda r: pct(r, "save_s", "write_s")),
            "save_rss_mib": med(rs, lambda r: r["save_rss_mib"]),
            "files": med(rs, lambda r: r["files"]), "disk_mb": med(rs, lambda r: r["disk_bytes"] / 1e6)})
    loads = []
    _, planned = schedule(args)
    for engine, world in planned:
        layout = f"{args.ranks}->{world}"
        all_rs = [r for r in runs if r.get("job") == "load" and r.get("engine") == engine
                  and r.get("layout") == layout]
        rs = [r for r in all_rs if "error" not in r]
        loads.append({
            "engine": engine, "layout": layout, "ranks": world, "runs": len(all_rs),
            "failed": len(all_rs) - len(rs), "load_s": med(rs, lambda r: r["load_s"]),
            "load_gbps": med(rs, lambda r: gbps(r, "load_s")),
            "load_pct": med(rs, lambda r: pct(r, "load_s", "read_s")),
            "fio_pct": med(rs, lambda r: pct(r, "load_s", "fio_read_s")
                           if "fio_read_s" in ceil.get(r["rep"], {}) else None),
            "fio_files_pct": med(rs, lambda r: 100 * files[r["rep"]]["read_s"] / r["load_s"]
                                 if r["rep"] in files else None),
            "later_s": med(rs, lambda r: r.get("later_load_s")),
            "load_rss_mib": med(rs, lambda r: r["load_rss_mib"]),
            "read_mb": med(rs, lambda r: None if r.get("nbytes_read") is None else r["nbytes_read"] / 1e6),
            "disk_mb": med(rs, lambda r: None if r.get("disk_read_bytes") is None
                           else r["disk_read_bytes"] / 1e6),
            "bitwise_ok": bool(rs) and len(rs) == len(all_rs) and all(r["bitwise_ok"] for r in rs)})
    out["saves"], out["loads"] = saves, loads
    out["checks"] = checks(saves, loads, args)
    return out


def checks(saves: list[dict[str, Any]], loads: list[dict[str, Any]],
           args: argparse.Namespace) -> list[dict[str, Any]]:
    """The issue's targets, each as value vs target (medians; ratios of medians)."""
    out: list[dict[str, Any]] = []
    mine = next((s for s in saves if s["engine"] == "ckptio"), None)
    dcp = [s for s in saves if s["engine"].startswith("dcp_t") and s["save_gbps"]]
    best = max(dcp, key=lambda s: s["save_gbps"], default=None)
    if mine and mine["save_pct"] is not None:
        out.append({"what": "ckptio save, % of write ceiling", "value": mine["save_pct"],
                    "target": f">= {TARGET_SAVE_PCT:.0f}", "ok": mine["save_pct"] >= TARGET_SAVE_PCT})
    raw = next((s for s in saves if s["engine"] == RAW and s["save_s"]), None)
    if mine and mine["save_s"] and raw:
        out.append({"what": f"ckptio save, % of {args.ranks} raw writers (time)",
                    "value": 100 * raw["save_s"] / mine["save_s"], "target": "-", "ok": None})
    if mine and mine["save_gbps"] and best:
        ratio = mine["save_gbps"] / best["save_gbps"]
        out.append({"what": f"ckptio save / best DCP save ({best['engine']})", "value": ratio,
                    "target": f">= {TARGET_SAVE_VS_DCP:.0f}", "ok": ratio >= TARGET_SAVE_VS_DCP})
    same = next((ld for ld in loads if ld["engine"] == "ckptio" and ld["ranks"] == args.ranks), None)
    dcp_load = next((ld for ld in loads if ld["engine"] == "dcp"), None)
    if same and same["load_s"] and dcp_load and dcp_load["load_s"]:
        ratio = dcp_load["load_s"] / same["load_s"]
        out.append({"what": f"ckptio / DCP load GB/s, {same['layout']}", "value": ratio,
                    "target": f">= {TARGET_LOAD_VS_DCP}", "ok": ratio >= TARGET_LOAD_VS_DCP})
    if same and same.get("fio_pct") is not None:
        out.append({"what": f"ckptio load {same['layout']}, % of fio's read ceiling",
                    "value": same["fio_pct"], "target": f">= {TARGET_LOAD_FIO_PCT:.0f}",
                    "ok": same["fio_pct"] >= TARGET_LOAD_FIO_PCT})
    if same and same.get("fio_files_pct") is not None:
        out.append({"what": f"ckptio load {same['layout']}, % of fio on its own data files",
                    "value": same["fio_files_pct"], "target": f">= {TARGET_LOAD_FIO_PCT:.0f}",
                    "ok": same["fio_files_pct"] >= TARGET_LOAD_FIO_PCT})
    for ld in loads:
        if ld["engine"] == "ckptio" and ld is not same and same and same["load_s"] and ld["load_s"]:
            ratio = ld["load_s"] / same["load_s"]
            out.append({"what": f"ckptio load {ld['layout']} / {same['layout']} (time)", "value": ratio,
                        "target": f"<= {TARGET_RESHARD}", "ok": ratio <= TARGET_RESHARD})
    return out


# ---------------------------------------------------------------- markdown


def markdown(summary: dict[str, Any], args: argparse.Namespace, argv: list[str]) -> str:
    from ckptio.tuning import ceiling
    from ckptio.tuning import state

    cfg = state.gpt_config(args.gb)
    command = shlex.join(["python", "-m", "benchmarks.ranks", *argv])
    nbytes = summary["bytes"] or 0
    lines = [
        f"## {args.ranks}-rank durable save and cold load (resharded)", "", f"`{command}`  ",
        (f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, dir `{shown_path(args.dir)}`, "
        f"{args.reps} reps, fresh gloo processes per job (OMP_NUM_THREADS=1), medians  "),
        (f"state: GPT+AdamW of state.py, S = {nbytes:,} bytes ({summary['tensors']} tensor leaves), "
        f"d_model {cfg.d_model}, {cfg.n_layers} blocks, vocab {cfg.vocab}; 2+-dim tensors DTensor "
        f"Shard(0) over a 1-D CPU mesh of {args.ranks}, 1-D (norms, biases) Replicate, 0-dim and "
        "RNG plain (same on every rank)  "),
        "ceiling: save_load's O_DIRECT worker, S bytes, every rep, best of "
        + ", ".join(f"{c >> 20} MiB x {t} threads" for c, t in ceiling.GEOMETRIES), "",
        "| engine | ranks | 1st save s | save s | save GB/s | % write ceil | RSS+ MiB/rank | files | disk MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary["saves"]:
        fail = f" ({s['failed']} failed)" if s["failed"] else ""
        lines.append(f"| {s['engine']}{fail} | {s['ranks']} | {fmt(s['first_save_s'])} | {fmt(s['save_s'])} "
                     f"| {fmt(s['save_gbps'])} | {fmt(s['save_pct'], '.0f')} | {fmt(s['save_rss_mib'], '.0f')} "
                     f"| {fmt(s['files'], '.0f')} | {fmt(s['disk_mb'], '.0f')} |")
    lines.append(f"| O_DIRECT ceiling | - | - | {fmt(summary['ceiling_write_s'])} "
                 f"| {fmt(summary['ceiling_write_gbps'])} | 100 | - | 1 | {nbytes / 1e6:.0f} |")
    lines += ["", ("| engine | layout | load s | load GB/s | % read ceil | % fio ceil "
              "| % fio on ckptio's files | later load s "
              "| RSS+ MiB/rank | read MB (all ranks) | disk read MB | bitwise |"),
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for ld in summary["loads"]:
        ok = (f"FAILED ({ld['failed']} run(s) failed; see the log)" if ld["failed"]
              else "ok" if ld["bitwise_ok"] else "MISMATCH")
        lines.append(f"| {ld['engine']} | {ld['layout']} | {fmt(ld['load_s'])} | {fmt(ld['load_gbps'])} "
                     f"| {fmt(ld['load_pct'], '.0f')} | {fmt(ld['fio_pct'], '.0f')} "
                     f"| {fmt(ld.get('fio_files_pct'), '.0f')} | {fmt(ld['later_s'])} "
                     f"| {fmt(ld['load_rss_mib'], '.0f')} "
                     f"| {fmt(ld['read_mb'], '.0f')} | {fmt(ld.get('disk_mb'), '.0f')} | {ok} |")
    lines.append(f"| O_DIRECT ceiling | - | {fmt(summary['ceiling_read_s'])} "
                 f"| {fmt(summary['ceiling_read_gbps'])} | 100 | - | - | - | - | {nbytes / 1e6:.0f} "
                 "| - | - |")
    fio_s = summary.get("fio_read_s")
    if fio_s:
        lines.append(f"| fio (io_uring, O_DIRECT, registered buffers) | - | {fmt(fio_s)} "
                     f"| {fmt(nbytes / fio_s / 1e9)} | - | 100 | - | - | - | {nbytes / 1e6:.0f} | - | - |")
    files_s = summary.get("fio_files_s")
    if files_s:
        lines.append(f"| fio on ckptio's data files (one job per file, at once) | - | {fmt(files_s)} "
                     f"| {fmt(nbytes / files_s / 1e9)} | - | - | 100 | - | - | {nbytes / 1e6:.0f} | - | - |")
    lines += ["", "| check | value | target | met |", "|---|---:|---|---|"]
    for c in summary["checks"]:
        met = "-" if c["ok"] is None else ("yes" if c["ok"] else "NO")
        lines.append(f"| {c['what']} | {c['value']:.2f} | {c['target']} | {met} |")
    lines += [
        "", ("- save: barrier, clock, save, barrier (rank 0's clock: the slowest rank counts); 1st "
        "save: the first in the process, save: a second one (what a training job pays every time)"),
        ("- ckptio: ckptio.save, durable and committed when it returns (POSIX backend, no tuned "
        "profile); DCP: dcp.save with FileSystemWriter(thread_count=k, sync_files=True), then "
        "os.sync() on every rank inside the clock (.metadata and directory entries); "
        f"{RAW}: each rank writes S/N bytes to its own file with O_DIRECT "
        "(ckptio.tuning.ceiling.Writer: 8 MiB x 4 threads, made before the clock), fsyncs it "
        "and the directory: the N-writer ceiling, timed like a save"),
        *([f"- fio: `{summary['fio_command']}` after its own write of the file and a drop of "
           "the page cache"] if summary.get("fio_command") else []),
        *([f"- fio on ckptio's files: `{summary['fio_files_command']}`, after every load of the "
           "repetition and a drop of the page cache; '% fio on ckptio's files' pairs each load "
           "with its own repetition's run"] if summary.get("fio_files_command") else []),
        *(["- --restart: ckptio loads are `ckptio.load(path, state)` with the defaults, nothing "
           "made before the clock; 'later load': the same load again in the same processes, "
           "the page cache dropped again"] if getattr(args, "restart", False) else []),
        "- load: fresh ranks allocate and zero the destination, rank 0 drops the page cache, idle, "
        f"then the clock; {args.ranks}->1 loads into plain full tensors in one process without a "
        "process group; DCP loads the checkpoint of its first --dcp-threads variant, after "
        "ckptio's loads in every rep; ckptio's "
        + ("staging pool is made inside the clock (--cold-pool)" if args.cold_pool else
           "staging pool and I/O threads are made before the clock (Checkpointer.prepare)"),
        ("- read MB: ckptio's LoadReport.nbytes_read summed over the loading ranks (S is the "
        "minimum; more means over-reading); disk read MB: what the device holding the "
        "checkpoint read during the load (/sys/dev/block/.../stat, every process on the host: "
        "blocks read through the page cache count once)"),
        ("- bitwise: xxh3 of each rank's local tensors and every other leaf, against digests of "
        "the same region of the reference state (untimed)"), ""]
    return "\n".join(lines)


def progress(run: Run) -> str:
    head = f"[rep {run.get('rep', 0) + 1}] {run.get('job')} {run.get('engine', '')}"
    if "error" in run:
        return f"{head}: FAILED {run['error']}"
    gb = run.get("bytes", 0) / 1e9
    if run["job"] == "save":
        return (f"{head} {run['ranks']} ranks: save {run['save_s']:.2f} s ({gb / run['save_s']:.2f} "
                f"GB/s), 1st {run['first_save_s']:.2f} s, RSS+ {run['save_rss_mib']:.0f} MiB, "
                f"wall {run['wall_s']:.1f} s")
    if run["job"] == "load":
        ok = "ok" if run["bitwise_ok"] else "MISMATCH"
        return (f"{head} {run['saved_ranks']}->{run['ranks']}: load {run['load_s']:.2f} s "
                f"({gb / run['load_s']:.2f} GB/s), RSS+ {run['load_rss_mib']:.0f} MiB, bitwise {ok}, "
                f"wall {run['wall_s']:.1f} s{_disk(run)}{_later(run)}")
    if run["job"] == "fio_files":
        return (f"{head}: fio on ckptio's data files {run['read_s']:.2f} s "
                f"({run['read_bytes'] / 1e9 / run['read_s']:.2f} GB/s)")
    if run["job"] == "ceiling":
        fio = f", fio read {run['fio_read_s']:.2f} s" if "fio_read_s" in run else ""
        return (f"{head}: write {run['write_s']:.2f} s ({gb / run['write_s']:.2f} GB/s), read "
                f"{run['read_s']:.2f} s ({gb / run['read_s']:.2f} GB/s){fio}")
    return f"{head}: {run}"


def _later(run: Run) -> str:
    lines = [f"\n    r{r}: first read {t['first_read_s'] or 0:.3f} s, last {t['last_read_s'] or 0:.3f} s, "
             f"{t['read_bytes'] / 1e6:.0f} MB, {t['mid_gbps'] or 0:.2f} GB/s mid"
             for r, t in enumerate(run.get("timelines", []))]
    if "later_load_s" in run:
        lines.append(f"\n    later load {run['later_load_s']:.2f} s")
    return "".join(lines)


def _disk(run: Run) -> str:
    nbytes = run.get("disk_read_bytes")
    return "" if nbytes is None else f", disk read {nbytes / 1e6:.0f} MB"
