"""The drain's copy of one step from the memory tier to a disk tier, timed: wall and CPU seconds.

A state of --gb GB in --tensors float32 tensors is saved once into a directory on /dev/shm;
then each repetition copies it with the drain's own function (managing/copy.copy_checkpoint)
into a fresh directory under --dir (page cache of the source warm, as a memory tier's is),
durable at return. Reports the median wall seconds, GB/s and CPU seconds of the process (every
thread) per repetition. Run it from two checkouts (PYTHONPATH) to compare them:

    python -m benchmarks.drain_copy --gb 1 --reps 5 --dir bench-data --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import write_reports


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("bench-data"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import torch

    import ckptio
    from ckptio.resources import ReusedIOResources
    from ckptio.storage.local.local_store import LocalStore
    from ckptio.managing.copy import copy_checkpoint

    gen = torch.Generator().manual_seed(0)
    per = int(args.gb * 1e9) // 4 // args.tensors
    state = {f"t{i:05d}": torch.rand(per, generator=gen) for i in range(args.tensors)}
    shm = Path(tempfile.mkdtemp(prefix="drain-copy-", dir="/dev/shm"))
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        ckptio.save(state, shm / "step")
        del state
        resources = ReusedIOResources(ckptio.Options())
        for rep in range(args.reps + 1):
            target = args.dir / f"copy-{rep}"
            wall, cpu = time.perf_counter(), time.process_time()
            nbytes = copy_checkpoint(resources, LocalStore(shm / "step"), LocalStore(target))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            shutil.rmtree(target)
            if rep:  # the first builds the pool and backends
                rows.append({"s": wall, "cpu_s": cpu, "gbps": nbytes / wall / 1e9})
            print(f"rep {rep}: {wall:.3f} s, {cpu:.3f} CPU s, {nbytes / wall / 1e9:.2f} GB/s",
                  flush=True)
        resources.release()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    summary = {k: statistics.median(r[k] for r in rows) for k in ("s", "cpu_s", "gbps")}
    write_reports({"gb": args.gb, "tensors": args.tensors, "reps": rows, "median": summary},
                  args.json, None, json.dumps({"median": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
