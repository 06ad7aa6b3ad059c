"""Restore from the memory tier against a cold disk and one memory copy, in fresh processes.

A state of --gb GB in --tensors float32 tensors (sizes spread 1:8, as weights, norms and
moments are) is saved once into a directory on /dev/shm (the memory tier's medium) and once
into --dir. Each repetition then starts one fresh process per source: it builds the state's
tensors (pre-faulted), makes the Checkpointer's staging (``prepare``), freezes the garbage
collector's startup objects, and times ``Checkpointer.load(path, state)`` (in place, verified);
before the disk's process the page cache is dropped (benchmarks/harness.py's ``cold``:
``drop_caches`` as root), so its reads come from the device. The memcpy process
times ``torch._foreach_copy_`` of the whole state into it. The rollback process restores in
the process that saved: a CheckpointManager with one ``shm://`` tier saves the state four
times (from the third save on its files are written through mappings this process keeps)
and its ``restore(state)`` is timed, copying out of those mappings (``rollback_load_s``: the
load inside it, its ``last_restore`` seconds). The small state: a 12-layer MLP (--mlp-width
wide) and AdamW's state saved by a manager's ``shm://`` tier, restored by a fresh process's
manager (made, like every import, before the clock), against one ``torch._foreach_copy_`` of
its tensors (``mlp_memcpys``: the restore in memcpys of the state). Medians over --reps; run it
from two checkouts (PYTHONPATH) to compare them. ``--quick``: a tiny run of every case (the
tests' smoke run), no numbers to keep.

    python -m benchmarks.restore_memory --gb 1 --reps 5 --dir bench-data --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, write_reports


def _state(gb: float, tensors: int, fill: bool) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [1 + (i % 8) for i in range(tensors)]
    unit = int(gb * 1e9) // 4 // sum(weights)
    return {f"t{i:05d}": (torch.rand(unit * w, generator=gen) if fill
                          else torch.empty(unit * w).fill_(0))  # every page written: faulted in
            for i, w in enumerate(weights)}


def _worker(args: argparse.Namespace) -> None:
    import gc

    import torch

    import ckptio

    if args.worker in ("mlp", "memcpy-mlp"):
        _small(args)
        return
    state = _state(args.gb, args.tensors, fill=False)
    if args.worker == "rollback":
        _rollback(args, state)
        return
    if args.worker == "memcpy":
        src = [torch.ones_like(t) for t in state.values()]
        start = time.perf_counter()
        torch._foreach_copy_(list(state.values()), src)
        harness.emit({"s": time.perf_counter() - start})
        return
    ck = ckptio.Checkpointer()
    ck.prepare(args.path)
    gc.collect()
    gc.freeze()
    start, cpu = time.perf_counter(), time.process_time()
    ck.load(args.path, state)
    harness.emit({"s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu})


def _rollback(args: argparse.Namespace, state: dict[str, Any]) -> None:
    """Four saves through a manager's memory tier under ``args.path``, then its restore of
    the newest into ``state``, timed."""
    import gc

    import ckptio

    os.environ["CKPTIO_SHM_DIR"] = args.path
    saved = _state(args.gb, args.tensors, fill=True)
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://rollback", keep_last=1)])
    try:
        for step in range(1, 5):
            mgr.save(step, saved)
            mgr.wait()
        gc.collect()
        gc.freeze()
        start, cpu = time.perf_counter(), time.process_time()
        assert mgr.restore(state) == 4
        took, cpu = time.perf_counter() - start, time.process_time() - cpu
        load = (mgr.last_restore or {}).get("seconds", took)
        harness.emit({"s": took, "cpu_s": cpu, "load_s": load})
    finally:
        mgr.close()


def _mlp(width: int, fill: bool) -> dict[str, Any]:
    """A 12-layer MLP ``width`` wide and AdamW's state after one step (``fill`` False: zeros)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    if not fill:
        with torch.no_grad():
            for t in _mlp_tensors({"model": model, "optim": opt}):
                t.zero_()
    return {"model": model, "optim": opt}


def _mlp_tensors(state: dict[str, Any]) -> list[Any]:
    import torch

    out = list(state["model"].parameters())
    for per in state["optim"].state.values():
        out += [v for v in per.values() if isinstance(v, torch.Tensor) and v.dim()]
    return out


