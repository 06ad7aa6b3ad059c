"""The GIL probe: how much a checkpoint's background work slows an interpreter-bound loop.

An eager GPU training loop is bound by its Python thread launching kernels; background work
that takes the interpreter (Python bytecode between system calls) slows it even when cores are
free. The probe models that on a CPU: the training thread runs hundreds of tiny torch ops per
step (each op releases and retakes the GIL, as a kernel launch does), pinned to one core; every
other thread and process of the job is pinned to the other core (re-pinned after each save call:
a thread inherits the affinity of the thread that made it). Each mode runs in a fresh process:

    idle       no background work (the step time every slowdown is measured against)
    memcpy     a background thread copies the whole state once into pre-faulted tensors, in
               one call (torch._foreach_copy_, GIL released): the memory-bandwidth floor
    ckptio     ckptio.async_save of the state into --dir (defaults), waited for
    ckptio_shm the same into a directory on /dev/shm (the memory tier's medium)
    ckptio_lazy, ckptio_lazy_shm: lazy=True, an optimizer owning every tensor (the save's own
               thread copies the state while the loop runs: the copy is background work too)
    ckptio_persist / ckptio_persist_shm: the same with Options(persist="process")

Per mode: the median step time before the background work starts and while it runs (steps that
overlap it), the slowdown in %, the background's duration and the steps it overlapped; medians
over --reps. The table names the floor's slowdown beside each mode's: the issue's target is
"within 2 points of the memcpy floor".

    python -m benchmarks.gil_probe --gb 1 --dir bench-data --reps 5 --markdown docs/results/...
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, worker_env

MODES = ("idle", "memcpy", "ckptio", "ckptio_shm", "ckptio_lazy", "ckptio_lazy_shm")
TRAIN_CORE, BACKGROUND_CORE = 0, 1


def build_state(gb: float, tensors: int) -> dict[str, Any]:
    """``tensors`` float32 tensors of together about ``gb`` GB (sizes spread 1:8, as a model's
    weights, norms and optimizer moments are), every page written."""
    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [1 + (i % 8) for i in range(tensors)]
    unit = int(gb * 1e9) // 4 // sum(weights)
    return {f"t{i:05d}": torch.rand(max(1, unit * w), generator=gen)
            for i, w in enumerate(weights)}


class Loop:
    """The interpreter-bound training step: ``ops`` tiny torch ops on one thread."""

    def __init__(self, ops: int) -> None:
        import torch

        torch.manual_seed(0)
        self.ops = ops
        self.x = torch.randn(32, 32)
        self.w = torch.randn(32, 32) * 0.1

    def step(self) -> float:
        import torch

        t0 = time.perf_counter()
        x = self.x
        for _ in range(self.ops // 3):
            x = torch.tanh(x @ self.w) + 0.5
        self.x = x.detach()
        return time.perf_counter() - t0


def pin_others(keep: int, core: int) -> None:
    """Pin every thread of this process but ``keep`` (a native thread id) to ``core``."""
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != keep:
            try:
                os.sched_setaffinity(int(tid), {core})
            except (ProcessLookupError, PermissionError):
                pass  # the thread ended meanwhile


def pin_children(core: int) -> None:
    """Pin every thread of every child process of this one to ``core`` (a persist process)."""
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == me:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.sched_setaffinity(int(tid), {core})
        except (OSError, ValueError, IndexError):
            continue


class Background:
    """One mode's background work: start() -> something with done(); finish() after it."""

    def __init__(self, mode: str, state: dict[str, Any], root: Path, pin: bool) -> None:
        self.mode, self.state, self.root, self.pin = mode, state, root, pin
        self.count = 0
        if mode == "memcpy":
            import torch

            self.dest = {k: torch.empty_like(v) for k, v in state.items()}
            for v in self.dest.values():
                v.zero_()
        elif mode.startswith("ckptio"):
            import ckptio

            import torch

            extra = {"persist": "process"} if "persist" in mode else {}
            self.checkpointer = ckptio.Checkpointer(ckptio.Options.from_env(**extra))  # CKPTIO_*
            # lazy: an optimizer owning every tensor (its step() is never called here)
            self.optimizer = torch.optim.SGD(list(state.values()), lr=0.0)

    def start(self) -> Any:
        self.count += 1
        if self.mode == "memcpy":
            done = threading.Event()

            def copy() -> None:
                import torch

                if self.pin:
                    os.sched_setaffinity(0, {BACKGROUND_CORE})
                torch._foreach_copy_(list(self.dest.values()), list(self.state.values()))
                done.set()
            threading.Thread(target=copy, name="probe-memcpy").start()
            return done
        path = self.root / f"step-{self.count}"
        if "lazy" in self.mode:  # every tensor copied by the save's own thread, in the background
            return self.checkpointer.async_save(self.state, path, lazy=True,
                                                optimizers=[self.optimizer])
        return self.checkpointer.async_save(self.state, path)

    def finish(self, handle: Any) -> None:
        if self.mode.startswith("ckptio"):
            handle.wait()
            shutil.rmtree(self.root / f"step-{self.count}", ignore_errors=True)


