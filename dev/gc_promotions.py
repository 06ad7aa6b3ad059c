"""Which objects a checkpointing loop promotes to the collector's oldest generation (issue 65).

A full collection runs once the objects promoted since the last one exceed a quarter of those
already there, whether or not they died since; so what counts is how many objects a save
promotes, not how many it leaves alive. This probe runs the loop of benchmarks/gc_pressure.py
(500 ``Linear(16, 16)`` and SGD with momentum, a CheckpointManager with one ``shm://`` tier
saving every step), and over 20 steps after 20 of warm-up records, at every generation-1
collection, the objects that moved to generation 2, by type. A probe: its walks are slow.

    python dev/gc_promotions.py eager|lazy|none
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gc
import os
import sys
import tempfile
from collections import Counter
from typing import Any


from benchmarks.call_overhead import many_tensors_state

import ckptio


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "eager"
    os.environ["CKPTIO_SHM_DIR"] = tempfile.mkdtemp(dir="/dev/shm")
    state = many_tensors_state(1000)
    opt = state["optim"]
    mgr = (None if mode == "none" else
           ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://promotions", keep_last=2)]))

    def step(n: int) -> None:
        if mgr is not None:
            mgr.save(n, state, asynchronous=True, lazy=mode == "lazy",
                     optimizers=[opt] if mode == "lazy" else ())
        opt.step()

    for n in range(1, 21):
        step(n)
    if mgr is not None:
        mgr.wait()
    gc.collect()
    types: Counter[str] = Counter()
    young: list[list[Any]] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if info["generation"] != 1:
            return
        if phase == "start":
            young.append(gc.get_objects(0) + gc.get_objects(1))
            return
        old = {id(o) for o in gc.get_objects(2)}
        types.update(type(o).__name__ for o in young.pop() if id(o) in old)

    gc.callbacks.append(watch)
    for n in range(21, 41):
        step(n)
    gc.callbacks.remove(watch)
    print(f"{mode}: {sum(types.values())} objects promoted to generation 2 over 20 saves")
    print(types.most_common(10))
    if mgr is not None:
        mgr.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
