"""Probe: where the training thread's time goes in the GPU-node model with a lazy save into the
memory tier every step (benchmarks/tiers.py's tiers_lazy engine, pinned). Per step: the wall,
the training thread's own CPU (time.thread_time), its time queued for its core (schedstat: the
machine's other load), the time its optimizer hook waited for the capture (SaveResult.blocked_s
less the call), the rest (off the CPU otherwise: waiting for the interpreter's GIL), its minor
page faults and involuntary context switches; per background thread (by name): CPU seconds
over the run. One fresh process per mode; medians of the steps after the first --skip.

    python dev/tier_trace.py --mode none|lazy|floor [--steps 20] [--skip 4] [--switch 0.0005]

Under py-spy, which thread holds the GIL (its stacks): py-spy record --gil --threads
--nonblocking -r 250 --format raw -o out.txt -- python dev/tier_trace.py --mode lazy
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python dev/NAME.py` from the checkout: its benchmarks/ and ckptio/ first.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


NAMES: dict[int, str] = {}


def thread_stats() -> dict[str, tuple[float, int, int]]:
    """{name/tid: (cpu s, minor faults, nonvoluntary switches)} of every thread of this process."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:
            continue
        name = NAMES.get(int(tid)) or raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw.rsplit(")", 1)[1].split()
        nvcsw = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[f"{name}/{tid}"] = ((int(fields[11]) + int(fields[12])) / tick, int(fields[7]), nvcsw)
    return out


def run_queue_s(tid: int) -> float:
    """Seconds thread ``tid`` has waited on a run queue (runnable, another task on its core)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="lazy", choices=("none", "lazy", "floor"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--gb", type=float, default=0.15)
    p.add_argument("--switch", type=float, default=None,
                   help="sys.setswitchinterval (s) first: how long a GIL waiter waits")
    args = p.parse_args()
    if args.switch is not None:
        sys.setswitchinterval(args.switch)
    import torch

    import ckptio
    from benchmarks.gil_probe import pin_others
    from benchmarks.train import build_training, checkpoint_state, train_step

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {0})
    model, opt, cfg = build_training(args.gb, 0)
    work = Path(tempfile.mkdtemp(prefix="tier-trace-"))
    shm = Path(tempfile.mkdtemp(prefix="tier-trace-", dir="/dev/shm"))
    os.environ["CKPTIO_SHM_DIR"] = str(shm)
    mgr: Any = None
    ck: Any = None
    floor: Any = None
    if args.mode == "lazy":
        ck = ckptio.Checkpointer()
        mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://run", keep_last=2),
                                              ckptio.Tier(str(work / "disk"), every=10,
                                                          keep_last=2)], checkpointer=ck)
        mgr.prepare(checkpoint_state(model, opt, 0, 2), wait=True)
    elif args.mode == "floor":
        from benchmarks.loop_peers import FloorSaver
        floor = FloorSaver(opt)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(cfg.vocab, (args.steps, 2, 129), generator=gen)
    me = threading.get_native_id()
    pin_others(me, 1)
    rows: list[dict[str, float]] = []
    before = thread_stats()
    results: list[Any] = []
    for step in range(1, args.steps + 1):
        own = {k: v for k, v in thread_stats().items() if k.endswith(f"/{me}")}
        q0 = run_queue_s(me)
        t0, c0 = time.perf_counter(), time.thread_time()
        train_step(model, opt, tokens[step - 1])
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        queued = run_queue_s(me) - q0
        own2 = {k: v for k, v in thread_stats().items() if k.endswith(f"/{me}")}
        (_, f0, s0), (_, f1, s1) = next(iter(own.values())), next(iter(own2.values()))
        saved = checkpoint_state(model, opt, step, 2)
        t1 = time.perf_counter()
        if mgr is not None:
            results.append(mgr.save(step, saved, lazy=True, optimizers=[opt], force=True))
        elif floor is not None:
            floor.start(step, saved)
        call = time.perf_counter() - t1
        pin_others(me, 1)
        rows.append({"wall": wall, "cpu": cpu, "queued": queued, "blocked": 0.0,
                     "faults": f1 - f0,
                     "nvcsw": s1 - s0, "call": call})
    NAMES.update({t.native_id: t.name.split("-")[0] + "-" + t.name.split("-")[1]
                  if t.name.count("-") else t.name
                  for t in threading.enumerate() if t.native_id is not None})
    after = thread_stats()
    for i, result in enumerate(results[:-1]):  # save i's hook held step i + 1's optimizer step
        done = result.wait() if hasattr(result, "wait") else result
        if done is not None:
            rows[i + 1]["blocked"] = max(0.0, done.blocked_s - rows[i]["call"])
    for row in rows:  # off the CPU, not queued for it, not in the hook: waiting for the GIL
        row["gil"] = row["wall"] - row["cpu"] - row["queued"] - row["blocked"]
    if mgr is not None:
        mgr.close()
        ck.close()
    if floor is not None:
        floor.close()
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    steady = rows[args.skip:]
    summary = {k: statistics.median(r[k] for r in steady) for k in steady[0]}
    cpu_by: dict[str, float] = {}
    for key, (cpu, _f, _s) in after.items():
        name = key.split("/")[0]
        cpu_by[name] = cpu_by.get(name, 0.0) + cpu - before.get(key, (0.0, 0, 0))[0]
    print(json.dumps({"mode": args.mode, "median": summary,
                      "thread_cpu_s": {k: round(v, 3) for k, v in cpu_by.items() if v > 0}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