def _small(args: argparse.Namespace) -> None:
    """A fresh process's restore of the MLP state through a manager of one ``shm://`` tier
    under ``args.path`` (or, for ``memcpy-mlp``, one copy of its tensors)."""
    import gc

    import torch

    import ckptio

    state = _mlp(args.mlp_width, fill=False)
    if args.worker == "memcpy-mlp":
        tensors = _mlp_tensors(state)
        src = [torch.ones_like(t) for t in tensors]
        start = time.perf_counter()
        with torch.no_grad():
            torch._foreach_copy_(tensors, src)
        harness.emit({"s": time.perf_counter() - start})
        return
    os.environ["CKPTIO_SHM_DIR"] = args.path
    mgr = ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://mlp", keep_last=1)])
    try:
        gc.collect()
        gc.freeze()
        start, cpu = time.perf_counter(), time.process_time()
        assert mgr.restore(state) == 1
        harness.emit({"s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu})
    finally:
        mgr.close()


def _save_mlp(args: argparse.Namespace, root: Path) -> None:
    import ckptio

    os.environ["CKPTIO_SHM_DIR"] = str(root)
    with ckptio.CheckpointManager(tiers=[ckptio.Tier("shm://mlp", keep_last=1)]) as mgr:
        mgr.save(1, _mlp(args.mlp_width, fill=True))


def _spawn(args: argparse.Namespace, worker: str, path: str) -> dict[str, float]:
    """One fresh worker process (benchmarks/harness.py) measuring ``worker`` on ``path``."""
    return harness.spawn(harness.command("benchmarks.restore_memory", worker, "--path", path,
                                         "--gb", args.gb, "--tensors", args.tensors,
                                         "--mlp-width", args.mlp_width),
                         strict=True, tail=20)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=1000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("bench-data"))
    p.add_argument("--mlp-width", type=int, default=1024)
    p.add_argument("--json", type=Path)
    p.add_argument("--quick", action="store_true",
                   help="a tiny run of every case (smoke test): 0.01 GB, 20 tensors, 1 rep")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.gb, args.tensors, args.reps, args.mlp_width = 0.01, 20, 1, 64
    if args.worker:
        _worker(args)
        return 0
    import ckptio

    shm = Path(tempfile.mkdtemp(prefix="restore-memory-", dir="/dev/shm"))
    disk = args.dir / "restore-memory"
    shutil.rmtree(disk, ignore_errors=True)
    rows: list[dict[str, Any]] = []
    try:
        state = _state(args.gb, args.tensors, fill=True)
        ckptio.save(state, shm / "step")
        ckptio.save(state, disk)
        del state
        _save_mlp(args, shm / "mlp")
        for rep in range(args.reps):
            memory = _spawn(args, "load", str(shm / "step"))
            harness.cold([disk])
            cold = _spawn(args, "load", str(disk))
            memcpy = _spawn(args, "memcpy", "")
            rollback = _spawn(args, "rollback", str(shm / f"tiers-{rep}"))  # a fresh run
            shutil.rmtree(shm / f"tiers-{rep}", ignore_errors=True)
            mlp = _spawn(args, "mlp", str(shm / "mlp"))
            mlp_memcpy = _spawn(args, "memcpy-mlp", "")
            rows.append({"memory_s": memory["s"], "memory_cpu_s": memory["cpu_s"],
                         "cold_disk_s": cold["s"], "memcpy_s": memcpy["s"],
                         "rollback_s": rollback["s"], "rollback_cpu_s": rollback["cpu_s"],
                         "rollback_load_s": rollback["load_s"], "mlp_restore_s": mlp["s"],
                         "mlp_restore_cpu_s": mlp["cpu_s"], "mlp_memcpy_s": mlp_memcpy["s"]})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    med["memory_vs_cold_disk"] = statistics.median(r["cold_disk_s"] / r["memory_s"] for r in rows)
    med["memory_vs_memcpy_bandwidth"] = statistics.median(r["memcpy_s"] / r["memory_s"] for r in rows)
    med["rollback_vs_memcpy_bandwidth"] = statistics.median(r["memcpy_s"] / r["rollback_s"]
                                                            for r in rows)
    med["mlp_memcpys"] = statistics.median(r["mlp_restore_s"] / r["mlp_memcpy_s"] for r in rows)
    write_reports({"gb": args.gb, "tensors": args.tensors, "mlp_width": args.mlp_width,
                   "reps": rows, "median": med},
                  args.json, None, json.dumps({"median": med}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
