"""Where a save into the memory tier spends its time: the passes over S bytes it makes, each
timed alone on this machine (docs/BENCH_TIERS.md, "Why every step costs what it costs").

Owns: the probe and its table. Does not own: the tiers benchmark (benchmarks/tiers.py).

    python -m benchmarks.tmpfs_probe --mb 100 --reps 7
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable

import torch
import xxhash


def _median_ms(fn: Callable[[int], None], reps: int) -> float:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:] if reps > 2 else times)


def _pwrite(path: str, data: memoryview, create: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_EXCL if create else 0), 0o644)
    try:
        if create:
            os.posix_fallocate(fd, 0, len(data))
        for off in range(0, len(data), 16 << 20):
            os.pwrite(fd, data[off:off + (16 << 20)], off)
    finally:
        os.close(fd)


def _mmap_write(path: str, data: memoryview, create: bool) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if create:
            os.ftruncate(fd, len(data))
        with mmap.mmap(fd, len(data), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as mm:
            mm[:] = data
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tmpfs_probe")
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default="/dev/shm/ckptio-tmpfs-probe")
    args = p.parse_args(argv)
    n = args.mb << 20
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    data = memoryview(src.numpy())
    os.makedirs(args.dir, exist_ok=True)
    rows: list[tuple[str, float]] = []
    try:
        rows.append(("memcpy into a touched buffer (Tensor.copy_)", _median_ms(
            lambda i: dst.copy_(src), args.reps)))
        rows.append(("xxh3_64 of the bytes", _median_ms(
            lambda i: xxhash.xxh3_64(data).intdigest(), args.reps)))
        for name, write in (("pwrite", _pwrite), ("mmap+MAP_POPULATE", _mmap_write)):
            def fresh(i: int, write: Callable[..., None] = write) -> None:
                path = f"{args.dir}/fresh-{i}"
                write(path, data, True)
                os.unlink(path)  # its pages go back: the next file's are fresh again

            rows.append((f"{name}, a new tmpfs file (fresh pages)", _median_ms(fresh, args.reps)))
            write(f"{args.dir}/kept", data, True)
            rows.append((f"{name}, over an existing tmpfs file (its pages reused)", _median_ms(
                lambda i, write=write: write(f"{args.dir}/kept", data, False), args.reps)))
            os.unlink(f"{args.dir}/kept")
        import ckptio

        ck = ckptio.Checkpointer()
        state = {"w": torch.ones(n // 4, dtype=torch.float32)}
        ck.prepare(state=state, wait=True)

        def save(i: int) -> None:
            ck.save(state, f"{args.dir}/ckpt-{i}")
            shutil.rmtree(f"{args.dir}/ckpt-{i}")

        rows.append(("ckptio.save of one tensor into a tmpfs directory (sync, all of it)",
                     _median_ms(save, args.reps)))
        ck.close()
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"`python -m benchmarks.tmpfs_probe {' '.join(argv or sys.argv[1:])}`\n")
    print(f"| pass over {args.mb} MiB | ms (median of {args.reps - 1}) | GB/s |\n|---|---:|---:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {n / ms / 1e6:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
