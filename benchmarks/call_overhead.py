"""The Python a save costs its caller with the plan reused: async_save's call on a state of many
tiny tensors (so the copy itself is nothing), eager and lazy.

A ModuleList of --tensors / 2 ``Linear(16, 16, bias=False)`` and SGD with momentum (one step
taken, so each parameter has a momentum buffer): --tensors tensors. Twelve saves of each kind
into three rotating directories under a temporary directory, each waited for before the next;
the median of the calls after the first two (the plan made and reused), in ms, and the
slowest of them (a generation-2 garbage collection of the interpreter lands in one call now
and then: ``--freeze`` takes the startup objects out of its walks; ``--gc`` times those
collections and counts the cyclic garbage one save leaves).

    python -m benchmarks.call_overhead --tensors 1000 [--reps 3] [--json out.json]

Each repetition is a fresh worker process (benchmarks/harness.py) printing the lines above;
with --reps above 1 the medians over the repetitions follow, and --json keeps every run.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import harness, write_reports


def many_tensors_state(tensors: int) -> dict[str, Any]:
    """``{"model", "optim"}``: ``tensors`` / 2 ``Linear(16, 16, bias=False)`` in a ModuleList and
    SGD with momentum, one step taken (each parameter has its momentum buffer): ``tensors``
    tensors (the dev/ probes of the call use it too)."""
    import torch

    model = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(tensors // 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    return {"model": model, "optim": opt}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--freeze", action="store_true", help="gc.collect(); gc.freeze() after "
                   "setup, as a job may: the startup objects leave the collector's walks")
    p.add_argument("--gc", action="store_true", help="also time every generation-2 collection "
                   "(gc.callbacks) and count the objects one more eager save leaves as cyclic "
                   "garbage (gc.DEBUG_SAVEALL)")
    p.add_argument("--reps", type=int, default=1, help="fresh worker processes, one each")
    p.add_argument("--json", type=Path, help="every run's calls (ms) and the medians")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return harness.emit(measure(args))
    flags = [f"--{name}" for name in ("freeze", "gc") if getattr(args, name)]

    def run_one(_item: str, rep: int) -> harness.Run:
        return harness.spawn(harness.command("benchmarks.call_overhead", "--tensors",
                                             args.tensors, "--saves", args.saves, *flags),
                             label={"rep": rep}, strict=True, tail=20)

    runs = harness.repeat(["call"], args.reps, run_one, progress=lambda r, i, n: f"run {i}/{n}")
    lines = [line for run in runs for line in run["lines"]]
    if args.reps > 1:
        for kind in ("eager", "lazy"):
            later = harness.spread(run[kind]["later_median_ms"] for run in runs)
            assert later is not None  # every run is strict
            lines.append(f"{kind}: median over {args.reps} runs of the later calls' median "
                         f"{later['median']:.2f} ms ({later['min']:.2f}-{later['max']:.2f})")
    write_reports({"runs": runs}, args.json, None, "\n".join(lines))
    return 0


def measure(args: argparse.Namespace) -> harness.Run:
    """The worker: the saves' call times, and the lines the driver prints."""
    full: list[float] = []
    if args.gc:
        gc.callbacks.append(_timing(full))
    import ckptio

    state = many_tensors_state(args.tensors)
    opt = state["optim"]
    scratch = tempfile.mkdtemp()
    ck = ckptio.Checkpointer()
    if args.freeze:
        gc.collect()
        gc.freeze()
    run: harness.Run = {"tensors": args.tensors, "lines": []}
    try:
        for lazy in (False, True):
            calls = []
            for i in range(args.saves):
                start = time.perf_counter()
                handle = ck.async_save(state, f"{scratch}/s{i % 3}-{lazy}", lazy=lazy,
                                       optimizers=[opt] if lazy else ())
                calls.append(time.perf_counter() - start)
                if lazy:
                    opt.step()
                handle.wait()
            run["lazy" if lazy else "eager"] = {
                "calls_ms": [c * 1e3 for c in calls],
                "later_median_ms": statistics.median(calls[2:]) * 1e3}
            run["lines"].append(
                f"{'lazy' if lazy else 'eager'}: {args.tensors} tensors, first call "
                f"{calls[0] * 1e3:.1f} ms, later calls' median "
                f"{statistics.median(calls[2:]) * 1e3:.2f} ms, slowest "
                f"{max(calls[2:]) * 1e3:.1f} ms "
                f"({', '.join(f'{c * 1e3:.1f}' for c in calls)})")
        if args.gc:
            run["gen2_ms"] = full
            run["lines"].append(
                f"generation-2 collections: {len(full)}, ms: "
                f"{', '.join(f'{ms:.1f}' for ms in full)}; cyclic garbage of one eager save "
                "(freed once the next replaces it): "
                f"{_garbage_of(lambda: _two_saves(ck, state, scratch))}")
    finally:
        ck.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return run


def _timing(into: list[float]) -> Callable[[str, dict[str, int]], None]:
    """A gc callback appending each generation-2 collection's ms to ``into``."""
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            into.append((time.perf_counter() - started[0]) * 1e3)

    return callback


def _two_saves(ck: Any, state: dict[str, Any], scratch: str) -> None:
    """Two eager saves: the Checkpointer lets go of the first once the second runs."""
    for name in ("g0", "g1"):
        ck.async_save(state, f"{scratch}/{name}").wait()


def _garbage_of(work: Callable[[], object]) -> str:
    """The objects that ``work`` leaves unreachable only through cycles: all, and ckptio's."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        work()
        gc.collect()
        ours = sum(type(o).__module__.startswith("ckptio") for o in gc.garbage)
        return f"{len(gc.garbage)} objects, {ours} of ckptio's types"
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
