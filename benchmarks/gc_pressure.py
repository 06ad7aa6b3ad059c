"""How many of the interpreter's full (generation-2) garbage collections a checkpointing loop
causes, and how many objects a steady save leaves alive (issue 65): counts, not times, so a
busy machine does not change them.

A ModuleList of --tensors / 2 ``Linear(16, 16, bias=False)`` and SGD with momentum (a momentum
buffer per parameter), a CheckpointManager with one ``shm://`` tier saving every step (eager
async or lazy), 20 warm-up steps, then --saves steps counted with ``gc.callbacks``; "none" is
the same loop without ckptio. Then one more save with the collector paused: the objects it
creates and leaves alive once completed (tensors counted apart: a module's state_dict() makes
a fresh detached alias of each parameter).

    python -m benchmarks.gc_pressure --tensors 1000 --saves 100 [--reps 1] [--json out.json]

Each mode runs in a fresh worker process (benchmarks/harness.py), the modes' order reversed on
odd repetitions; each run's row is printed as a JSON line, and --json keeps them all.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, worker_env

MODES = ("none", "eager", "lazy")


def run(mode: str, tensors: int, saves: int) -> dict[str, Any]:
    import torch

    import ckptio

    model = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False) for _ in range(tensors // 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    state = {"model": model, "optim": opt}
    mgr = (None if mode == "none" else
           ckptio.CheckpointManager(tiers=[ckptio.Tier(f"shm://gc-pressure-{mode}-{os.getpid()}", keep_last=2)]))

    def step(n: int) -> None:
        if mgr is not None:
            mgr.save(n, state, asynchronous=True, lazy=mode == "lazy",
                     optimizers=[opt] if mode == "lazy" else ())
        opt.step()

    full = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        full[0] += phase == "stop" and info["generation"] == 2

    for n in range(1, 21):
        step(n)
    gc.collect()
    gc.callbacks.append(count)
    for n in range(21, 21 + saves):
        step(n)
    gc.callbacks.remove(count)
    if mgr is not None:
        mgr.wait()
    gc.collect()
    gc.disable()
    before = {id(o) for o in gc.get_objects()}
    step(10_000)
    if mgr is not None:
        mgr.wait()
    _save_thread_idle()
    new = [o for o in gc.get_objects() if id(o) not in before]
    gc.enable()
    alive_tensors = sum(isinstance(o, torch.Tensor) for o in new)
    if mgr is not None:
        mgr.close()
    return {"mode": mode, "tensors": tensors, "saves": saves, "full_collections": full[0],
            "per_100_saves": round(full[0] * 100 / saves, 1), "tracked_at_start": len(before),
            "alive_after_a_save": len(new) - alive_tensors, "alive_tensors": alive_tensors}


def _save_thread_idle() -> None:
    """Until the (long-lived) save thread is back waiting for work: wait() returns as the
    save's steps end, their frame still holding the state's tensors for a moment."""
    for thread in threading.enumerate():
        if thread.name != "ckptio-save":
            continue
        while True:
            frame = sys._current_frames().get(thread.ident or 0)
            files = []
            while frame is not None:
                files.append(frame.f_code.co_filename)
                frame = frame.f_back
            if not any(f.endswith("save_session.py") for f in files):
                break
            time.sleep(0.001)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--saves", type=int, default=100)
    p.add_argument("--reps", type=int, default=1, help="runs of each mode, a fresh process each")
    p.add_argument("--json", type=Path)
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return harness.emit(run(args.worker, args.tensors, args.saves))
    shm = tempfile.mkdtemp(prefix="ckptio-gc-pressure-", dir="/dev/shm")
    env = {**worker_env(), "CKPTIO_SHM_DIR": shm}

    def run_one(mode: str, rep: int) -> harness.Run:
        cmd = [*harness.command("benchmarks.gc_pressure", mode), "--tensors", str(args.tensors),
               "--saves", str(args.saves)]
        row = harness.spawn(cmd, label={"rep": rep}, strict=True, tail=20, env=env)
        print(json.dumps(row), flush=True)
        return row

    try:
        rows = harness.repeat(MODES, args.reps, run_one,
                              progress=lambda r, i, n: f"run {i}/{n}: {r['mode']}")
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
