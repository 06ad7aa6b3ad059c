"""Probe: cProfile of the steady async_save call (plan reused), eager or lazy, 1,000 tensors.

    python dev/call_profile.py [--lazy] [--saves 30] [--top 40]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import cProfile
import pstats
import shutil
import tempfile


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lazy", action="store_true")
    p.add_argument("--saves", type=int, default=30)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--sort", default="tottime")
    args = p.parse_args()
    import ckptio
    from benchmarks.call_overhead import many_tensors_state

    state = many_tensors_state(args.tensors)
    opt = state["optim"]
    scratch = tempfile.mkdtemp()
    ck = ckptio.Checkpointer()
    extra = {"optimizers": [opt]} if args.lazy else {}

    def save(i: int) -> object:
        return ck.async_save(state, f"{scratch}/s{i % 3}", lazy=args.lazy, **extra)

    try:
        for i in range(3):
            save(i).wait()
        prof = cProfile.Profile()
        for i in range(args.saves):
            prof.enable()
            handle = save(i)
            prof.disable()
            if args.lazy:
                opt.step()
            handle.wait()
        stats = pstats.Stats(prof).sort_stats(args.sort)
        stats.print_stats(args.top)
        stats.print_callees("begin|_agree|_start$|async_save")
    finally:
        ck.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
