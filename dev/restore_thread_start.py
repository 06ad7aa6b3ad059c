"""Probe: how long a thread takes to start at the end of a manager's restore from memory, and
the restore's time, in a fresh process (docs/BENCH_LOOP.md, "Pages faulted in a step at a
time"). The 150 MB MLP and AdamW state of benchmarks/restore_memory.py is saved once into a
``shm://`` tier under /dev/shm/rpmlp; each run then restores it in a fresh process, with a
trivial thread started and joined just before the tier's slots thread (TierThread.run
wrapped): while the staging pool's pre-fault holds the address-space lock, the start waits.

    python dev/restore_thread_start.py save
    python dev/restore_thread_start.py run        # one line: dummy_thread_ms restore_ms
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gc
import os
import threading
import time
from typing import Any

import ckptio
from benchmarks.restore_memory import _mlp
from ckptio.managing import tier_thread

os.environ["CKPTIO_SHM_DIR"] = "/dev/shm/rpmlp"
STARTS: list[float] = []


def _timed_run(run: Any) -> Any:
    def wrapped(self: Any, thread: threading.Thread) -> None:
        started = time.perf_counter()
        dummy = threading.Thread(target=lambda: None)
        dummy.start()
        dummy.join()
        STARTS.append(time.perf_counter() - started)
        run(self, thread)
    return wrapped


def main() -> None:
    if sys.argv[1:] == ["save"]:
        with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://mlp", keep_last=1)]) as mgr:
            mgr.save(1, _mlp(1024, fill=True))
        return
    tier_thread.TierThread.run = _timed_run(tier_thread.TierThread.run)  # type: ignore[method-assign]
    state = _mlp(1024, fill=False)
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://mlp", keep_last=1)])
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    assert mgr.restore(state) == 1
    took = time.perf_counter() - started
    mgr.close()
    print(f"{STARTS[0] * 1e3:.2f} {took * 1e3:.1f}")


if __name__ == "__main__":
    main()
