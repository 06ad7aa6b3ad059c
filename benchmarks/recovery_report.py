"""The recovery benchmark's phases and report (benchmarks/recovery.py): from the events the
agents (recovery_agent.py) and the workers (recovery_worker.py) wrote, each run's time line from
the kill to the first step completed after the resume, cut into phases at boundaries that are
each the moment the LAST rank or agent passed it (so the phases add up to the total):

    detection   the kill -> every surviving agent has seen it (its workers failed, or new nodes
                waiting at the rendezvous)
    relaunch    -> every host's agent (the replacement's included) has begun its rendezvous
    rendezvous  -> every new worker has its process group (agents' rendezvous, workers spawned,
                torch imported, init_process_group)
    build       -> every worker has built its model and optimizer (the job's own code)
    restore     -> every worker has restored (the source's manager made, then its restore)
    first step  -> every worker has completed its first step after the resume

Without a relaunch (``--restart inprocess``, recovery_inproc.py) the phases are: detection (the
kill -> every survivor's collective failed), re-form (-> every rank, the spare's included, has
the next generation's process group: the old manager closed, the group destroyed, the check-in,
the spare told, init_process_group), restore (-> every rank restored: a new manager made, its
restore), first step.

Owns: the phases, the checks (bitwise against the reference, restored from a checkpoint), the
targets and the markdown. Does not own: running anything, the medians and the tables' markdown
(benchmarks/harness.py: spread, markdown_table).
"""

from __future__ import annotations

from typing import Any

from benchmarks import harness

PHASES = ("detection", "relaunch", "rendezvous", "build", "restore", "first_step")
PHASES_INPROCESS = ("detection", "reform", "restore", "first_step")
DETECT = ("workers_failed", "nodes_waiting", "restart_workers_begin")
TOTAL_S, RESTORE_SHARE = 10.0, 0.20  # issue 66's targets


def _first(events: list[dict[str, Any]], name: str | tuple[str, ...], after: float) -> float | None:
    names = (name,) if isinstance(name, str) else name
    return next((e["t"] for e in events if e["ev"] in names and e["t"] >= after), None)


def _by(events: list[dict[str, Any]], kind: str, key: str) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e["kind"] == kind:
            out.setdefault(e[key], []).append(e)
    return out


def timeline(run: dict[str, Any], reference: list[str]) -> dict[str, Any]:
    """One run's boundaries, phases, per-rank restores and checks (module doc)."""
    out: dict[str, Any] = {"source": run["source"], "rep": run["rep"], "ok": False}
    if "t_kill" not in run:
        out["why"] = run.get("error", "no kill")
        return out
    tk, events, cfg = run["t_kill"], run["events"], run["cfg"]
    if cfg.get("restart") == "inprocess":
        return _inprocess(run, reference, out)
    victim = str(run.get("victim", 1))
    agents = _by(events, "a", "pid")
    old = [evs for evs in agents.values() if evs[0]["t"] < tk]
    survivors = [evs for evs in old if cfg["kill"] == "rank" or evs[0]["host"] != victim]
    current = [evs for evs in agents.values() if evs[-1]["ev"] == "agent_exit"] or \
        list(agents.values())
    workers = _last_workers([evs for evs in _by(events, "w", "pid").values() if evs[0]["t"] > tk])
    bounds: dict[str, float | None] = {}
    seen = [_first(evs, DETECT, tk) for evs in survivors]
    bounds["detection"] = max(seen) if seen and None not in seen else None  # type: ignore[type-var]
    began = [_first(evs, "rendezvous_begin", tk) for evs in current]
    bounds["relaunch"] = max(began) if began and None not in began else None  # type: ignore[type-var]
    for phase, ev in (("rendezvous", "pg"), ("build", "built"), ("restore", "restored")):
        times = [_first(evs, ev, tk) for evs in workers]
        bounds[phase] = max(times) if workers and None not in times else None  # type: ignore[type-var]
    firsts = []
    for evs in workers:
        restored = _first(evs, "restored", tk)
        firsts.append(None if restored is None else _first(evs, "step", restored))
    bounds["first_step"] = max(firsts) if workers and None not in firsts else None  # type: ignore[type-var]
    out["bounds"] = {k: None if v is None else v - tk for k, v in bounds.items()}
    out["phases"] = _phases(bounds, tk)
    out["total_s"] = None if bounds["first_step"] is None else bounds["first_step"] - tk
    out["detail"] = _detail(events, tk, workers, current)
    out.update(_restores(workers))
    out.update(_checks(run, reference, out))
    return out


def phases_of(cfg: dict[str, Any]) -> tuple[str, ...]:
    return PHASES_INPROCESS if cfg.get("restart") == "inprocess" else PHASES


