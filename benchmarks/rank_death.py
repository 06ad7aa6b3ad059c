"""A rank killed mid-save or mid-load: how long until every other rank raises, ckptio against DCP.

Owns: the runs and the report. Each run is a fresh set of ``--world`` processes (gloo over
127.0.0.1, ckptio.testing.rank_processes.run_ranks) that first save a complete checkpoint, then save again
(or load it) while one rank (``--victim``) is killed with SIGKILL at a phase
(ckptio.testing.killed.PHASES: planning, waiting for the plan, writing, before concluding; for
loads before the key step, reading, before the final step), or frozen (SIGSTOP: alive, its
sockets open, answering nothing; phases ending "(frozen)"). The victim writes the time just
before it dies; each survivor the time it raised. Reported per phase: the survivors' latency
(median and max over runs and survivors) against 2x the deadline (Options.rank_timeout_s),
what they raised, and whether the previous checkpoint still loads.

The peer is DCP (torch.distributed.checkpoint.save / load over the same gloo group, the victim
killed inside its storage writer's write_data or reader's read_data): a survivor still waiting
when ``--cap`` seconds have passed is cut off and counted as hung. The process group's timeout
is cap/2 (run_ranks), so a DCP survivor waiting in a gloo collective raises then; gloo's
default is 30 min.

    python -m benchmarks.rank_death --world 4 --deadline 5 --reps 3 \\
        --markdown docs/results/rank_death.md --json docs/results/rank_death.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import ckptio
from ckptio.testing import killed
from ckptio.testing.rank_processes import RanksFailed, run_ranks

DCP_PHASES = ("dcp save:write", "dcp load:read")
FROZEN = " (frozen)"  # the victim is stopped (SIGSTOP) rather than killed
DEFAULT_PHASES = killed.PHASES + DCP_PHASES + tuple(
    p + FROZEN for p in ("save:write", "load:read") + DCP_PHASES)


def _dcp_arm(phase: str, mark: str, how: str) -> None:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    kill = killed.killer(mark, how)
    if phase == "dcp save:write":
        FileSystemWriter.write_data = kill  # type: ignore[method-assign]
    else:
        FileSystemReader.read_data = kill  # type: ignore[method-assign]


def dcp_killed(rank: int, world: int, path: str, phase: str, victim: int, mark: str,
               _deadline_s: float, how: str) -> Any:
    import torch.distributed.checkpoint as dcp

    dcp.save(killed.state(rank, 1), checkpoint_id=path)
    if rank == victim:
        _dcp_arm(phase, mark, how)
    started = time.time()
    try:
        if phase == "dcp save:write":
            dcp.save(killed.state(rank, 2), checkpoint_id=path)
        else:
            dcp.load(killed.state(rank, 0), checkpoint_id=path)
    except Exception as exc:  # noqa: BLE001 - reported: what DCP raises
        return type(exc).__name__, time.time(), str(exc)[:300], (), started
    return "ok", time.time(), "", (), started


def one_run(phase: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    path, mark = str(root / "ck"), root / "killed"
    if mark.exists():
        mark.unlink()
    how = "freeze" if phase.endswith(FROZEN) else "kill"
    common = (phase.removesuffix(FROZEN), args.victim, str(mark), args.deadline, how)
    try:
        if phase.startswith("dcp"):
            outcomes = run_ranks(args.world, dcp_killed, path, *common, timeout_s=args.cap,
                                 may_die=(args.victim,))
        elif phase.startswith("save"):
            outcomes = run_ranks(args.world, killed.save_killed, path, *common,
                                 timeout_s=args.cap, may_die=(args.victim,))
        else:
            run_ranks(args.world, killed.save_for_load, path)
            outcomes = run_ranks(args.world, killed.load_killed, path, *common,
                                 timeout_s=args.cap, may_die=(args.victim,))
        hung = 0
    except RanksFailed as exc:  # a survivor did not answer within the cap (killed by run_ranks)
        outcomes, hung = [], str(exc).count("exit code")
    killed_at = float(mark.read_text()) if mark.exists() else None
    survivors = [o for r, o in enumerate(outcomes) if r != args.victim and o is not None]
    latencies = [o[1] - killed_at for o in survivors] if killed_at else []
    intact = None
    if phase.startswith("save"):
        intact = ckptio.load(path)["step"] == 1
    return {"phase": phase, "latencies": latencies, "raised": sorted({o[0] for o in survivors}),
            "named": all(f"rank {args.victim}" in o[2] for o in survivors) if survivors else None,
            "hung": hung, "intact": intact, "message": survivors[0][2] if survivors else ""}


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for phase in dict.fromkeys(r["phase"] for r in runs):
        mine = [r for r in runs if r["phase"] == phase]
        lat = [x for r in mine for x in r["latencies"]]
        rows.append({"phase": phase, "runs": len(mine),
                     "median_s": statistics.median(lat) if lat else None,
                     "max_s": max(lat) if lat else None,
                     "hung": sum(r["hung"] for r in mine),
                     "raised": sorted({k for r in mine for k in r["raised"]}),
                     "named": all(r["named"] for r in mine),
                     "intact": None if mine[0]["intact"] is None else all(r["intact"] for r in mine),
                     "within_2x": bool(lat) and max(lat) < 2 * args.deadline and not any(r["hung"] for r in mine),
                     "message": mine[0]["message"]})
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, argv: list[str]) -> str:
    def s(x: float | None) -> str:
        return f"> {args.cap:g}" if x is None else f"{x:.2f}"

    lines = [f"# Killed rank: time until every survivor raises ({time.strftime('%Y-%m-%d %H:%M')})",
             "", f"`python -m benchmarks.rank_death {shlex.join(argv)}`", "",
             (f"{args.world} ranks, rank {args.victim} killed (SIGKILL) or frozen (SIGSTOP); "
              f"ckptio rank_timeout_s = {args.deadline:g} s (target: every survivor within "
              f"{2 * args.deadline:g} s); process group timeout {args.cap / 2:g} s; a survivor "
              f"still waiting after {args.cap:g} s is cut off (hung)."), "",
             "| phase | runs | median s | max s | within 2x | hung | raised | names the rank "
             "| previous checkpoint intact |",
             "|---|---:|---:|---:|---|---:|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['runs']} | {s(r['median_s'])} | {s(r['max_s'])} | "
                     f"{'yes' if r['within_2x'] else 'no'} | {r['hung']} | "
                     f"{', '.join(r['raised']) or '-'} | {'yes' if r['named'] else 'no'} | "
                     f"{'-' if r['intact'] is None else 'yes' if r['intact'] else 'no'} |")
    lines += ["", "What a survivor read (first run of each phase):", ""]
    lines += [f"- {r['phase']}: {r['message'][:400] or '(nothing: it hung)'}" for r in rows]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rank_death", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--deadline", type=float, default=5.0, help="Options.rank_timeout_s")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--phases", default=",".join(DEFAULT_PHASES))
    p.add_argument("--cap", type=float, default=120.0, help="seconds before a run is cut off")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory(prefix="rank-death-") as tmp:
        for rep in range(args.reps):
            for phase in args.phases.split(","):
                root = Path(tmp) / f"{phase.replace(':', '-').replace(' ', '-')}-{rep}"
                root.mkdir()
                runs.append(one_run(phase, args, root))
                print(f"{phase} rep {rep}: {runs[-1]['latencies']} hung={runs[-1]['hung']}",
                      flush=True)
    rows = summarize(runs, args)
    text = markdown(rows, args, argv)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None, "markdown": None},
                                         "rows": rows, "runs": runs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
