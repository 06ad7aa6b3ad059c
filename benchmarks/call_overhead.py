"""The Python a save costs its caller with the plan reused: async_save's call on a state of many
tiny tensors (so the copy itself is nothing), eager and lazy.

A ModuleList of --tensors / 2 ``Linear(16, 16, bias=False)`` and SGD with momentum (one step
taken, so each parameter has a momentum buffer): --tensors tensors. Twelve saves of each kind
into three rotating directories under a temporary directory, each waited for before the next;
the median of the calls after the first two (the plan made and reused), in ms, and the
slowest of them (a generation-2 garbage collection of the interpreter lands in one call now
and then: ``--freeze`` takes the startup objects out of its walks).

    python -m benchmarks.call_overhead --tensors 1000
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--freeze", action="store_true", help="gc.collect(); gc.freeze() after "
                   "setup, as a job may: the startup objects leave the collector's walks")
    args = p.parse_args()
    import torch

    import ckptio

    model = torch.nn.ModuleList(torch.nn.Linear(16, 16, bias=False)
                                for _ in range(args.tensors // 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    state = {"model": model, "optim": opt}
    scratch = tempfile.mkdtemp()
    ck = ckptio.Checkpointer()
    if args.freeze:
        gc.collect()
        gc.freeze()
    try:
        for lazy in (False, True):
            calls = []
            for i in range(args.saves):
                start = time.perf_counter()
                handle = ck.async_save(state, f"{scratch}/s{i % 3}-{lazy}", lazy=lazy,
                                       optimizers=[opt] if lazy else ())
                calls.append(time.perf_counter() - start)
                if lazy:
                    opt.step()
                handle.wait()
            print(f"{'lazy' if lazy else 'eager'}: {args.tensors} tensors, first call "
                  f"{calls[0] * 1e3:.1f} ms, later calls' median "
                  f"{statistics.median(calls[2:]) * 1e3:.2f} ms, slowest "
                  f"{max(calls[2:]) * 1e3:.1f} ms "
                  f"({', '.join(f'{c * 1e3:.1f}' for c in calls)})", flush=True)
    finally:
        ck.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
