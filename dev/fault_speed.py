"""How fast fresh anonymous memory faults in here: 2 GB populated by one
``madvise(MADV_POPULATE_WRITE)``, shared (how the staging pool was mapped) and private (how it
is now), with 4 KiB pages and with transparent huge pages asked for (MADV_HUGEPAGE), twice each
(docs/BENCH_LOOP.md, section 12). A probe of the VM, not of ckptio.

    python dev/fault_speed.py [GB]
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import time

MADV_HUGEPAGE, MADV_POPULATE_WRITE = 14, 23


def main() -> int:
    nbytes = int(float(sys.argv[1]) * (1 << 30)) if len(sys.argv) > 1 else 2 << 30
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for kind, flags in (("shared", mmap.MAP_SHARED), ("private", mmap.MAP_PRIVATE)):
        for huge in (False, True, False, True):
            mapping = mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_ANONYMOUS)
            address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
            if huge:
                libc.madvise(address, nbytes, MADV_HUGEPAGE)
            start = time.perf_counter()
            failed = libc.madvise(address, nbytes, MADV_POPULATE_WRITE)
            seconds = time.perf_counter() - start
            print(f"{kind:8s} {'huge' if huge else '4 KiB':6s} {seconds:.3f} s "
                  f"{nbytes / seconds / 1e9:.2f} GB/s{' (madvise failed)' if failed else ''}")
            del address
            mapping.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
