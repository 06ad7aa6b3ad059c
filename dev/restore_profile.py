"""Profile a restore from a tmpfs store in a fresh process: wall, CPU, and optionally cProfile.

    python dev/restore_profile.py setup            # saves both states under /dev/shm/rp-*
    python dev/restore_profile.py run big|mlp [--prof N] [--reps R]

big: 1 GB in 1,000 float32 tensors (sizes 1:8, as benchmarks/restore_memory.py); small: 0.1 GB
so; mlp: a 12-layer MLP (1024 wide) and AdamW's state, about 150 MB: each loaded with
Checkpointer.load after prepare(path) (``-unprepared``: without); mgr: the MLP restored by a
CheckpointManager with one shm:// tier, made in the timed process; memcpy-big, memcpy-mlp:
one torch._foreach_copy_ of that state.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gc
import json
import sys
import time

ROOT = "/dev/shm/rp"


def big_state(fill: bool, gb: float = 1.0):  # type: ignore[no-untyped-def]
    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [1 + (i % 8) for i in range(1000)]
    unit = int(gb * 1e9) // 4 // sum(weights)
    return {f"t{i:05d}": (torch.rand(unit * w, generator=gen) if fill
                          else torch.empty(unit * w).fill_(0)) for i, w in enumerate(weights)}


def mlp_state(fill: bool):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    if not fill:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return {"model": model, "optim": opt}


def _tensors(state):  # type: ignore[no-untyped-def]
    import torch

    if "model" not in state:
        return list(state.values())
    out = list(state["model"].parameters())
    for per in state["optim"].state.values():
        out += [v for v in per.values() if isinstance(v, torch.Tensor) and v.dim()]
    return out


def setup() -> None:
    import shutil

    import ckptio

    shutil.rmtree(ROOT, ignore_errors=True)
    ckptio.save(big_state(True), f"{ROOT}/big")
    ckptio.save(mlp_state(True), f"{ROOT}/mlp")
    ckptio.save(big_state(True, 0.1), f"{ROOT}/small")
    shutil.rmtree("/dev/shm/ckptio/rp-mgr", ignore_errors=True)
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://rp-mgr", keep_last=1)]) as mgr:
        mgr.save(1, mlp_state(True))


def run_mgr(prof: int) -> None:
    """A fresh process's restore through a manager: construction and restore timed apart."""
    import ckptio

    state = mlp_state(False)
    gc.collect()
    gc.freeze()
    prof_ = None
    if prof:
        import cProfile

        prof_ = cProfile.Profile()
        prof_.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://rp-mgr", keep_last=1)])
    t1, c1 = time.perf_counter(), time.process_time()
    step = mgr.restore(state)
    t2, c2 = time.perf_counter(), time.process_time()
    if prof_ is not None:
        import pstats

        prof_.disable()
        pstats.Stats(prof_).sort_stats("cumulative").print_stats(prof)
        pstats.Stats(prof_).sort_stats("tottime").print_stats(prof)
    print(json.dumps({"step": step, "construct_s": t1 - t0, "restore_s": t2 - t1,
                      "construct_cpu": c1 - c0, "restore_cpu": c2 - c1,
                      "last": {k: v for k, v in (mgr.last_restore or {}).items()
                               if k in ("tier", "seconds")}}))
    mgr.close()


def run(which: str, prof: int) -> None:
    import ckptio

    if which == "mgr":
        run_mgr(prof)
        return
    if which.startswith("memcpy-"):  # one torch._foreach_copy_ of that state, for the ratio
        import torch

        dst = big_state(False) if which == "memcpy-big" else mlp_state(False)
        tensors = [t for t in _tensors(dst)]
        src = [torch.ones_like(t) for t in tensors]
        with torch.no_grad():
            start = time.perf_counter()
            torch._foreach_copy_(tensors, src)
        print(json.dumps({"s": time.perf_counter() - start}))
        return
    unprepared = which.endswith("-unprepared")  # no prepare(): the load makes what it needs
    which = which.removesuffix("-unprepared")
    state = {"big": big_state, "mlp": mlp_state,
             "small": lambda fill: big_state(fill, 0.1)}[which](False)
    ck = ckptio.Checkpointer()
    if not unprepared:
        ck.prepare(f"{ROOT}/{which}")
    gc.collect()
    gc.freeze()
    if prof:
        import cProfile
        import pstats

        p = cProfile.Profile()
        p.enable()
        ck.load(f"{ROOT}/{which}", state)
        p.disable()
        pstats.Stats(p).sort_stats("cumulative").print_stats(prof)
        pstats.Stats(p).sort_stats("tottime").print_stats(prof)
        return
    start, cpu = time.perf_counter(), time.process_time()
    ck.load(f"{ROOT}/{which}", state)
    print(json.dumps({"s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}))


if __name__ == "__main__":
    if sys.argv[1] == "setup":
        setup()
    else:
        run(sys.argv[2], int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[3] == "--prof" else 0)