def _inprocess(run: dict[str, Any], reference: list[str], out: dict[str, Any]) -> dict[str, Any]:
    """timeline() of a run without a relaunch (module doc): the survivors' and the spare's
    processes (each rank's last), no agents."""
    tk = run["t_kill"]
    workers = [evs for evs in _by(run["events"], "w", "pid").values() if evs[-1]["t"] > tk]
    survivors = [evs for evs in workers if evs[0]["rank"] >= 0]  # the spare starts as -1
    bounds: dict[str, float | None] = {}
    for phase, ev, group in (("detection", "failed", survivors), ("reform", "pg", workers),
                             ("restore", "restored", workers)):
        times = [_first(evs, ev, tk) for evs in group]
        bounds[phase] = max(times) if group and None not in times else None  # type: ignore[type-var]
    firsts = [_first(evs, "step", r) if (r := _first(evs, "restored", tk)) else None
              for evs in workers]
    bounds["first_step"] = max(firsts) if workers and None not in firsts else None  # type: ignore[type-var]
    out["bounds"] = {k: None if v is None else v - tk for k, v in bounds.items()}
    out["phases"] = _phases(bounds, tk, PHASES_INPROCESS)
    out["total_s"] = None if bounds["first_step"] is None else bounds["first_step"] - tk
    torn = [_first(evs, "torn_down", tk) for evs in survivors]
    told = [_first(evs, "assigned", tk) for evs in workers if evs[0]["rank"] < 0]
    out["detail"] = {"torn_down": None if not torn or None in torn else max(torn) - tk,  # type: ignore[type-var,operator]
                     "spare_told": None if not told or None in told else max(told) - tk}  # type: ignore[type-var,operator]
    out.update(_restores(sorted(workers, key=lambda evs: evs[-1]["rank"]), start="pg"))
    out.update(_checks(run, reference, out))
    return out


