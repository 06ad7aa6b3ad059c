"""First-save benchmark: the synchronous save's share of the disk, first and later, and the
call time of the first async save against later ones, in fresh processes (docs/BENCH_LIMIT.md,
issue 29 item 2).

Owns: per fresh process (one per rep): the state built, one memory copy of it timed (into a
pre-faulted destination), the same-run O_DIRECT write ceiling (ckptio/tuning/ceiling.py, best
geometry), then in one ``Checkpointer`` either three synchronous saves (``--mode sync``: the
first pays pool creation), three eager ``async_save`` calls (``async``: each call timed,
wait() outside the clock), or the same after ``prepare(path, state=)`` (``async_prepared``:
the pool sized and faulted in before the first call, its time reported apart), or a job's
real start (``job``: no ceiling; ``CheckpointManager(dir)``, ``restore(state)`` with nothing
there, a pause standing in for the first training steps (``--pause``), then three
``save(step, state, asynchronous=True)`` calls, each timed, the restore's call reported
apart), or DCP's peers (``dcp_async``, ``dcp_async_staged``: ``dcp()``); each save's time to
durable and the peak RSS growth over the saves; the medians over the processes. Does not
own: the state (ckptio/tuning/state.py) or the ceiling.

    python -m benchmarks.first_save --gb 2 --reps 3 --dir bench-data/first
    python -m benchmarks.first_save --gb 1 --modes async,job --pause 1
    python -m benchmarks.first_save --gb 2 --reps 5 --modes async,dcp_async,dcp_async_staged
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import engines, harness

SAVES = 3
MODES = ("sync", "async", "async_prepared", "job", "dcp_async", "dcp_async_staged")
DCP_THREADS = 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.first_save", description=__doc__)
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB (default 2)")
    p.add_argument("--reps", type=int, default=3, help="fresh processes per mode (default 3)")
    p.add_argument("--dir", type=Path, default=Path("bench-data/first"), help="scratch directory")
    p.add_argument("--json", type=Path, help="write every run and the medians here")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, of {', '.join(MODES)} (default all)")
    p.add_argument("--pause", type=float, default=1.0,
                   help="job mode: seconds between restore() and the first save, standing in "
                        "for the first training steps (default 1)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import ckptio
    import ckptio.api  # noqa: F401 - imported before any clock
    from ckptio.storage.local.local_store import LocalStore
    from ckptio.tuning import ceiling, state

    src = state.build_state(args.gb, 0)
    nbytes = state.tensor_nbytes(src)
    leaves = [t for _k, t in state.tensor_leaves(src)]
    dest = [torch.empty_like(t) for t in leaves]
    for d, t in zip(dest, leaves):  # faulted once, then timed
        d.copy_(t)
    t0 = time.perf_counter()
    for d, t in zip(dest, leaves):
        d.copy_(t)
    memcpy_s = time.perf_counter() - t0
    del dest
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.worker == "job":
        return job(args, src, nbytes, memcpy_s)
    if args.worker.startswith("dcp"):
        return dcp(args, src, nbytes, memcpy_s)
    ceil = []
    for chunk, threads in ceiling.GEOMETRIES:
        path = args.dir / "ceiling.bin"
        os.sync()
        time.sleep(1)
        ceil.append(ceiling.write_ceiling(path, nbytes, chunk, threads)["seconds"])
        path.unlink()
    # the default backend ("auto" since round six) unless CKPTIO_IO_BACKEND names another
    ck = ckptio.Checkpointer(ckptio.Options.from_env(use_profile=False))
    prepare_s = None
    if args.worker == "async_prepared":
        t0 = time.perf_counter()
        ck.prepare(args.dir, state=src, wait=True)
        prepare_s = time.perf_counter() - t0
    def start(path: Path) -> Callable[[], object]:
        if args.worker == "sync":
            ck.save(src, path)
            return lambda: None
        return ck.async_save(src, path).wait

    seconds, durable, peak_mib = timed_saves(args.dir / "s", start)
    with ck.resources().lock:  # the backend the saves ran on, as the Checkpointer built it
        backend = ck.resources().files(LocalStore(str(args.dir)))[1].backend.name
    ck.close()
    return {"mode": args.worker, "bytes": nbytes, "memcpy_s": memcpy_s, "ceiling_s": min(ceil),
            "seconds": seconds, "durable_s": durable, "peak_mib": peak_mib,
            "prepare_s": prepare_s, "io_backend": backend}


def timed_saves(prefix: Path, start: Callable[[Path], Callable[[], object]]) -> tuple[
        list[float], list[float], float]:
    """SAVES saves to ``prefix``0, 1, ... after a sync and a second's rest each: ``start(path)``
    returns once the caller may go on and returns what waits until durable. -> (each call's
    seconds, each save's seconds to durable, peak RSS growth over them in MiB)."""
    seconds, durable = [], []
    rss0 = engines.status_kib("VmRSS")
    engines.reset_peak_rss()
    for i in range(SAVES):
        path = prefix.with_name(f"{prefix.name}{i}")
        shutil.rmtree(path, ignore_errors=True)
        os.sync()
        time.sleep(1)
        t0 = time.perf_counter()
        wait = start(path)
        seconds.append(time.perf_counter() - t0)
        wait()
        durable.append(time.perf_counter() - t0)
        shutil.rmtree(path)
    return seconds, durable, (engines.status_kib("VmHWM") - rss0) / 1024


def dcp(args: argparse.Namespace, src: Any, nbytes: int, memcpy_s: float) -> dict[str, Any]:
    """dcp.async_save on a 1-rank gloo group, thread executor, FileSystemWriter(DCP_THREADS,
    sync_files=True): ``dcp_async`` with its default stager (the call copies the state);
    ``dcp_async_staged`` with DefaultStager(use_async_staging=True) (no pinned or shared
    memory on CPU), the stall being the call plus the wait for its staging, as a loop's next
    step must wait. The durable time is the upload's completion, then os.sync()."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp_
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from benchmarks.train_engines import free_port

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    stager = (DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                           use_async_staging=True, use_non_blocking_copy=False))
              if args.worker == "dcp_async_staged" else None)
    def start(path: Path) -> Callable[[], object]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            response = dcp_.async_save(src, storage_writer=dcp_.FileSystemWriter(
                str(path), thread_count=DCP_THREADS, sync_files=True), async_stager=stager)
        staged = getattr(response, "staging_completion", None)
        if staged is not None:
            staged.result()
        upload = getattr(response, "upload_completion", response)

        def wait_durable() -> None:
            upload.result()
            os.sync()  # .metadata's rename and the directory: sync_files fsyncs only the files
        return wait_durable

    seconds, durable, peak_mib = timed_saves(args.dir / "d", start)
    if stager is not None:
        stager.close()
    dist.destroy_process_group()
    return {"mode": args.worker, "bytes": nbytes, "memcpy_s": memcpy_s, "ceiling_s": None,
            "seconds": seconds, "durable_s": durable, "peak_mib": peak_mib, "prepare_s": None}


def job(args: argparse.Namespace, src: Any, nbytes: int, memcpy_s: float) -> dict[str, Any]:
    """A job's start: a manager, restore() with nothing saved, a pause, then async saves."""
    import ckptio

    root = args.dir / "job"
    shutil.rmtree(root, ignore_errors=True)
    mgr = ckptio.CheckpointManager(root, keep_last=1)
    t0 = time.perf_counter()
    restored = mgr.restore(src)
    prepare_s = time.perf_counter() - t0
    assert restored is None, restored
    time.sleep(args.pause)
    seconds = []
    for step in range(1, SAVES + 1):
        if step > 1:
            os.sync()
            time.sleep(1)
        t0 = time.perf_counter()
        handle = mgr.save(step, src, asynchronous=True, force=True)
        seconds.append(time.perf_counter() - t0)
        assert handle is not None
        mgr.wait()
    mgr.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"mode": "job", "bytes": nbytes, "memcpy_s": memcpy_s, "ceiling_s": None,
            "seconds": seconds, "prepare_s": prepare_s, "pause_s": args.pause}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return harness.emit(worker(args))
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose among {', '.join(MODES)}")
    try:
        runs = harness.repeat(modes, args.reps, lambda mode, _rep: harness.spawn(
            harness.command("benchmarks.first_save", mode, "--gb", repr(args.gb), "--dir",
                            args.dir, "--pause", repr(args.pause)), timeout=900, strict=True))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(report(runs, args))
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "runs": runs}, indent=1))
    return 0


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    med = statistics.median
    backends = sorted({str(r["io_backend"]) for r in runs if r.get("io_backend")}) or ["-"]
    out = [f"# {args.gb} GB state, medians of {args.reps} fresh processes per mode; "
           f"io_backend {', '.join(backends)}", ""]
    sync = [r for r in runs if r["mode"] == "sync"]
    if sync:
        ceil = med(r["ceiling_s"] for r in sync)
        first = med(r["seconds"][0] for r in sync)
        later = med(s for r in sync for s in r["seconds"][1:])
        out += ["| sync save | s | GB/s | % of same-run ceiling |", "|---|---:|---:|---:|",
                f"| O_DIRECT write ceiling | {ceil:.3f} | {sync[0]['bytes'] / ceil / 1e9:.2f} | 100 |"]
        for name, s in (("first save", first), ("later saves", later)):
            pct = med(r["ceiling_s"] / x for r in sync
                      for x in (r["seconds"][:1] if name == "first save" else r["seconds"][1:]))
            out.append(f"| {name} | {s:.3f} | {sync[0]['bytes'] / s / 1e9:.2f} | {100 * pct:.0f} |")
    for mode in MODES[1:]:
        asyn = [r for r in runs if r["mode"] == mode]  # the DCP modes' "call": to staged
        if not asyn:
            continue
        memcpy = med(r["memcpy_s"] for r in asyn)
        first = med(r["seconds"][0] for r in asyn)
        later = med(s for r in asyn for s in r["seconds"][1:])
        out += ["", f"| {mode} call | s | x one memory copy |", "|---|---:|---:|",
                f"| memory copy of the state | {memcpy:.3f} | 1.00 |"]
        if mode == "async_prepared":
            out.append(f"| prepare(path, state=, wait=True), before the first call | "
                       f"{med(r['prepare_s'] for r in asyn):.3f} | - |")
        if mode == "job":
            out.append(f"| mgr.restore(state) call, nothing there ({args.pause:g} s pause after) | "
                       f"{med(r['prepare_s'] for r in asyn):.3f} | - |")
        out += [f"| first call | {first:.3f} | {first / memcpy:.2f} |",
                f"| later calls | {later:.3f} | {later / memcpy:.2f} |"]
        if all("durable_s" in r for r in asyn):
            out += [f"| first durable after | {med(r['durable_s'][0] for r in asyn):.3f} | - |",
                    f"| peak RSS growth over the saves, MiB | "
                    f"{med(r['peak_mib'] for r in asyn):.0f} | - |"]
        each = ", ".join(f"{r['seconds'][0]:.3f}" for r in asyn)
        out.append(f"| first call, each process | {each} | - |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
