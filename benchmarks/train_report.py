"""Reports of the training benchmark: progress lines, the summary, markdown and JSON-ready rows.

Owns: the progress line of each run, the baseline step time (the 'none' engine), every
checkpoint's T_block, the iteration overhead, the medians over repetitions per engine, the eager
target, and the markdown table and notes. Does not own: the training loop, the workers, the
schedule of checkpoints or the command line (train.py), or the engines (train_engines.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import shown_path

Run = dict[str, Any]
BASELINE = "none"
EAGER_X_MEMCPY = 1.5  # issue 15: eager T_block <= 1.5 x the state's memcpy time
LAZY_T_BLOCK_S = 0.020  # issue 15: lazy T_block <= 20 ms


# ---------------------------------------------------------------- progress


def checkpoint_steps(steps: int, every: int) -> list[int]:
    """Every K-th step but the last: each checkpoint is followed by steps it can overlap."""
    return list(range(every, steps, every))


def progress(run: Run, index: int, total: int) -> str:
    head = f"[{index}/{total} rep {run['rep'] + 1}] {run['engine']}:"
    if "error" in run:
        return f"{head} FAILED {run['error']}"
    calls = ", ".join(f"{c['call_s']:.3f}" for c in run["checkpoints"]) or "-"
    persist = ", ".join(f"{c['persist_s']:.2f}" for c in run["checkpoints"]) or "-"
    return (f"{head} step median {statistics.median(run['step_s']):.3f} s, "
            f"train {run['train_s']:.1f} s, "
            f"save calls [{calls}] s, persist [{persist}] s, RSS+ {run['rss_extra_mib']:.0f} MiB, "
            f"bitwise {'ok' if run['bitwise_ok'] else 'MISMATCH'} (wall {run['wall_s']:.1f} s)")


# ---------------------------------------------------------------- summary


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def baselines(runs: list[Run]) -> dict[int, float]:
    """Per repetition: the median step time of the 'none' run, the first (warm-up) step left out."""
    return {r["rep"]: statistics.median(r["step_s"][1:]) for r in runs
            if r["engine"] == BASELINE and "error" not in r}


def annotate(runs: list[Run]) -> None:
    """Add to each run its baseline, every checkpoint's T_block and the iteration overhead."""
    from benchmarks.train_engines import ENGINES

    base = baselines(runs)
    train = {r["rep"]: r["train_s"] for r in runs if r["engine"] == BASELINE and "error" not in r}
    for r in (r for r in runs if "error" not in r):
        r["base_step_s"], r["base_from"] = base_for(r, base)
        r["overhead_pct"] = (100 * (r["train_s"] / train[r["rep"]] - 1) if r["rep"] in train
                             else None)
        ends = [c["step"] for c in r["checkpoints"][1:]] + [len(r["step_s"])]
        for c, end in zip(r["checkpoints"], ends):
            c["t_block_s"] = t_block(c, r["step_s"][c["step"] : end], r["base_step_s"],
                                     ENGINES[r["engine"]].is_async)


def base_for(r: Run, base: dict[int, float]) -> tuple[float | None, str]:
    if r["rep"] in base:
        return base[r["rep"]], "none, same rep"
    if base:
        return median(list(base.values())), "none, other reps"
    first = r["checkpoints"][0]["step"] if r["checkpoints"] else len(r["step_s"])
    return median(r["step_s"][1:first]), "own steps before the first checkpoint"


def t_block(c: dict[str, Any], following: list[float], base: float | None, is_async: bool) -> float:
    """Save call + wait for durability before the next save + (async engines) the time the
    steps up to the next checkpoint took beyond the baseline median step, floored at 0."""
    extra = max(0.0, sum(s - base for s in following)) if is_async and base is not None else 0.0
    return c["call_s"] + c.get("wait_after_s", 0.0) + extra


