"""The copy kernel of a rollback alone: 1 GB out of a tmpfs mapping into pre-faulted tensors,
by T threads in blocks of B bytes, with and without xxh3 of each block as it lands.

    python dev/copy_kernel.py
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

N = 1 << 30


def main() -> None:
    path = "/dev/shm/copy-kernel"
    with open(path, "wb") as f:
        f.truncate(N)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, N)
    src = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    ctypes.memset(src, 1, N)
    dst = torch.zeros(N, dtype=torch.uint8)
    dview = memoryview((ctypes.c_char * N).from_address(dst.data_ptr())).cast("B")
    srct = torch.frombuffer(mm, dtype=torch.uint8)
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(srct)
        print("torch copy_", round(time.perf_counter() - t, 4))
    for threads in (1, 2, 3):
        pool = ThreadPoolExecutor(threads)
        for block in (256 << 10, 512 << 10, 1 << 20, 4 << 20):
            for hashed in (False, True):
                best = 9.0
                for _ in range(3):
                    t = time.perf_counter()
                    per = N // threads
                    def work(k: int) -> None:
                        h = xxhash.xxh3_64()
                        for off in range(k * per, (k + 1) * per, block):
                            ctypes.memmove(dst.data_ptr() + off, src + off, block)
                            if hashed:
                                h.update(dview[off:off + block])
                    list(pool.map(work, range(threads)))
                    best = min(best, time.perf_counter() - t)
                print(f"threads={threads} block={block >> 10}K hash={hashed} {best:.4f}")
        pool.shutdown()
    os.unlink(path)


if __name__ == "__main__":
    main()
