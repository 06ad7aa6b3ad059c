"""The tiers benchmark's numbers: the disk's ceiling measured in the run, the per-engine summary
(medians over repetitions) and the markdown of docs/BENCH_TIERS.md.

Owns: those reductions and that text. Does not own: the runs (benchmarks/tiers.py).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

__all__ = ["ceilings", "markdown", "summarize"]

NOTES = {
    "none": "no checkpoints: the baseline",
    "tiers_sync": "ckptio tiers, every step: `mgr.save(step, state)` into shm:// (sync), "
                  "drained to disk every K",
    "tiers_eager": "the same with `asynchronous=True` (copy on the call, write behind)",
    "tiers_lazy": "the same with `lazy=True, optimizers=[opt]` (copy during the next "
                  "forward/backward)",
    "tiers_s3": "as tiers_eager, plus an s3:// tier every 2K (SeaweedFS on this host)",
    "disk_k": "ckptio `CheckpointManager(disk)`, `asynchronous=True`, every K",
    "disk_lazy_k": "ckptio `CheckpointManager(disk)`, `lazy=True, optimizers=[opt]`, every K",
    "s3_k": "ckptio `CheckpointManager(s3://...)`, `asynchronous=True`, every K",
    "dcp_k": "DCP `async_save` (thread executor, FileSystemWriter sync_files=True), every K",
    "nvrx_step": "NVRx `LocalCheckpointManager.save(is_async=False)` into /dev/shm, every step",
    "tcp_step": "torch_checkpointing 0.1.1 async `save` into /dev/shm, `lock()` around the "
                "optimizer step, every step (keeps 2; no fsync)",
    "tcp_k": "torch_checkpointing 0.1.1 async `save` to disk, `lock()` around the optimizer "
             "step, every K (buffered writes; no fsync: its 'durable' column is its future's "
             "end, written but not fsynced)",
    "floor_step": "the floor: one memcpy of the state on a helper thread, every step",
}


def ceilings(args: argparse.Namespace) -> dict[str, Any]:
    """The disk's O_DIRECT write and cold read of S bytes, measured now (tuning/ceiling.py)."""
    from ckptio.tuning.state import gpt_config, state_nbytes

    from ckptio.tuning.ceiling import read_ceiling, write_ceiling

    nbytes = state_nbytes(gpt_config(args.gb))
    path = Path(args.dir) / "ceiling.bin"
    write = write_ceiling(path, nbytes)
    read = read_ceiling(path, idle=1.0)
    path.unlink()
    return {"bytes": nbytes, "write_gbps": write["bytes"] / write["seconds"] / 1e9,
            "read_gbps": read["bytes"] / read["seconds"] / 1e9, "cache_drop": read["cache_drop"]}


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]], restores: list[dict[str, Any]],
              kills: list[dict[str, Any]], flat: dict[str, Any] | None) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    base = {r["rep"]: r["train_s"] for r in ok if r["engine"] == "none"}
    engines: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["engine"] for r in runs):
        mine = [r for r in ok if r["engine"] == name]
        failed = [r for r in runs if r["engine"] == name and "error" in r]
        if not mine:
            engines[name] = {"error": failed[0]["error"][-300:] if failed else "no run"}
            continue
        over = [100 * (r["train_s"] / base[r["rep"]] - 1) for r in mine if r["rep"] in base]
        later = [_median(r["call_s"][1:]) for r in mine if len(r["call_s"]) > 1]
        engines[name] = {
            "overhead_pct": _median(over), "saves": len(mine[0]["call_s"]),
            "step_s": _median([_median(r["step_s"][1:]) for r in mine]),
            "stall_first_s": _median([r["call_s"][0] for r in mine if r["call_s"]]),
            "stall_s": _median(later),
            "tier0_durable_s": _median([r.get("tier0_durable_s") for r in mine]),
            "disk_durable_s": _median([r.get("disk_durable_s") for r in mine]),
            "s3_durable_s": _median([r.get("s3_durable_s") for r in mine]),
            "close_s": _median([r.get("close_s") for r in mine]),
            "rss_extra_mib": _median([r["rss_extra_mib"] for r in mine]),
            "shm_max_mib": _median([max(r["shm_series_mib"], default=0) for r in mine]),
            "skipped": _median([r.get("skipped") for r in mine]),
            "failed_reps": len(failed)}
    restore = {which: _median([r["seconds"] for r in restores if r.get("restore") == which
                               and r.get("tier") == tier])
               for tier, which in enumerate(("memory", "disk", "s3"))}
    whole = {which: _median([r.get("restore_s") for r in restores if r.get("restore") == which])
             for which in restore}
    wrong = [r for r in restores if "error" in r or r.get("tier") != {
        "memory": 0, "disk": 1, "s3": 2}.get(r.get("restore", ""))]
    ratio = (restore["disk"] / restore["memory"]) if restore["disk"] and restore["memory"] \
        else None
    return {"engines": engines, "restore_s": restore, "restore_whole_s": whole,
            "restore_ratio": ratio,
            "restore_runs": {w: len([r for r in restores if r.get("restore") == w])
                             for w in restore}, "restore_wrong": len(wrong),
            "lost": {e: {"memory": [k["lost_memory"] for k in kills if k["engine"] == e],
                         "disk": [k["lost_disk"] for k in kills if k["engine"] == e]}
                     for e in dict.fromkeys(k["engine"] for k in kills)},
            "flat": flat}


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:+.1f}" if digits == -1 else f"{value:.{digits}f}"
    return str(value)