def first_and_rest(runs: list[Run], get: Callable[[dict[str, Any]], float | None]
                   ) -> tuple[float | None, float | None]:
    """(median over runs of the first checkpoint's value, median over runs of the median of the
    later checkpoints' values)."""
    firsts = [v for r in runs if r["checkpoints"] and (v := get(r["checkpoints"][0])) is not None]
    rests = [median(vs) for r in runs
             if (vs := [v for c in r["checkpoints"][1:] if (v := get(c)) is not None])]
    return median(firsts), median([v for v in rests if v is not None])


def steady_t_block(r: Run) -> float:
    """The median T_block of the later checkpoints (the first one's when there is only one)."""
    values = [c["t_block_s"] for c in r["checkpoints"]]
    return statistics.median(values[1:] or values)


def summarize_engine(name: str, runs: list[Run]) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    row: dict[str, Any] = {"engine": name, "runs": len(runs), "failed": len(runs) - len(good)}
    for key, get in (("t_block", lambda c: c["t_block_s"]), ("call", lambda c: c["call_s"]),
                     ("persist", lambda c: c["persist_s"]),
                     ("blocked", lambda c: c.get("reported", {}).get("blocked_s"))):
        row[f"{key}_first_s"], row[f"{key}_s"] = first_and_rest(good, get)

    def med(key: str) -> float | None:
        return median([r[key] for r in good if r.get(key) is not None])

    for key in ("base_step_s", "overhead_pct", "rss_extra_mib", "rss_over_train_peak_mib",
                "helper_hwm_mib", "memcpy_gbps", "load_s", "train_s"):
        row[key] = med(key)
    row["step_s"] = median([statistics.median(r["step_s"][1:]) for r in good])
    row["t_block_x_memcpy"] = median([steady_t_block(r) / (r["bytes"] / 1e9 / r["memcpy_gbps"])
                                      for r in good if r["checkpoints"]])
    row["bitwise_ok"] = bool(good) and all(r["bitwise_ok"] for r in good)
    return row


def summarize(runs: list[Run], names: list[str], skipped: dict[str, str]) -> dict[str, Any]:
    good = [r for r in runs if "error" not in r]
    nbytes = good[0]["bytes"] if good else None
    bw = median([r["memcpy_gbps"] for r in good])
    memcpy_s = nbytes / 1e9 / bw if nbytes and bw else None
    rows = [summarize_engine(n, [r for r in runs if r["engine"] == n]) for n in names]
    eager = next((r for r in rows if r["engine"] == "ckptio_eager"), None)
    target = None
    if eager and memcpy_s and (tb := eager["t_block_s"] or eager["t_block_first_s"]) is not None:
        target = {"t_block_s": tb, "limit_s": EAGER_X_MEMCPY * memcpy_s,
                  "met": tb <= EAGER_X_MEMCPY * memcpy_s}
    lazy = next((r for r in rows if r["engine"] == "ckptio_lazy"), None)
    if lazy and (tb := lazy["t_block_s"] or lazy["t_block_first_s"]) is not None:
        target = dict(target or {}, lazy_t_block_s=tb, lazy_met=tb <= LAZY_T_BLOCK_S)
    model = {k: good[0][k] for k in ("d_model", "layers", "vocab", "params")} if good else {}
    pool = next((r["pool_bytes"] for r in good if r.get("pool_bytes")), None)
    staging = max((r.get("staging_bytes") or 0 for r in good), default=0) or None
    return {"bytes": nbytes, "memcpy_gbps": bw, "memcpy_s": memcpy_s, "targets": target,
            "rows": rows, "unavailable": skipped, "model": model, "pool_bytes": pool,
            "staging_bytes": staging}


# ---------------------------------------------------------------- markdown

