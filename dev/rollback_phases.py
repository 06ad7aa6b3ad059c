"""Where a rollback's time goes: a manager with one shm:// tier saves a state four times, then
``mgr.restore(state)`` is timed whole and under cProfile (the top entries by cumulative time).

    python dev/rollback_phases.py [--gb 1] [--tensors 1000] [--prof 25] [--fresh]

--fresh: the restore runs in a second, fresh process (a manager made there) instead.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.restore_memory import _state  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--prof", type=int, default=25)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--dir")
    p.add_argument("--probe", action="store_true")
    args = p.parse_args()
    import ckptio

    if args.probe:
        from dev import phase_probe

        phase_probe.install()
    root = args.dir or tempfile.mkdtemp(prefix="rbphases-", dir="/dev/shm")
    os.environ["CKPTIO_SHM_DIR"] = root
    state = _state(args.gb, args.tensors, fill=False)
    tier = [ckptio.Tier("shm://rb", keep_last=1)]
    try:
        if args.dir is None:
            saved = _state(args.gb, args.tensors, fill=True)
            with ckptio.CheckpointManager(tiers=tier) as mgr:
                for step in range(1, 5):
                    mgr.save(step, saved)
                    mgr.wait()
                if not args.fresh:
                    _timed(mgr, state, args.prof)
                    return
            subprocess.run([sys.executable, __file__, "--dir", root, "--gb", str(args.gb),
                            "--tensors", str(args.tensors), "--prof", str(args.prof)] + (["--probe"] if args.probe else []), check=True)
            return
        t0 = time.perf_counter()
        with ckptio.CheckpointManager(tiers=tier) as mgr:
            print(json.dumps({"construct_s": time.perf_counter() - t0}))
            _timed(mgr, state, args.prof)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def _timed(mgr, state, prof: int) -> None:  # type: ignore[no-untyped-def]
    gc.collect()
    gc.freeze()
    for rep in range(2):
        profiler = cProfile.Profile() if rep == 0 and prof else None
        start, cpu = time.perf_counter(), time.process_time()
        if profiler:
            profiler.enable()
        restored = mgr.restore(state)
        if profiler:
            profiler.disable()
        print(json.dumps({"rep": rep, "step": restored, "s": time.perf_counter() - start,
                          "cpu_s": time.process_time() - cpu}))
        if "dev.phase_probe" in sys.modules:
            print(json.dumps(sys.modules["dev.phase_probe"].take()))
        if profiler:
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(prof)


if __name__ == "__main__":
    main()
