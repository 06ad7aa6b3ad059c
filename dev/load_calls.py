"""Probe: wall time of repeated loads of one checkpoint of many small tensors (page cache
warm), in place and fresh, medians; for comparing two trees' per-read costs (the load's
stall watch: a token and a done-callback per read).

    python dev/load_calls.py [--tensors 1000] [--mib 64] [--loads 20] [--dir /tmp/lc]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import shutil
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--loads", type=int, default=20)
    p.add_argument("--dir", type=Path, default=Path("/tmp/lc"))
    args = p.parse_args()
    import torch

    import ckptio

    numel = args.mib * 2**20 // 4 // args.tensors
    state = {f"t{i}": torch.randn(numel) for i in range(args.tensors)}
    shutil.rmtree(args.dir, ignore_errors=True)
    ckptio.save(state, args.dir / "ck")
    times: dict[str, list[float]] = {"in place": [], "fresh": []}
    for _ in range(args.loads):
        t0 = time.perf_counter()
        ckptio.load(args.dir / "ck", state)
        times["in place"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckptio.load(args.dir / "ck")
        times["fresh"].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(f"{name:9s} median {statistics.median(ts) * 1e3:7.2f} ms  "
              f"lowest {min(ts) * 1e3:7.2f} ms  ({len(ts)} loads)")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