def markdown(doc: dict[str, Any], args: argparse.Namespace) -> str:
    s, c = doc["summary"], doc["ceiling"]
    gb = c["bytes"] / 1e9
    lines = [f"`{doc['command']}`", "",
             f"State S = {gb:.3f} GB (model + AdamW), {args.steps} steps, K = {args.every}, "
             f"batch {args.batch} x seq {args.seq}, {args.reps} fresh processes per engine. "
             f"Disk ceiling in this run (S bytes, O_DIRECT): write {c['write_gbps']:.2f} GB/s, "
             f"cold read {c['read_gbps']:.2f} GB/s ({c['cache_drop']}).", "",
             "| engine | saves | overhead % | step s | stall 1st s | stall s | tier-0 durable s "
             "| disk durable s | s3 durable s | close s | RSS+ MiB | tmpfs max MiB | skipped | what |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, e in s["engines"].items():
        if "error" in e:
            lines.append(f"| {name} | failed: {e['error'][:120]!r} ||||||||||||")
            continue
        lines.append(
            f"| {name} | {e['saves']} | {_f(e['overhead_pct'], -1)} | {_f(e['step_s'])} | "
            f"{_f(e['stall_first_s'])} | {_f(e['stall_s'])} | {_f(e['tier0_durable_s'], 2)} | "
            f"{_f(e['disk_durable_s'], 2)} | {_f(e['s3_durable_s'], 2)} | {_f(e['close_s'], 2)} | "
            f"{_f(e['rss_extra_mib'], 0)} | {_f(e['shm_max_mib'], 0)} | {_f(e['skipped'])} | "
            f"{NOTES.get(name, '')} |")
    r, n, w = s["restore_s"], s["restore_runs"], s.get("restore_whole_s", {})
    lines += ["", f"Restore of the tiers_s3 run's newest step into a fresh model, fresh process, "
              f"page cache dropped, median of {max(n.values(), default=0)}: loading it from "
              f"memory {_f(r['memory'])} s, from the disk tier (memory removed) "
              f"{_f(r['disk'])} s, from S3 (memory and disk removed) {_f(r['s3'])} s "
              f"(`mgr.restore` whole, listing the 3 tiers included: {_f(w.get('memory'))} / "
              f"{_f(w.get('disk'))} / {_f(w.get('s3'))} s); memory "
              f"{_f(s['restore_ratio'], 1)}x faster than disk. Restores from the wrong tier "
              f"or failed: {s['restore_wrong']}.", ""]
    for engine, lost in s["lost"].items():
        lines.append(f"Steps lost, {engine} killed by SIGKILL at a random moment "
                     f"({len(lost['memory'])} runs): restored from memory {lost['memory']}, "
                     f"from the disk tier with memory lost {lost['disk']}.")
    flat = s["flat"]
    if flat:
        series = ", ".join(f"{p['save']}: {p['rss_mib']:.0f}/{p['shm_mib']:.0f}"
                           for p in flat["series"])
        lines += ["", f"{flat['saves']} saves (0.02 GB model, eager, every step, disk every "
                  f"{args.every}) in {flat['seconds']:.0f} s; RSS/tmpfs MiB after save n: "
                  f"{series}; drain skipped {flat['skipped']} steps."]
    return "\n".join(lines) + "\n"