HEADER = ("| engine | T_block 1st s | T_block s | blocked_s (self) | save call s | T_persist 1st s "
          "| T_persist s | overhead % | step s | RSS+ MiB | RSS+ over train peak MiB | helper RSS MiB "
          "| T_block / memcpy | load s | bitwise |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def table_row(r: dict[str, Any]) -> str:
    ok = (f"FAILED ({r['failed']} run(s) failed; see the log)" if r["failed"]
          else "ok" if r["bitwise_ok"] else "MISMATCH")
    self_count = (r["blocked_first_s"], r["blocked_s"])
    blocked = " / ".join(map(fmt, self_count)) if self_count != (None, None) else "-"
    cells = [r["engine"], fmt(r["t_block_first_s"]), fmt(r["t_block_s"]), blocked, fmt(r["call_s"]),
             fmt(r["persist_first_s"], ".2f"), fmt(r["persist_s"], ".2f"),
             fmt(r["overhead_pct"], "+.1f"), fmt(r["step_s"]), fmt(r["rss_extra_mib"], ".0f"),
             fmt(r["rss_over_train_peak_mib"], ".0f"), fmt(r["helper_hwm_mib"], ".0f"),
             fmt(r["t_block_x_memcpy"], ".2f"), fmt(r["load_s"], ".2f"), ok]
    return "| " + " | ".join(cells) + " |"


def markdown(summary: dict[str, Any], args: argparse.Namespace, command: str) -> str:
    from benchmarks.train_engines import ENGINES

    s, m, pool = summary["bytes"] or 0, summary["model"], summary["pool_bytes"]
    staging = summary.get("staging_bytes")
    pool_note = (f"{pool / 1e6:,.0f} MB, fixed (--pool-gb)" if pool else
                 "default options (256 MiB, grown by the first async save"
                 + (f" to {staging / 1e6:,.0f} MB" if staging else "") + ")")
    lines = [
        "## Checkpointing during training", "", f"`{command}`  ",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"dir `{shown_path(args.dir)}`, {args.reps} reps, one fresh process per engine and rep; "
        "medians over reps  ",
        f"model: GPT d_model {m.get('d_model')}, {m.get('layers')} blocks, vocab {m.get('vocab')}, "
        f"{m.get('params', 0) / 1e6:.1f} M params, fused AdamW; S = {s:,} bytes; {args.steps} steps "
        f"of {args.batch} x {args.seq} random tokens; checkpoint after steps "
        f"{checkpoint_steps(args.steps, args.every)}  ",
        f"memcpy (S bytes into pre-faulted memory, best of 3): {fmt(summary['memcpy_gbps'], '.2f')} "
        f"GB/s, S / memcpy = {fmt(summary['memcpy_s'])} s; ckptio pool: {pool_note}", "",
        HEADER, *[table_row(r) for r in summary["rows"]], ""]
    if (t := summary["targets"]) is not None and "limit_s" in t:
        lines.append(f"- target eager T_block <= {EAGER_X_MEMCPY} x S / memcpy = {t['limit_s']:.3f} s: "
                     f"{t['t_block_s']:.3f} s, {'met' if t['met'] else 'NOT met'}")
    if t is not None and "lazy_t_block_s" in t:
        lines.append(f"- target lazy T_block <= {LAZY_T_BLOCK_S * 1000:.0f} ms: "
                     f"{t['lazy_t_block_s'] * 1000:.0f} ms, {'met' if t['lazy_met'] else 'NOT met'}")
    lines += [f"- {name}: unavailable: {why}" for name, why in summary["unavailable"].items()]
    lines += [f"- {r['engine']}: {ENGINES[r['engine']].note}" for r in summary["rows"]]
    lines += ["- T_block: save call + wait for it to be durable before the next save + for async "
              "engines the steps up to the next checkpoint beyond the baseline median step "
              "(floored at 0); 1st = first checkpoint, else median of the later ones; see "
              "docs/BENCH_TRAIN.md. blocked_s: ckptio's own count (first / later). overhead: "
              "training wall time / the none run's of the same rep - 1. RSS+: peak VmHWM minus "
              "VmRSS before the first checkpoint; over train peak: minus the loop's own peak", ""]
    return "\n".join(lines)