def is_done(handle: Any) -> bool:
    return handle.is_set() if isinstance(handle, threading.Event) else handle.done()


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    """One mode in this (fresh) process: warm-up saves, then --reps measured ones."""
    import torch

    torch.set_num_threads(1)
    train_tid = threading.get_native_id()
    pin = not args.shared
    if pin:
        os.sched_setaffinity(0, {TRAIN_CORE})
    state = build_state(args.gb, args.tensors)
    loop = Loop(args.ops)
    root = Path(tempfile.mkdtemp(prefix="gil-probe-", dir=args.where))
    background = Background(args.mode, state, root, pin) if args.mode != "idle" else None
    if pin:
        pin_others(train_tid, BACKGROUND_CORE)
    for _ in range(args.warmup_steps):
        loop.step()
    reps = []
    try:
        for rep in range(args.reps + 1):  # rep 0: the first save of the process (reported apart)
            base = [loop.step() for _ in range(args.base_steps)]
            during: list[float] = []
            t0 = time.perf_counter()
            if background is None:
                during = [loop.step() for _ in range(args.base_steps)]
                bg_s = 0.0
            else:
                handle = background.start()
                call_s = time.perf_counter() - t0
                if pin:
                    pin_others(train_tid, BACKGROUND_CORE)
                    pin_children(BACKGROUND_CORE)
                during.append(loop.step())  # at least one: the loop goes on after the call
                while not is_done(handle):
                    during.append(loop.step())
                bg_s = time.perf_counter() - t0
                background.finish(handle)
            reps.append({"rep": rep, "base_step_s": statistics.median(base),
                         "during_step_s": statistics.median(during) if during else None,
                         "steps_during": len(during), "background_s": bg_s,
                         "call_s": call_s if background is not None else 0.0})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"mode": args.mode, "reps": reps}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    later = [r for r in run["reps"] if r["rep"] > 0 and r["during_step_s"]]
    slow = [100 * (r["during_step_s"] / r["base_step_s"] - 1) for r in later]
    return {"mode": run["mode"], "base_ms": 1e3 * statistics.median(r["base_step_s"] for r in later),
            "during_ms": 1e3 * statistics.median(r["during_step_s"] for r in later),
            "slowdown_pct": statistics.median(slow), "slowdowns": [round(s, 1) for s in slow],
            "background_s": statistics.median(r["background_s"] for r in later),
            "call_ms": 1e3 * statistics.median(r["call_s"] for r in later),
            "first_call_ms": 1e3 * run["reps"][0]["call_s"],
            "steps_during": statistics.median(r["steps_during"] for r in later)}


def markdown(rows: list[dict[str, Any]], argv: list[str], args: argparse.Namespace) -> str:
    floor = next((r["slowdown_pct"] for r in rows if r["mode"] == "memcpy"), None)
    lines = [f"`python -m benchmarks.gil_probe {' '.join(argv)}`  ",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs; "
             f"state {args.gb} GB in {args.tensors} float32 tensors; a step = {args.ops} tiny "
             f"torch ops on one thread; {_model(args)}; medians of {args.reps} repetitions "
             "after a first one (the first save of the process: its call in parentheses)", "",
             "| mode | step ms before | step ms during | slowdown % | vs memcpy floor (points) "
             "| background s | steps overlapped | call ms (first call) | slowdowns % |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        gap = "" if floor is None or r["mode"] == "idle" else f"{r['slowdown_pct'] - floor:+.1f}"
        lines.append(f"| {r['mode']} | {r['base_ms']:.2f} | {r['during_ms']:.2f} | "
                     f"{r['slowdown_pct']:+.1f} | {gap} | {r['background_s']:.2f} | "
                     f"{r['steps_during']:.0f} | {r['call_ms']:.0f} ({r['first_call_ms']:.0f}) | "
                     f"{', '.join(f'{s:+.1f}' for s in r['slowdowns'])} |")
    return "\n".join(lines) + "\n"


def _model(args: argparse.Namespace) -> str:
    if args.shared:
        return "shared cores (nothing pinned)"
    return (f"GPU-node model (the loop's thread pinned to core {TRAIN_CORE}, every other thread "
            f"and process of the job to core {BACKGROUND_CORE})")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gil_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="state size in GB (default 1)")
    p.add_argument("--tensors", type=int, default=1000, help="tensors in the state (default 1000)")
    p.add_argument("--ops", type=int, default=600, help="tiny torch ops per step (default 600)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated ({','.join(MODES)}"
                   ",ckptio_persist,ckptio_persist_shm)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions per mode (default 5)")
    p.add_argument("--dir", type=Path, default=Path("bench-data"), help="disk scratch directory")
    p.add_argument("--base-steps", type=int, default=20, help="steps before each background job")
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--shared", action="store_true", help="shared cores: nothing pinned (the "
                   "worst case) instead of the GPU-node model (loop on one core, the rest on the "
                   "other)")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--mode", help=argparse.SUPPRESS)  # a worker: this one mode
    p.add_argument("--where", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.mode:
        return harness.emit(run_mode(args))
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("the probe needs two cores (one for the loop, one for the background)")
    args.dir.mkdir(parents=True, exist_ok=True)
    runs, rows = [], []
    for mode in args.modes.split(","):
        where = "/dev/shm" if mode.endswith("_shm") else str(args.dir)
        cmd = [sys.executable, "-m", "benchmarks.gil_probe", *argv, "--mode", mode,
               "--where", where]
        run = harness.spawn(cmd, timeout=3600, tail=30,
                            env={**worker_env(), "OMP_NUM_THREADS": "1"})
        if "error" in run:
            print(f"[{mode}] FAILED {run['error']}", file=sys.stderr)
            continue
        runs.append(run)
        rows.append(summarize(run))
        print(f"[{mode}] {rows[-1]}", file=sys.stderr)
    text = markdown(rows, argv, args)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
