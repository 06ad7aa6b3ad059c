"""The redundancy benchmark's numbers: per-engine medians over repetitions, the targets of issue
27 checked against them, and the markdown of docs/BENCH_REDUNDANCY.md.

Owns: those reductions and that text. Does not own: the runs (benchmarks/redundancy.py), the
medians and the tables' markdown (benchmarks/harness.py: spread, markdown_table).
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness

__all__ = ["markdown", "summarize"]

MiB = 1 << 20
NOTES = {
    "none": "no checkpoints: the baseline",
    "off": "ckptio tiers, no redundancy: memory (`keep_last=1`) every step + disk every K, "
           "each rank its own manager (rank-local, as with redundancy)",
    "partners": "the same, memory tier `redundancy=ckptio.Partners(1)` (a full copy on the next "
                "host)",
    "partners2": "the same, `redundancy=ckptio.Partners(2)` (full copies on the next 2 hosts)",
    "parity": "the same, memory tier `redundancy=ckptio.Parity(k=3)` (XOR over groups of 3 "
              "hosts)",
    "parity2": "the same, `redundancy=ckptio.Parity(k, m=2)` (P and Q over groups of k + 2 "
               "hosts: any two lost)",
    "nvrx_clique": "NVRx 0.4.1 `LocalCheckpointManager` + `CliqueReplicationStrategy(jump = "
                   "ranks per host, factor 2)`, `save(is_async=False)` every step",
}


def _median(values: list[Any]) -> float | None:
    cell = harness.spread(values)
    return None if cell is None else cell["median"]


def _restore_of(run: dict[str, Any], what: str) -> dict[str, Any] | None:
    """The job's restore: the slowest rank's time, the step, where from; or the error."""
    found = next((r for r in run.get("restores", []) if r["what"] == what), None)
    if found is None:
        return None
    if "error" in found:
        return {"error": found["error"][-600:]}
    ranks = found["ranks"]
    bad = [r for r in ranks if not r["ok"]]
    if bad:
        return {"error": f"rank {bad[0]['rank']}: {bad[0]['error'][:300]} at {bad[0]['where']}"}
    wrong = [r["rank"] for r in ranks if r.get("last_restore", {}).get("bitwise") is False]
    if wrong:
        return {"error": f"ranks {wrong} restored other bytes than the step saved"}
    steps = {r["step"] for r in ranks}
    lost = run.get("lost", 1)
    lost_hosts = set(lost) if isinstance(lost, list) else {int(lost)}
    mine = sorted({r["source"] for r in ranks if r["host"] in lost_hosts})
    others = sorted({r["source"] for r in ranks if r["host"] not in lost_hosts})
    return {"restore_s": max(r["restore_s"] for r in ranks), "steps": sorted(steps),
            "lost": run["ranks"][0]["last_step"] - min(steps),
            "sources": [f"lost host: {'/'.join(mine)}, others: {'/'.join(others)}" if mine
                        else f"every rank: {'/'.join(others)}"]}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    runs = [r for r in result["runs"] if "error" not in r]
    base = {r["rep"]: _median([x["train_s"] for x in r["ranks"]])
            for r in runs if r["engine"] == "none"}
    out: dict[str, Any] = {}
    order = list(NOTES)
    names = sorted(dict.fromkeys(r["engine"] for r in result["runs"]),
                   key=lambda n: order.index(n) if n in order else len(order))
    for name in names:
        mine = [r for r in runs if r["engine"] == name]
        if not mine:
            failed = [r for r in result["runs"] if r["engine"] == name]
            out[name] = {"error": failed[0]["error"][-600:]}
            continue
        ranks = [x for r in mine for x in r["ranks"]]
        state = _median([x["bytes"] for x in ranks])
        nranks = sum(mine[0]["counts"])
        shm = _median([sum(r["shm_bytes"]) / nranks for r in mine])
        over = [_median([x["train_s"] for x in r["ranks"]]) / base[r["rep"]] - 1
                for r in mine if r["rep"] in base]
        row: dict[str, Any] = {
            "runs": len(mine), "state_mib": state / MiB, "overhead_pct": _pct(_median(over)),
            "step_s": _median([_median(x["step_s"][1:]) for x in ranks]),
            "call_s": _median([_median(x["call_s"][1:]) for x in ranks if x["call_s"]]),
            "protected_s": _median([_median(x["protected_s"]) for x in ranks
                                    if x.get("protected_s")]),
            "superseded": _median([_superseded(x) for x in ranks if _superseded(x) is not None]),
            "shm_mib_per_rank": shm / MiB, "x_state": shm / state if state else None,
            "rss_extra_mib": _median([x["rss_extra_mib"] for x in ranks])}
        for what in ("host_lost", "memory_lost", "fewer_hosts"):
            found = [_restore_of(r, what) for r in mine]
            found = [f for f in found if f is not None]
            if not found:
                continue
            good = [f for f in found if "error" not in f]
            row[what] = {"restore_s": _median([f["restore_s"] for f in good]),
                         "lost": max((f["lost"] for f in good), default=None),
                         "sources": sorted({s for f in good for s in f["sources"]}),
                         "errors": sorted({f["error"] for f in found if "error" in f})}
        out[name] = row
    disk = _median([f["restore_s"] for r in runs
                    for f in [_restore_of(r, "memory_lost")] if f and "error" not in f])
    out["_disk_restore_s"] = disk  # every engine's restore from the disk tier, pooled
    return out


def _superseded(rank: dict[str, Any]) -> int | None:
    """The steps this rank's protection passed over for a newer one (status()'s superseded)."""
    status = rank.get("status")
    tier = status[0] if isinstance(status, list) and status else {}
    value = tier.get("superseded") if isinstance(tier, dict) else None
    return value if isinstance(value, int) else None


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(result: dict[str, Any], command: str) -> str:
    s, c = result["summary"], result["ceilings"]
    args = result["args"]
    lines = [f"`{command}`", "",
             f"Hosts: {args['hosts']} ({result['mode']}"
             + (f"; netns not possible: {result['why_not_netns']}" if result["why_not_netns"]
                else "") + f"), ranks per host {args['ranks_per_host']}, {args['steps']} steps, "
             f"disk every {args['every']}, parity k = {args['k']}, medians over "
             f"{args['reps']} repetitions. Same-run ceilings for one rank's state "
             f"({c['bytes'] / MiB:.1f} MiB): memcpy {c['memcpy_gbps']:.2f} GB/s, XOR "
             f"{c['xor_gbps']:.2f} GB/s, disk cold read {c['disk_read_gbps']:.2f} GB/s "
             f"({c['disk_read_s']:.3f} s).", ""]
    pooled = s.get("_disk_restore_s")
    rows: list[list[str]] = []
    for name, row in s.items():
        if name.startswith("_"):
            continue
        if "error" in row:
            rows.append([name, f"failed: {row['error'][:200]!r}"])
            continue
        lost, disk = row.get("host_lost", {}), row.get("memory_lost", {})
        speed = (pooled / lost["restore_s"] if lost.get("restore_s") and pooled and
                 lost.get("sources", [""])[0].split(",")[0] != "lost host: disk" else None)
        where = "; ".join(lost.get("sources", [])) or "; ".join(lost.get("errors", []))[:300]
        rows.append([
            name, _fmt(row['overhead_pct'], '+.1f'), _fmt(row['step_s']), _fmt(row['call_s']),
            _fmt(row['protected_s']), _fmt(row.get('superseded'), 'g'),
            _fmt(row['shm_mib_per_rank'], '.1f'), _fmt(row['x_state'], '.2f'),
            _fmt(lost.get('restore_s')), where or '-', _fmt(lost.get('lost'), 'd'),
            _fmt(disk.get('restore_s')), f"{_fmt(speed, '.1f')}x", NOTES.get(name, '')])
    lines.append(harness.markdown_table(
        ["engine", "overhead %", "step s", "save call s", "protected s", "steps superseded",
         "memory MiB/rank", "x state", "restore, host lost s", "from", "steps lost",
         "restore, memory lost (disk) s", "host lost vs disk", "what"], rows, "lrrrrrrrrlrrrl"))
    lines += _fewer(s, pooled)
    lines += ["", f"Restore from the disk tier (every host's memory wiped), pooled over the "
              f"engines that measured it: {_fmt(pooled)} s; 'host lost vs disk' divides it by "
              "the engine's restore after one host lost.", "", _targets(s),
              *_two_losses(s, int(args["k"]))]
    return "\n".join(lines) + "\n"


def _fewer(s: dict[str, Any], pooled: float | None) -> list[str]:
    """The restarts on the hosts left after the loss (``--fewer-hosts``), when measured."""
    rows = [(name, row["fewer_hosts"]) for name, row in s.items()
            if not name.startswith("_") and "fewer_hosts" in row]
    if not rows:
        return []
    lines = ["", "A restart on the hosts left (one rank fewer per lost host: another rank count, "
             "every rank's state checked bitwise):", ""]
    table = []
    for name, f in rows:
        speed = pooled / f["restore_s"] if f.get("restore_s") and pooled else None
        where = "; ".join(f.get("sources", [])) or "; ".join(f.get("errors", []))[:300]
        table.append([name, _fmt(f.get("restore_s")), where or "-", _fmt(f.get("lost"), "d"),
                      _fmt(speed, ".2f")])
    return [*lines, harness.markdown_table(
        ["engine", "restore s", "from", "steps lost", "disk (same ranks) s / this"], table,
        "lrlrr")]


def _targets(s: dict[str, Any]) -> str:
    """Issue 27's targets, each met or missed, from this run's numbers."""
    par = s.get("parity", {})
    if not par or "error" in par:
        return "(no parity run: targets not checked)"
    lost = par.get("host_lost", {})
    pooled = s.get("_disk_restore_s")
    speed = pooled / lost["restore_s"] if lost.get("restore_s") and pooled else None
    checks = [("a lost host costs 0 steps (parity)", lost.get("lost"), lambda v: v == 0, "d"),
              ("parity memory <= 1.34x the state (k = 3)", par["x_state"], lambda v: v <= 1.34,
               ".2f"),
              ("overhead with parity <= 3 % (every step)", par["overhead_pct"],
               lambda v: v <= 3, "+.1f"),
              ("restore after a host loss >= 3x faster than from local disk", speed,
               lambda v: v >= 3, ".1f")]
    return _checked(["target", "measured", "met"], checks)


def _two_losses(s: dict[str, Any], k: int) -> list[str]:
    """Issue 46's targets for Parity(k, m=2), when it ran (two hosts of a group lost)."""
    two = s.get("parity2")
    if not two or "error" in two:
        return []
    lost, pooled = two.get("host_lost", {}), s.get("_disk_restore_s")
    speed = pooled / lost["restore_s"] if lost.get("restore_s") and pooled else None
    checks = [("hosts lost cost 0 steps (Parity(k, m=2))", lost.get("lost"), lambda v: v == 0,
               "d"),
              (f"two-parity memory <= 1 + 2/k = {1 + 2 / k:.2f}x the state (k = {k})",
               two["x_state"], lambda v: v <= 1 + 2 / k + 0.01, ".2f"),
              ("its restore from memory faster than from a cold disk", speed, lambda v: v > 1,
               ".2f")]
    return ["", _checked(["target (two parity pieces)", "measured", "met"], checks)]


def _checked(header: list[str], checks: list[tuple[str, Any, Any, str]]) -> str:
    """The targets' table: each one's value and whether it is met ("-": not measured)."""
    rows = [[what, _fmt(value, spec),
             "-" if value is None else ("met" if ok(value) else "**missed**")]
            for what, value, ok, spec in checks]
    return harness.markdown_table(header, rows, "lll")
