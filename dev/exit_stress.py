"""Stress the exit of resharding ranks (issue 63 item 11): a matrix of save-on-N / load-on-M
runs, each rank a fresh interpreter (run_ranks(spawn=True)), repeated, counting ranks that
exit uncleanly and 'terminate called' in their standard error.

    PYTHONPATH=$PWD python dev/exit_stress.py --rounds 5 [--hogs 2] [--minutes 30]

Variants per round: ckptio.save/ckptio.load, CheckpointManager save/restore, async_save; each
with and without destroy_process_group at the end of the rank function. ``--hogs N`` runs N
niced CPU burners meanwhile; ``--only 4-4-manager-1`` repeats one case. Each rank prints, at
exit, the threads still alive (Python stacks, native names: gloo threads there mean a process
group that destroy_process_group did not free); an unclean rank's report carries it. Prints
one line per run and a summary; exit status 1 if any rank exited uncleanly.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from typing import Any

MATRIX = [(4, 2), (2, 4), (3, 2), (2, 3), (4, 4)]
VARIANTS = ["api", "manager", "async"]
ROWS = 96


def _state(rank: int, world: int, zeros: bool) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(ROWS * 64, dtype=torch.float32).reshape(ROWS, 64)
    sharded = distribute_tensor(torch.zeros_like(full) if zeros else full, mesh, [Shard(0)])
    bias = torch.zeros(1000) if zeros else torch.linspace(0, 1, 1000)
    return {"model": {"w": sharded, "b": bias}, "step": 0 if zeros else 7}


def _show_threads_at_exit() -> None:
    """Print, at interpreter exit (after threading joined its threads), each Python thread
    still alive with its stack, and the process's native threads: in the standard error an
    unclean rank's report carries."""
    import atexit
    import os
    import threading
    import traceback

    def show() -> None:
        frames = sys._current_frames()
        for t in threading.enumerate():
            if t is not threading.main_thread():
                stack = "".join(traceback.format_stack(frames[t.ident])) if t.ident in frames else ""
                sys.stderr.write(f"alive at exit: {t.name} daemon={t.daemon}\n{stack}")
        names = []
        for task in sorted(os.listdir("/proc/self/task")):
            try:
                with open(f"/proc/self/task/{task}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                continue
        sys.stderr.write(f"native threads at exit: {names}\n")
        sys.stderr.flush()

    atexit.register(show)


def save_case(rank: int, world: int, path: str, variant: str) -> None:
    import ckptio

    _show_threads_at_exit()

    state = _state(rank, world, zeros=False)
    if variant == "api":
        ckptio.save(state, path)
    elif variant == "async":
        ckptio.async_save(state, path).wait()
    else:
        mgr = ckptio.CheckpointManager(path)
        mgr.save(7, state)
        mgr.close()


def load_case(rank: int, world: int, path: str, variant: str) -> int:
    import ckptio

    _show_threads_at_exit()

    state = _state(rank, world, zeros=True)
    if variant == "manager":
        mgr = ckptio.CheckpointManager(path)
        step = mgr.restore(state)
        mgr.close()
    else:
        ckptio.load(path, state)
        step = state["step"]
    want = _state(rank, world, zeros=False)["model"]["w"].to_local()
    if step != 7 or not bool((state["model"]["w"].to_local() == want).all()):
        raise AssertionError(f"rank {rank}: wrong values after loading ({variant})")
    return 0


def _one(n: int, m: int, variant: str, destroy: bool, root: str) -> str | None:
    """One save on n ranks and load on m ranks -> None, or the failure's text."""
    from ckptio.testing.rank_processes import RanksFailed, run_ranks

    path = f"{root}/{variant}-{n}-{m}-{int(destroy)}-{time.monotonic_ns()}"
    try:
        run_ranks(n, save_case, path, variant, spawn=True, destroy=destroy, timeout_s=300)
        run_ranks(m, load_case, path, variant, spawn=True, destroy=destroy, timeout_s=300)
    except RanksFailed as e:
        return str(e)
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=35.0)
    parser.add_argument("--only", default="", help="e.g. '4-4-manager-1': one case")
    args = parser.parse_args()
    hogs = [subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while 1: pass"])
            for _ in range(args.hogs)]
    runs, bad, terminate = 0, 0, 0
    stop_at = time.monotonic() + args.minutes * 60
    try:
        with tempfile.TemporaryDirectory(prefix="ckptio-exit-stress-") as root:
            for rnd, ((n, m), variant, destroy) in itertools.product(
                    range(args.rounds), itertools.product(MATRIX, VARIANTS, [True, False])):
                if time.monotonic() > stop_at:
                    break
                if args.only and args.only != f"{n}-{m}-{variant}-{int(destroy)}":
                    continue
                began = time.monotonic()
                failure = _one(n, m, variant, destroy, root)
                runs += 1
                verdict = "ok" if failure is None else "UNCLEAN"
                print(f"round {rnd} {n}->{m} {variant} destroy={destroy}: {verdict} "
                      f"({time.monotonic() - began:.1f} s)", flush=True)
                if failure is not None:
                    bad += 1
                    terminate += "terminate called" in failure
                    print(failure, flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"runs {runs}, unclean {bad}, with 'terminate called' {terminate}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
