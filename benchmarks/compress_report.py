"""The compression benchmark's summary (medians over repetitions), its targets and its markdown.

Owns: turning the workers' records (compress.py) into one row per (store, engine, run, k):
stored bytes of the first checkpoint of a sequence (a full one, or the delta policy's base) and
of the later ones, the ratio logical / stored, save seconds (first, later), cold load seconds
of the last checkpoint, everything against ckptio without compression on the same store; the
ratio per tensor class from ckptio's manifests; the issue's five targets with a verdict; the
markdown of docs/BENCH_COMPRESS.md. Does not own: measuring (compress.py, compress_engines.py).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from benchmarks.compress_traj import CLASSES

__all__ = ["markdown", "summarize"]

Row = dict[str, Any]
BASE = "ckptio_off"
NOISE = 0.05  # "never slower": a median within 5 % of off's counts as not slower
MB = 1e6


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    saves, loads = defaultdict(list), defaultdict(list)
    ceilings = defaultdict(list)
    for w in result["workers"]:
        ceilings[w["store"]].append(w["ceiling"])
        for s in w["saves"]:
            saves[(w["store"], s["engine"], s["run"], s["k"])].append({**s, "rep": w["rep"]})
        for ld in w["loads"]:
            loads[(w["store"], ld["engine"], ld["run"], ld["k"])].append(ld)
    rows = [_row(key, recs, loads.get(key, [])) for key, recs in saves.items()]
    _against_base(rows)
    ceil = {store: {"write_gbs": _median([c["nbytes"] / c["write_s"] / 1e9 for c in cs]),
                    "read_gbs": _median([c["nbytes"] / c["read_s"] / 1e9 for c in cs]),
                    "nbytes": cs[0]["nbytes"], "how": cs[0]["how"]}
            for store, cs in ceilings.items()}
    summary = {"rows": rows, "ceilings": ceil}
    summary["targets"] = targets(summary, result.get("codec_speed", []))
    return summary


def _row(key: tuple[str, str, str, int], recs: list[Row], loads: list[Row]) -> Row:
    store, engine, run, k = key
    by_rep = defaultdict(list)
    for r in recs:
        by_rep[r["rep"]].append(r)
    first = [next(r for r in rs if r["i"] == 0) for rs in by_rep.values()]
    later = [[r for r in rs if r["i"] > 0] for rs in by_rep.values()]
    logical = first[0]["logical"]
    row = {"store": store, "engine": engine, "run": run, "k": k, "logical": logical,
           "first_stored": _median([r["stored"] for r in first]),
           "later_stored": _median([_mean([r["stored"] for r in rs]) for rs in later]),
           "first_save_s": _median([r["save_s"] for r in first]),
           "later_save_s": _median([_mean([r["save_s"] for r in rs]) for rs in later]),
           "load_s": _median([ld["load_s"] for ld in loads]),
           "bitwise_ok": all(ld["bitwise_ok"] for ld in loads) if loads else None,
           "cache_drop": sorted({ld["cache_drop"] for ld in loads}),
           "reps": len(by_rep)}
    row["later_ratio"] = logical / row["later_stored"]
    row["first_ratio"] = logical / row["first_stored"]
    row["later_save_gbs"] = logical / row["later_save_s"] / 1e9
    row["load_gbs"] = logical / row["load_s"] / 1e9 if row["load_s"] else None
    if recs[0]["classes"] is not None:
        row["classes_first"] = _classes([r for r in recs if r["i"] == 0])
        row["classes_later"] = _classes([r for r in recs if r["i"] > 0])
    return row


def _classes(recs: list[Row]) -> dict[str, Row]:
    out: dict[str, Row] = {}
    for r in recs:
        for cls, v in r["classes"].items():
            acc = out.setdefault(cls, {"logical": 0, "stored": 0, "ref": 0, "xor": 0,
                                       "compressed": 0})
            for field in acc:
                acc[field] += v[field]
    for v in out.values():
        v["ratio"] = v["logical"] / v["stored"] if v["stored"] else float("inf")
    return out


def _against_base(rows: list[Row]) -> None:
    base = {(r["store"], r["run"], r["k"]): r for r in rows if r["engine"] == BASE}
    for r in rows:
        b = base.get((r["store"], r["run"], r["k"]))
        if b is None:
            continue
        r["save_vs_off"] = b["later_save_s"] / r["later_save_s"]  # > 1: faster than off
        r["first_save_vs_off"] = b["first_save_s"] / r["first_save_s"]
        r["load_vs_off"] = b["load_s"] / r["load_s"] if r["load_s"] and b["load_s"] else None
        r["fewer_bytes_than_full"] = b["first_stored"] / r["later_stored"]


# ------------------------------------------------------------------------------ targets


def targets(summary: dict[str, Any], speed: list[Row]) -> list[Row]:
    rows = summary["rows"]
    pick = {(r["store"], r["engine"], r["run"], r["k"]): r for r in rows}
    out = [_auto_target(rows), _s3_target(rows), _frozen_target(rows), _xor_target(pick),
           _full_state_target(rows, speed)]
    return [t for t in out if t is not None]


def _verdict(name: str, measured: str, met: bool | None, why: str = "") -> Row:
    return {"target": name, "measured": measured, "met": met, "why": why}


def _auto_target(rows: list[Row]) -> Row | None:
    auto = [r for r in rows if r["engine"] == "ckptio_auto" and "save_vs_off" in r]
    if not auto:
        return None
    parts, worst = [], 10.0
    for store in sorted({r["store"] for r in auto}):
        mine = [r for r in auto if r["store"] == store]
        ratios = [x for r in mine for x in (r["save_vs_off"], r["first_save_vs_off"],
                                            r["load_vs_off"]) if x is not None]
        worst = min(worst, min(ratios))
        parts.append(f"{store}: slowest save/load at {min(ratios):.2f}x off's speed")
    return _verdict("`auto` never slower than `off` on any store (save and cold load; within "
                    f"{NOISE:.0%} noise)", "; ".join(parts), worst >= 1 - NOISE)


def _s3_target(rows: list[Row]) -> Row | None:
    mine = [r for r in rows if r["store"] == "s3" and r["run"] == "full" and "save_vs_off" in r
            and r["engine"] != BASE]
    if not mine:
        return None
    best: dict[str, float] = {}
    for r in mine:
        best[r["engine"]] = min(best.get(r["engine"], 10.0), r["save_vs_off"])
    text = ", ".join(f"{e} {v:.2f}x" for e, v in sorted(best.items()))
    return _verdict("object store: effective (logical) save rate >= 1.3x uncompressed (full "
                    "run, later checkpoints, worst k)", text, max(best.values()) >= 1.3)


DELTA_ENGINES = ("ckptio_delta", "ckptio_base")  # the manager's policy, else save(base=)


def _frozen_target(rows: list[Row]) -> Row | None:
    for engine in DELTA_ENGINES:
        mine = [r for r in rows if r["run"] == "lora" and r["engine"] == engine
                and "fewer_bytes_than_full" in r]
        if mine:
            break
    else:
        return None
    worst = min(r["fewer_bytes_than_full"] for r in mine)
    text = ", ".join(f"{r['store']} k={r['k']}: {r['fewer_bytes_than_full']:.1f}x"
                     for r in sorted(mine, key=lambda r: (r["store"], r["k"])))
    return _verdict("frozen base (LoRA): >= 20x fewer bytes per checkpoint than full saves "
                    f"({engine}'s later checkpoints vs ckptio_off's)", text, worst >= 20)


def _xor_target(pick: dict[tuple[str, str, str, int], Row]) -> Row | None:
    for engine in DELTA_ENGINES:
        r = pick.get(("local", engine, "full", 1)) or pick.get(("s3", engine, "full", 1))
        if r is not None and "weights" in r.get("classes_later", {}):
            break
    else:
        return None
    w = r["classes_later"]["weights"]
    return _verdict(f"k=1 bf16-weight deltas >= 4x (logical / stored, {engine})",
                    f"{w['ratio']:.2f}x ({w['xor']} XOR, {w['ref']} referenced, "
                    f"{w['compressed']} compressed entries)", w["ratio"] >= 4)


def _full_state_target(rows: list[Row], speed: list[Row]) -> Row | None:
    codec = [r for r in rows if r["engine"] == "ckptio_codec" and r["run"] == "full"
             and r["store"] == "local"]
    two = [s for s in speed if s["threads"] == 2 and s["data"] == "state"]
    if not codec:
        return None
    ratio = _median([r["first_ratio"] for r in codec])
    gbs = (sum(s["logical"] for s in two) / sum(s["logical"] / s["compress_gbs"] for s in two)
           if two else None)
    text = f"ratio {ratio:.3f}x" + (f", compress {gbs:.2f} GB/s on 2 threads" if gbs else "")
    return _verdict("full-state compression >= 1.27x at >= 1 GB/s on 2 cores", text,
                    ratio >= 1.27 and gbs is not None and gbs >= 1.0)


# ------------------------------------------------------------------------------ markdown


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    a = result["args"]
    lines = [f"Command: `{result['command']}`", ""]
    for run, info in result["runs"].items():
        lines.append(f"- run `{run}`: {info['params']:,} parameters ({info['trainable']:,} "
                     f"trainable), peak lr {info['lr']}, loss {info['loss_first']} -> "
                     f"{info['loss_last']}" + (f", over a base trained {info['base_steps']} "
                                               "steps, frozen" if run == "lora" else ""))
    lines.append("- checkpoint steps per k: " + "; ".join(
        f"k={k}: {steps}" for k, steps in result["schedules"].items()))
    lines.append(f"- codec of ckptio_codec / ckptio_delta: `{a['codec']}`; repetitions: "
                 f"{a['reps']} (medians)")
    for what, why in result["skipped"].items():
        lines.append(f"- not run: {what}: {why}")
    lines += ["", "### Targets", "", "| target | measured | met |", "|---|---|---|"]
    for t in s["targets"]:
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        lines.append(f"| {t['target']} | {t['measured']} | {met} |")
    for store in sorted({r["store"] for r in s["rows"]}):
        lines += _store_table(s, store)
    lines += _class_table(s["rows"])
    lines += _speed_table(result.get("codec_speed", []))
    return "\n".join(lines) + "\n"


def _store_table(s: dict[str, Any], store: str) -> list[str]:
    c = s["ceilings"].get(store, {})
    out = ["", f"### {store}: per checkpoint (MB are 1e6 bytes; later = the checkpoints after "
           "a sequence's first)", "",
           "| run | k | engine | logical MB | stored MB first / later | ratio later | save s "
           "first / later | save GB/s later (logical) | vs off | cold load s (last) | load "
           "GB/s | bitwise |", "|---" * 12 + "|"]
    rows = sorted((r for r in s["rows"] if r["store"] == store),
                  key=lambda r: (r["run"], r["k"], r["engine"]))
    for r in rows:
        out.append(
            f"| {r['run']} | {r['k']} | {r['engine']} | {r['logical'] / MB:.1f} | "
            f"{r['first_stored'] / MB:.2f} / {r['later_stored'] / MB:.2f} | "
            f"{r['later_ratio']:.2f}x | {r['first_save_s']:.3f} / {r['later_save_s']:.3f} | "
            f"{r['later_save_gbs']:.2f} | {_f(r.get('save_vs_off'))}x | {_f(r['load_s'], '.3f')}"
            f" | {_f(r['load_gbs'])} | {'ok' if r['bitwise_ok'] else 'FAIL'} |")
    if c:
        out.append(f"| ceiling | - | raw ({c['how']}) | {c['nbytes'] / MB:.1f} | - | - | - | "
                   f"{c['write_gbs']:.2f} | - | - | {c['read_gbs']:.2f} | - |")
    return out


def _class_table(rows: list[Row]) -> list[str]:
    mine = sorted((r for r in rows if "classes_later" in r and r["store"] == "local"),
                  key=lambda r: (r["run"], r["k"], r["engine"]))
    if not mine:
        return []
    out = ["", "### Ratio per tensor class (local store; logical / stored over the later "
           "checkpoints; in brackets: entries referenced / XOR-coded / compressed)", "",
           "| run | k | engine | " + " | ".join(CLASSES) + " |", "|---" * (3 + len(CLASSES))
           + "|"]
    for r in mine:
        cells = []
        for cls in CLASSES:
            v = r["classes_later"].get(cls)
            cells.append("-" if v is None else f"{v['ratio']:.2f}x ({v['ref']}/{v['xor']}/"
                         f"{v['compressed']})")
        out.append(f"| {r['run']} | {r['k']} | {r['engine']} | " + " | ".join(cells) + " |")
    return out


def _speed_table(speed: list[Row]) -> list[str]:
    if not speed:
        return []
    out = ["", f"### Codec speed ({speed[0]['codec']}, independent 1 MiB frames, median of the "
           "repetitions)", "", "| data | class | ratio | compress GB/s 1 thread / 2 | "
           "decompress GB/s 1 thread / 2 |", "|---|---|---|---|---|"]
    for data in dict.fromkeys(s["data"] for s in speed):
        for cls in CLASSES:
            one = next((s for s in speed if s["data"] == data and s["class"] == cls
                        and s["threads"] == 1), None)
            two = next((s for s in speed if s["data"] == data and s["class"] == cls
                        and s["threads"] == 2), None)
            if one and two:
                out.append(f"| {data} | {cls} | {one['logical'] / one['stored']:.2f}x | "
                           f"{one['compress_gbs']:.2f} / {two['compress_gbs']:.2f} | "
                           f"{one['decompress_gbs']:.2f} / {two['decompress_gbs']:.2f} |")
    return out
