"""Markdown tables of the GPU benchmark (docs/BENCH_GPU.md): device-to-host staging, the training
loop's stall and overhead, cold loads into CUDA tensors. Medians over repetitions; ratios against
the same run's ceilings and the ``none`` engine. Owns nothing but the arithmetic and the text."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.gpu_phases import blocked

Run = dict[str, Any]
GB = 1e9


def med(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(report: Run) -> str:
    env, runs = report["env"], report["runs"]
    lines = [f"Run of {env['date']}: {env.get('gpu', 'no GPU')} (driver, PCIe gen, width: "
             f"{env.get('driver_pcie', '-')}), torch {env['torch']}, CUDA {env['cuda']}, "
             f"Python {env['python']}, {env['cpus']} CPUs.", ""]
    errors = [r for r in runs if "error" in r]
    for r in errors:
        lines.append(f"- **{r['worker']} {r['engine']} rep {r['rep']} failed**: "
                     f"`{r['error'].strip().splitlines()[-1][:300]}`")
    skipped = next((r["reasons"] for r in runs if r["worker"] == "skipped"), {})
    lines += [f"- {name} not run: {why}" for name, why in skipped.items()]
    ok = [r for r in runs if "error" not in r]
    d2h = next((r for r in ok if r["worker"] == "d2h"), None)
    if d2h:
        lines += ["", *d2h_table(d2h)]
    for every in (10, 1):
        train = [r for r in ok if r["worker"] == "train" and r["every"] == every]
        if train:
            lines += ["", *train_table(train, every)]
        if train and every == 1:
            lines += ["", *steady_table(train)]
    loads = [r for r in ok if r["worker"] in ("load", "load-setup")]
    if loads:
        lines += ["", *load_table(loads)]
    return "\n".join(lines) + "\n"


def d2h_table(r: Run) -> list[str]:
    n, ceiling = r["bytes"], r["ceiling_pinned_gbps"]
    rows = [("copy of 1 GiB into torch-pinned memory (the ceiling)", None, ceiling),
            ("copy of 1 GiB into an mmap registered with cudaHostRegister (ckptio's pool kind)",
             None, r["ceiling_registered_gbps"])]
    for label, key in (("ckptio `async_save` call, eager (returns once captured)", "ckptio_call_s"),
                       ("ckptio capture_s (plan + copies, from its result)", "ckptio_capture_s"),
                       ("ckptio capture_s into a memory tier's registered tmpfs pages "
                        "(the mapped save, ring warm)", "tier_capture_s"),
                       ("DCP `DefaultStager(StagingOptions()).stage` until staged", "dcp_stage_s"),
                       ("DataStates-LLM `async_save` + `wait()` (its D2H copies)",
                        "datastates_copy_s")):
        if r.get(key):
            s = med(r[key])
            rows.append((label, s, n / GB / s))
    out = [f"### Device to host: {n / GB:.2f} GB of training state (medians after warm-up)",
           "", "| what | seconds | GB/s | of the pinned-copy ceiling |", "|---|---|---|---|"]
    out += [f"| {label} | {fmt(s)} | {gbps:.1f} | {100 * gbps / ceiling:.0f} % |"
            for label, s, gbps in rows]
    out.append(f"\nckptio's pinned pool: {r['ckptio_pinned_bytes'] / GB:.2f} GB.")
    return out


def _train_s(run: Run) -> float:
    steps = sum(s["step_s"] for s in run["steps"])
    return steps + sum(c["call_s"] + c.get("wait_after_s", 0.0) for c in run["checkpoints"])


def train_table(runs: list[Run], every: int) -> list[str]:
    engines = list(dict.fromkeys(r["engine"] for r in runs))
    base = med([_train_s(r) for r in runs if r["engine"] == "none"])
    step = med([s["step_s"] for r in runs if r["engine"] == "none" for s in r["steps"]])
    where = "to local disk, durable (fsync)" if every == 10 else "to /dev/shm (memory speed)"
    out = [f"### Checkpoint every {every} step{'s' if every > 1 else ''}, {where}", "",
           f"Baseline step (no checkpoints): {fmt(step)} s. Blocked = the save call + waiting for "
           "the previous save + what the next optimizer step took beyond its median before any "
           "checkpoint. Medians over checkpoints and repetitions.", "",
           "| engine | overhead | blocked, first | blocked, later | later, of a step "
           "| durable, first | durable, later | pinned GB | bitwise |", "|---|---|---|---|---|---|---|---|---|"]
    for engine in engines:
        mine = [r for r in runs if r["engine"] == engine]
        if engine == "none":
            continue
        over = med([_train_s(r) for r in mine])
        firsts = [blocked(r)[0] for r in mine if r["checkpoints"]]
        later = [b for r in mine for b in blocked(r)[1:]]
        dur_first = [r["checkpoints"][0].get("persist_s") for r in mine if r["checkpoints"]]
        dur_later = [c.get("persist_s") for r in mine for c in r["checkpoints"][1:]]
        later_med = med(later)
        out.append(
            f"| {engine} | {fmt(100 * (over / base - 1) if over and base else None, 1)} % "
            f"| {fmt(med(firsts))} | {fmt(later_med)} "
            f"| {fmt(100 * later_med / step if later_med is not None and step else None, 1)} % "
            f"| {fmt(med(dur_first), 2)} | {fmt(med(dur_later), 2)} "
            f"| {fmt(med([r.get('pinned_bytes', 0) / GB for r in mine]), 2)} "
            f"| {all(r.get('bitwise_ok') for r in mine)} |")
    return out


STEADY_FROM = 6  # a memory tier's ring (keep_last=2): 3 saves through the pool, 3 first mappings
WAITED_S = 0.01  # a save "waited" for the previous one longer than this


def _steps_from(run: Run, first: int) -> float:
    """Seconds of the steps from ``first`` (1-based) on, with the save calls and waits there."""
    steps = sum(s["step_s"] for s in run["steps"][first - 1:])
    return steps + sum(c["call_s"] + c.get("wait_after_s", 0.0) for c in run["checkpoints"]
                       if c["step"] >= first)


def steady_table(runs: list[Run]) -> list[str]:
    """Every-step runs once the ring is warm: from the step after the STEADY_FROM-th save on."""
    first = STEADY_FROM + 3 + 1  # saves begin at step 3
    if not any(c["step"] >= first for r in runs for c in r["checkpoints"]):
        return []
    base = med([_steps_from(r, first) for r in runs if r["engine"] == "none"])
    out = [f"Past the warm-up (steps {first} on: with no slots made ahead, a memory tier's "
           f"first {STEADY_FROM} saves go through the pool, then map each slot of its ring "
           "once):", "",
           f"| engine | overhead | blocked, median | blocked, 90th pct | waited > {WAITED_S} s "
           "| durable, median |", "|---|---|---|---|---|---|"]
    for engine in dict.fromkeys(r["engine"] for r in runs if r["engine"] != "none"):
        mine = [r for r in runs if r["engine"] == engine]
        over = med([_steps_from(r, first) for r in mine])
        late = [(b, c) for r in mine for b, c in zip(blocked(r), r["checkpoints"])
                if c["step"] >= first]
        times = sorted(b for b, _ in late)
        waited = sum(1 for _, c in late if c.get("wait_after_s", 0.0) > WAITED_S)
        p90 = times[min(len(times) - 1, int(0.9 * len(times)))] if times else None
        out.append(f"| {engine} | {fmt(100 * (over / base - 1) if over and base else None, 1)} % "
                   f"| {fmt(med(times))} | {fmt(p90)} | {waited} of {len(late)} "
                   f"| {fmt(med([c.get('persist_s') for _, c in late]), 2)} |")
    return out


def load_table(runs: list[Run]) -> list[str]:
    setup = next((r for r in runs if r["worker"] == "load-setup"), None)
    if setup is None:
        return []
    n = setup["bytes"]
    ceil = [r for r in runs if r["engine"] == "ceiling"]
    ceiling = med([r["bytes"] / GB / r["read_s"] for r in ceil]) if ceil else None
    out = [f"### Cold loads of {n / GB:.2f} GB into the trainer's CUDA tensors (page cache dropped)",
           "", f"O_DIRECT read ceiling of the same bytes: {fmt(ceiling, 2)} GB/s "
           f"(write: {fmt(med([r['bytes'] / GB / r['write_s'] for r in ceil]), 2)} GB/s).", "",
           "| engine | seconds | GB/s | of the read ceiling | bitwise | on the device |",
           "|---|---|---|---|---|---|"]
    for engine in dict.fromkeys(r["engine"] for r in runs if r["worker"] == "load"):
        if engine == "ceiling":
            continue
        mine = [r for r in runs if r["engine"] == engine and r["worker"] == "load"]
        s = med([r["load_s"] for r in mine])
        gbps = n / GB / s if s else None
        out.append(f"| {engine} | {fmt(s)} | {fmt(gbps, 2)} "
                   f"| {fmt(100 * gbps / ceiling if gbps and ceiling else None, 0)} % "
                   f"| {all(r['digest'] == setup['digest'] for r in mine)} "
                   f"| {all(r['on_device'] for r in mine)} |")
    return out