def _last_workers(procs: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Per rank, the worker process that finished the job (else the last one started)."""
    best: dict[int, list[dict[str, Any]]] = {}
    for evs in sorted(procs, key=lambda evs: (evs[-1]["ev"] == "final", evs[0]["t"])):
        best[evs[0]["rank"]] = evs
    return [best[r] for r in sorted(best)]


def _phases(bounds: dict[str, float | None], tk: float,
            names: tuple[str, ...] = PHASES) -> dict[str, float | None]:
    phases: dict[str, float | None] = {}
    last: float | None = tk
    for name in names:
        now = bounds[name]
        phases[name] = None if now is None or last is None else now - last
        last = now
    return phases


def _detail(events: list[dict[str, Any]], tk: float, workers: list[list[dict[str, Any]]],
            current: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """Moments inside the phases, each from the kill: the first error a surviving worker
    wrote, the replacement agent up, the agents' rendezvous done and workers spawned (last),
    the new workers' processes up and torch imported (last)."""
    def last(groups: list[list[dict[str, Any]]], ev: str) -> float | None:
        times = [_first(evs, ev, tk) for evs in groups]
        return None if not times or None in times else max(times) - tk  # type: ignore[type-var,operator]

    error = _first([e for e in events if e["kind"] == "w"], "error", tk)
    started = [evs for evs in current if evs[0]["t"] > tk]
    return {"worker_error": None if error is None else error - tk,
            "replacement_agent_ready": last(started, "agent_ready") if started else None,
            "agents_rendezvous_done": last(current, "rendezvous_end"),
            "workers_spawned": last(current, "start_workers_end"),
            "workers_up": last(workers, "start"), "torch_imported": last(workers, "imported")}


def _restores(workers: list[list[dict[str, Any]]], start: str = "built") -> dict[str, Any]:
    """Per rank: the step and source restored, the restore's seconds (manager made + restore,
    from the last ``start`` event) and the restore call's alone."""
    per: dict[int, dict[str, Any]] = {}
    for evs in workers:
        at = {e["ev"]: e for e in evs}  # each event's last
        if "restored" in at and start in at:
            per[evs[-1]["rank"]] = {
                "step": at["restored"]["step"], "source": at["restored"]["source"],
                "restore_s": at["restored"]["t"] - at[start]["t"],
                "call_s": at["restored"]["t"] - at.get("engine", at[start])["t"]}
    ranks = [per[r] for r in sorted(per)]
    return {"ranks": ranks,
            "restore_s": max((r["restore_s"] for r in ranks), default=None)}


def _checks(run: dict[str, Any], reference: list[str], out: dict[str, Any]) -> dict[str, Any]:
    finals = {e["rank"]: e["digest"] for e in run["events"] if e["ev"] == "final"}
    bitwise = len(finals) == len(reference) and all(
        finals.get(r) == d for r, d in enumerate(reference))
    restored = [r["step"] for r in out["ranks"]]
    why = []
    if run.get("error"):
        why.append(run["error"])
    if any(c != 0 for c in run.get("codes", [None])):
        why.append(f"agents' exit codes {run.get('codes')}")
    if not bitwise:
        why.append(f"final state not bitwise the reference's on ranks "
                   f"{sorted(r for r, d in enumerate(reference) if finals.get(r) != d)}")
    if len(restored) != len(reference) or not all(restored):
        why.append(f"restored steps {restored}: not every rank from a checkpoint")
    if out["total_s"] is None:
        why.append("the time line is incomplete (an event is missing)")
    share = None if not out["total_s"] or out["restore_s"] is None else \
        out["restore_s"] / out["total_s"]
    return {"bitwise": bitwise, "share": share, "ok": not why, "why": "; ".join(why)}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    runs = [timeline({**r, "victim": result["args"].get("victim", 1)}, result["reference"])
            for r in result["runs"]]
    by: dict[str, dict[str, Any]] = {}
    names = phases_of(result["runs"][0]["cfg"]) if result["runs"] else PHASES
    for source in dict.fromkeys(r["source"] for r in runs):
        mine = [r for r in runs if r["source"] == source and r["ok"]]
        med = {p: _median([r["phases"][p] for r in mine]) for p in names}
        by[source] = {"n": len(mine), "of": sum(r["source"] == source for r in runs),
                      "phases": med, "total_s": _median([r["total_s"] for r in mine]),
                      "restore_s": _median([r["restore_s"] for r in mine]),
                      "share": _median([r["share"] for r in mine])}
    return {"runs": runs, "by_source": by}


def _median(values: list[float | None]) -> float | None:
    cell = harness.spread(values)
    return None if cell is None else cell["median"]


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def markdown(result: dict[str, Any], command: str) -> str:
    s, a = result["summary"], result["args"]
    restart = a.get("restart", "relaunch")
    names = PHASES_INPROCESS if restart == "inprocess" else PHASES
    lines = [f"# Recovery, end to end\n\n`{command}`\n",
             f"Hosts: {a['hosts']} ({result['mode']}), one rank each; {a['mb']} MiB per rank; "
             f"killed: {a['kill']} {a['victim']} after step {a['kill_step']} (+{a['kill_delay']} s); "
             f"restart: {restart}; "
             f"disk saves every {a['every']} steps; medians of {a['reps']} run(s). Seconds.\n"]
    medians = [[source, f"{b['n']}/{b['of']}", *(_s(b["phases"][p]) for p in names),
                _s(b["total_s"]), _s(b["restore_s"]),
                "-" if b["share"] is None else f"{100 * b['share']:.0f} %"]
               for source, b in s["by_source"].items()]
    lines.append(harness.markdown_table(
        ["source", "runs ok", *names, "kill -> step", "restore, slowest rank", "restore share"],
        medians, "l" * (len(names) + 5)))
    lines += ["", "Targets (issue 66): kill -> next step <= 10 s; ckptio's restore <= 20 % of "
              "it; every step after the resume bitwise an uninterrupted run's.", ""]
    targets = []
    for source, b in s["by_source"].items():
        runs = [r for r in s["runs"] if r["source"] == source]
        targets.append([source, _mark(b["total_s"] is not None and b["total_s"] <= TOTAL_S),
                        _mark(b["share"] is not None and b["share"] <= RESTORE_SHARE),
                        _mark(bool(runs) and all(r.get("bitwise") for r in runs))])
    lines.append(harness.markdown_table(
        ["source", "kill -> step <= 10 s", "restore <= 20 %", "bitwise"], targets, "llll"))
    lines += ["", "Each run (moments from the kill; per rank the step and source restored, and "
              "its restore's seconds: manager made + restore / the restore call alone):", ""]
    for r in s["runs"]:
        d = r.get("detail", {})
        ranks = ", ".join(f"{x['step']}:{x['source']} {x['restore_s']:.2f}/{x['call_s']:.2f}"
                          for x in r.get("ranks", []))
        lines.append(f"- {r['source']} rep {r['rep']}: {'ok' if r['ok'] else 'FAILED'}; total "
                     f"{_s(r.get('total_s'))}; " + ", ".join(f"{k} {_s(v)}" for k, v in d.items())
                     + f"; restored [{ranks}]" + (f"; why: {r['why']}" if r.get("why") else ""))
    return "\n".join(lines) + "\n"
