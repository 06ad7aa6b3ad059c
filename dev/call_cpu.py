"""Probe: a steady async_save call's wall and CPU time (the caller's thread, time.thread_time,
which a loaded machine disturbs less than the wall clock), eager and lazy, 1,000 tensors, the
setup of benchmarks/call_overhead.py; medians of the calls after the first two.

    python dev/call_cpu.py [--saves 30]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import shutil
import statistics
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--saves", type=int, default=30)
    p.add_argument("--tensors", type=int, default=1000)
    args = p.parse_args()
    import ckptio
    from benchmarks.call_overhead import many_tensors_state

    state = many_tensors_state(args.tensors)
    opt = state["optim"]
    scratch = tempfile.mkdtemp()
    ck = ckptio.Checkpointer()
    try:
        for lazy in (False, True):
            wall, cpu = [], []
            for i in range(args.saves):
                w, c = time.perf_counter(), time.thread_time()
                handle = ck.async_save(state, f"{scratch}/s{i % 3}-{lazy}", lazy=lazy,
                                       optimizers=[opt] if lazy else ())
                cpu.append(time.thread_time() - c)
                wall.append(time.perf_counter() - w)
                if lazy:
                    opt.step()
                handle.wait()
            print(f"{'lazy' if lazy else 'eager'}: wall median {statistics.median(wall[2:]) * 1e3:.2f}"
                  f" ms, caller's CPU median {statistics.median(cpu[2:]) * 1e3:.2f} ms, min "
                  f"{min(cpu[2:]) * 1e3:.2f} ms", flush=True)
    finally:
        ck.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
