"""Many-rank save/load benchmark: ckptio vs DCP on the same FSDP2-like DTensor state, every run a
fresh set of gloo processes, resharded loads (N -> 1, N -> 2N) against the same-layout load.

Owns: the rank launcher (N fresh `python -m benchmarks.ranks --worker` processes joined over
tcp://127.0.0.1), the timed collective save and cold load, and the bitwise check of every load
against digests of the reference state. The sharded state is ranks_state.py's; the engines
ranks_engines.py's; the job list and the report ranks_report.py's. Reuses (does not copy):
state.py, engines.py (RSS, heap release, disk settling), ceiling.py (page-cache drop),
save_load.py (the ceiling worker, medians, report helpers).

    python -m benchmarks.ranks --ranks 2 --gb 2 --reps 3
    ckptio bench save-load --ranks 2 --gb 2 --reps 3     # the same

Per repetition: one job per save engine (ckptio; DCP per --dcp-threads), each N fresh ranks that
build the state, save once untimed-for-the-median ("1st save") and once timed; then one job per
load (ckptio N->N, DCP N->N, ckptio N->1 into plain tensors without a process group, ckptio
N->2N into a 2N-rank mesh), each fresh ranks that allocate and touch the destination, drop the
page cache, idle, then load; then the O_DIRECT ceiling (save_load's worker). Order alternates
between repetitions. Every timed phase starts and ends with a barrier; the time is rank 0's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pickle
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks import harness, load_phases, worker_env
from benchmarks.ranks_report import (RAW, TCP, Run, load_worlds, markdown, peer_worlds, progress,
                                     save_engines,
                                     schedule, summarize)
from benchmarks.io_timeline import Timeline
from benchmarks.ranks_engines import (ckptio_loader, ckptio_save, dcp_load, dcp_save,
                                      raw_writer_save, tcp_load, tcp_save)
from benchmarks.ranks_state import destination, local_digest, local_view, sharded_state, skeleton

PREFIX = "ranks-"  # everything this driver creates under --dir starts with it
EXPECT = PREFIX + "expect.pkl"


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ranks",
        description="Durable N-rank save and cold loads (same layout and resharded) of a sharded "
        "GPT+AdamW state: ckptio vs DCP vs the raw O_DIRECT ceiling, fresh processes per run.")
    p.add_argument("--ranks", type=int, default=2, help="ranks that save (default 2)")
    p.add_argument("--gb", type=float, default=2.0, help="state size in GB (1e9 bytes); default 2")
    p.add_argument("--dir", type=Path, default=Path("bench-data"), help="scratch directory on the "
                   "disk under test (default ./bench-data); what this driver writes there is deleted")
    p.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--dcp-threads", default="1,2,4", help="DCP FileSystemWriter thread_count "
                   "variants, comma list (default 1,2,4); the first one's checkpoint is loaded")
    p.add_argument("--loads", default="same,dcp,to1,to2n", help="loads: same (ckptio N->N), dcp "
                   "(DCP N->N), to1 (ckptio N->1, plain tensors), to2n (ckptio N->2N), tcp (Meta's "
                   "torch_checkpointing saves and loads N->N; not in the default), dcp_to1, "
                   "dcp_to2n, tcp_to1, tcp_to2n (DCP's and torch_checkpointing's resharded loads); "
                   "default the first four")
    p.add_argument("--json", type=Path, help="write runs and summary as JSON here")
    p.add_argument("--markdown", type=Path, help="write the markdown report here")
    p.add_argument("--idle", type=float, default=2.0, help="idle seconds before each timed phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per job")
    p.add_argument("--no-ceiling", action="store_true", help="skip the O_DIRECT ceiling")
    p.add_argument("--raw-writers", action="store_true", help="also time N processes writing S/N "
                   "bytes each with O_DIRECT (the N-writer ceiling), measured like a save")
    p.add_argument("--cold-pool", action="store_true", help="ckptio loads also pay for making "
                   "their staging pool and I/O threads inside the clock (default: made before)")
    p.add_argument("--restart", action="store_true", help="what a restarting job does: ckptio "
                   "loads are `ckptio.load(path, state)` with the defaults (nothing made before "
                   "the clock); every load is timed twice in its processes, the first and a "
                   "later one, each from a cold page cache; each rank's reads are sampled")
    p.add_argument("--host-per-rank", action="store_true", help="each rank plays a host of its "
                   "own (CKPTIO_HOST_ID): a resharded load's shared checksum blocks are read by "
                   "one rank and sent, as across hosts")
    p.add_argument("--trace", action="store_true", help="each rank's phases of every ckptio "
                   "first load, printed (benchmarks/load_phases.py)")
    # worker side
    p.add_argument("--worker", help=argparse.SUPPRESS)  # save:ENGINE | load:ENGINE:WORLD | expect
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1 or args.gb <= 0 or args.ranks < 1:
        p.error("--reps and --ranks must be >= 1 and --gb > 0")
    args.threads = [int(t) for t in args.dcp_threads.split(",") if t.strip()]
    args.load_kinds = [k.strip() for k in args.loads.split(",") if k.strip()]
    if bad := [k for k in args.load_kinds if k not in ("same", "dcp", "to1", "to2n", "tcp",
                                                       "dcp_to1", "dcp_to2n", "tcp_to1",
                                                       "tcp_to2n")]:
        p.error(f"unknown --loads {bad}")
    return args


# ---------------------------------------------------------------- workers


def expect_worker(args: argparse.Namespace) -> Run:
    """Build the reference state once; store the destination skeleton and, for every world size
    a load uses, each rank's expected digest."""
    from ckptio.tuning import state

    t0 = time.perf_counter()
    full = state.build_state(args.gb, args.seed)
    worlds = sorted({args.ranks, *load_worlds(args).values(), *peer_worlds(args, "dcp"),
                     *peer_worlds(args, TCP)})
    digests = {w: [state.digest(local_view(full, r, w)) for r in range(w)] for w in worlds}
    record = {"skeleton": skeleton(full), "digests": digests, "bytes": state.tensor_nbytes(full),
              "tensors": len(state.tensor_leaves(full))}
    with open(args.dir / EXPECT, "wb") as f:
        pickle.dump(record, f)
    return {"job": "expect", "bytes": record["bytes"], "tensors": record["tensors"],
            "seconds": time.perf_counter() - t0, "bitwise_ok": True}


def init_group(args: argparse.Namespace) -> Any:
    """The gloo group and a 1-D CPU mesh over it (None, None for a single unjoined process)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if args.port == 0:
        return None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=args.timeout))
    return init_device_mesh("cpu", (args.world,))


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def timed(fn: Any, idle: float, reset_peak: bool = True) -> tuple[float, float, Any]:
    """engines.timed_phase with barriers: every rank settles, idles, then all start together
    and the clock stops when the last rank is done. -> (seconds, extra RSS MiB, result)."""
    from benchmarks import engines

    gc.collect()
    engines.release_free_heap()
    engines.settle_disk()
    barrier()
    time.sleep(idle)
    before = engines.status_kib("VmRSS")
    if reset_peak:
        engines.reset_peak_rss()
    barrier()
    t0 = time.perf_counter()
    out = fn()
    barrier()
    seconds = time.perf_counter() - t0
    return seconds, (engines.status_kib("VmHWM") - before) / 1024, out


def gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def ckpt_dir(args: argparse.Namespace, engine: str, rep: int) -> Path:
    """Where save engine ``engine`` writes in repetition ``rep``; the load engine "dcp" reads
    what the first DCP variant wrote."""
    if engine == "dcp":
        engine = save_engines(args)[1]
    return args.dir / f"{PREFIX}{engine}-r{rep}"


def save_worker(args: argparse.Namespace, engine: str) -> Run:
    from benchmarks import engines
    from benchmarks import save_load
    from ckptio.tuning import state

    engines.ENGINES["ckptio" if engine == "ckptio" else "dcp_t1"].prepare()
    mesh = init_group(args)
    t0 = time.perf_counter()
    full = state.build_state(args.gb, args.seed)
    nbytes = state.tensor_nbytes(full)
    src = sharded_state(full, args.rank, args.world, mesh)
    del full
    gc.collect()
    build_s = time.perf_counter() - t0
    if engine == RAW:
        save = raw_writer_save(nbytes // args.world, args.rank)
    elif engine == TCP:
        save = tcp_save
    else:
        save = ckptio_save if engine == "ckptio" else dcp_save(int(engine.removeprefix("dcp_t")))
    ckpt = args.ckpt
    first_dir = ckpt.with_name(ckpt.name + "-first")
    if args.rank == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(first_dir, ignore_errors=True)
    barrier()
    rss_before = engines.status_kib("VmRSS")
    first_s, _, _ = timed(lambda: save(src, first_dir), args.idle)
    barrier()
    if args.rank == 0:
        shutil.rmtree(first_dir)
    save_s, _, _ = timed(lambda: save(src, ckpt), args.idle, reset_peak=False)
    rss = (engines.status_kib("VmHWM") - rss_before) / 1024
    rsses = gather(rss)
    files, on_disk, apparent = save_load.disk_usage(ckpt) if args.rank == 0 else (0, 0, 0)
    return {"job": "save", "engine": engine, "rep": args.rep, "ranks": args.world, "bytes": nbytes,
            "build_s": build_s, "first_save_s": first_s, "save_s": save_s,
            "save_rss_mib": max(rsses), "files": files, "disk_bytes": on_disk,
            "apparent_bytes": apparent, "bitwise_ok": True}


def load_worker(args: argparse.Namespace, engine: str) -> Run:
    from ckptio.tuning import ceiling
    from benchmarks import engines

    engines.ENGINES["ckptio" if engine == "ckptio" else "dcp_t1"].prepare()
    mesh = init_group(args)
    with open(args.dir / EXPECT, "rb") as f:
        expect = pickle.load(f)
    dest = destination(expect["skeleton"], args.rank, args.world, mesh)
    gc.collect()
    barrier()
    cache_drop = ceiling.drop_page_cache([args.ckpt]) if args.rank == 0 else ""
    load = loader(args, engine)
    if args.trace and engine == "ckptio":
        load_phases.install()
    disk_before = disk_read_bytes(args.ckpt) if args.rank == 0 else None
    timeline = Timeline()
    seconds, rss, report = timed(lambda: timeline.around(load, args.ckpt, dest), args.idle)
    disk_after = disk_read_bytes(args.ckpt) if args.rank == 0 else None
    ok = local_digest(dest) == expect["digests"][args.world][args.rank]
    phases = gather(load_phases.marks()) if args.trace else None
    later = later_load(args, load, dest, expect) if args.restart else {}
    oks, rsses = gather(ok), gather(rss)
    read = gather(getattr(report, "nbytes_read", None))
    return {**later, "phases": phases, "timelines": gather(timeline.summary()),
            "job": "load", "engine": engine, "rep": args.rep, "ranks": args.world,
            "saved_ranks": args.ranks, "bytes": expect["bytes"], "load_s": seconds,
            "load_rss_mib": max(rsses), "cache_drop": cache_drop, "bitwise_ok": all(oks),
            "bitwise_by_rank": oks, "nbytes_read": None if None in read else sum(read),
            "disk_read_bytes": None if disk_before is None or disk_after is None
            else disk_after - disk_before, "report": _report(report)}


def loader(args: argparse.Namespace, engine: str) -> Any:
    """The load under test: ckptio's (``--restart``: the public ckptio.load with its defaults)
    or DCP's."""
    if engine == TCP:
        return tcp_load
    if engine != "ckptio":
        return dcp_load
    if args.restart:
        import ckptio

        return lambda path, dest: ckptio.load(str(path), dest)
    return ckptio_loader(args.ckpt, not args.cold_pool)


def later_load(args: argparse.Namespace, load: Any, dest: Any,
               expect: dict[str, Any]) -> dict[str, Any]:
    """The same load again in the same processes, the page cache dropped again: what a load
    costs once the process has loaded before."""
    from ckptio.tuning import ceiling

    barrier()
    if args.rank == 0:
        ceiling.drop_page_cache([args.ckpt])
    timeline = Timeline()
    seconds, _rss, _report = timed(lambda: timeline.around(load, args.ckpt, dest), args.idle)
    ok = local_digest(dest) == expect["digests"][args.world][args.rank]
    return {"later_load_s": seconds, "later_bitwise_ok": all(gather(ok)),
            "later_timelines": gather(timeline.summary())}


def disk_read_bytes(path: Path) -> int | None:
    """Bytes the block device holding ``path`` has read so far (all processes: every rank's
    load, whatever it read directly or through the page cache), from /sys; None without it."""
    dev = os.stat(path).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return int(f.read().split()[2]) * 512  # sectors read, of 512 bytes
    except (OSError, ValueError, IndexError):
        return None


def _report(report: object) -> object:
    from benchmarks.save_load import report_fields

    return report_fields(report)


def worker_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kind, _, engine = args.worker.partition(":")
    if kind == "expect":
        run = expect_worker(args)
    elif kind == "save":
        run = save_worker(args, engine)
    else:
        run = load_worker(args, engine)
    # every rank's record (harness.spawn_ranks reads one from each); rank 0's is the job's
    harness.emit(run if args.rank == 0 else {"rank": args.rank, "bitwise_ok": run["bitwise_ok"]})
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):  # teardown only: the result is already out
            dist.destroy_process_group()
    return 0 if run["bitwise_ok"] else 3


# ---------------------------------------------------------------- driver


def launch(args: argparse.Namespace, worker: str, world: int, rep: int, ckpt: Path | None,
           joined: bool = True) -> Run:
    """``world`` fresh worker processes (joined in one gloo group unless ``joined`` is False);
    rank 0's JSON line is the result."""
    from ckptio.testing.rank_processes import free_port

    env = worker_env()
    env.setdefault("OMP_NUM_THREADS", "1")
    port = free_port() if joined else 0
    base = [sys.executable, "-m", "benchmarks.ranks", "--worker", worker, "--world", str(world),
            "--port", str(port), "--ranks", str(args.ranks), "--gb", repr(args.gb), "--dir",
            str(args.dir), "--rep", str(rep), "--idle", repr(args.idle), "--seed", str(args.seed),
            "--timeout", repr(args.timeout), "--loads", args.loads]
    if args.cold_pool:
        base.append("--cold-pool")
    if args.restart:
        base.append("--restart")
    if args.trace:
        base.append("--trace")
    if ckpt is not None:
        base += ["--ckpt", str(ckpt)]
    failed: Run = {"job": worker, "rep": rep, "ranks": world}
    t0 = time.perf_counter()
    ranks = harness.spawn_ranks(lambda r: [*base, "--rank", str(r)], world,
                                env=lambda r: _rank_env(args, env, r), timeout=args.timeout,
                                ok=(0, 3), echo=12, tail=3)  # 3: a result that mismatched
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if "error" in r]
    if "error" in ranks[0]:
        return {**failed, "error": "; ".join(errors)}
    run: Run = ranks[0]
    run["wall_s"] = time.perf_counter() - t0
    if errors:
        run["error"] = "; ".join(errors)
    return run


def run_ceiling(args: argparse.Namespace, rep: int) -> Run:
    from benchmarks import save_load

    from benchmarks.fio_ceiling import fio_read_ceiling

    run = save_load.spawn(args, save_load.CEILING, "gpt", rep)
    run["job"] = "ceiling"
    if "error" not in run:
        fio = fio_read_ceiling(args.dir, run["bytes"])
        if fio is not None:
            run["fio_read_s"], run["fio_command"] = fio["read_s"], fio["command"]
    return run


def run_fio_files(ckpt: Path, rep: int) -> Run:
    """fio reading ckptio's checkpoint's own data files (every rank's) at once, cold."""
    from benchmarks.fio_ceiling import fio_files_ceiling

    fio = fio_files_ceiling(sorted(p for p in ckpt.rglob("data-*.bin")
                                   if not p.name.endswith("-index.bin")))
    if fio is None:
        return {"job": "fio_files", "rep": rep, "error": "fio is not installed"}
    return {"job": "fio_files", "rep": rep, **fio}


def run_all(args: argparse.Namespace) -> list[Run]:
    saves, loads = schedule(args)
    runs = [launch(args, "expect", 1, 0, None, joined=False)]
    print(progress(runs[-1]), file=sys.stderr, flush=True)
    if "error" in runs[-1]:
        return runs
    for rep in range(args.reps):
        order = 1 if rep % 2 == 0 else -1
        for engine in saves[::order]:
            ckpt = ckpt_dir(args, engine, rep)
            keep = engine in (*saves[:2], TCP)  # ckptio's, the loaded DCP variant's, tcp's
            runs.append(launch(args, f"save:{engine}", args.ranks, rep, ckpt))
            print(progress(runs[-1]), file=sys.stderr, flush=True)
            if not keep:
                shutil.rmtree(ckpt, ignore_errors=True)
        # DCP's load last: its buffered reads of its own checkpoint pushed ckptio's out of the
        # host's cache of the virtual disk, and the ckptio load right after it ran 0.08-0.38 s
        # slower than every other run of its row (docs/BENCH_LIMIT.md, round three)
        ours = [load for load in loads if load[0] != "dcp"]
        for engine, world in [*ours[::order], *[load for load in loads if load[0] == "dcp"]]:
            ckpt = ckpt_dir(args, engine, rep)
            run = launch(args, f"load:{engine}", world, rep, ckpt, joined=world > 1)
            run.setdefault("engine", engine)
            run["layout"] = f"{args.ranks}->{world}"
            runs.append(run)
            print(progress(run), file=sys.stderr, flush=True)
            if run.get("phases") and run.get("engine") == "ckptio":
                print(load_phases.table(run["phases"]), file=sys.stderr, flush=True)
        if not args.no_ceiling and shutil.which("fio"):  # fio's reading of ckptio's files
            runs.append(run_fio_files(ckpt_dir(args, "ckptio", rep), rep))
            print(progress(runs[-1]), file=sys.stderr, flush=True)
        for engine in saves:
            shutil.rmtree(ckpt_dir(args, engine, rep), ignore_errors=True)
        if not args.no_ceiling:
            runs.append(run_ceiling(args, rep))
            print(progress(runs[-1]), file=sys.stderr, flush=True)
    return runs


def _rank_env(args: argparse.Namespace, env: dict[str, str], rank: int) -> dict[str, str]:
    """A worker's environment: with --host-per-rank, a host id of its own (CKPTIO_HOST_ID), so
    that ckptio treats the ranks as on separate hosts (shared checksum blocks sent between
    them, not read by each through one page cache)."""
    return {**env, "CKPTIO_HOST_ID": f"bench-host-{rank}"} if args.host_per_rank else env


# ---------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        code = worker_main(args)
        # A gloo worker thread may still drop the last reference to the AsyncWork of the final
        # all_gather_object (its tensors' Python objects) while the interpreter finalizes (the
        # mesh keeps the group alive until the final GC): that thread then needs the GIL, gets
        # pthread_exit, and the forced unwind through a noexcept destructor aborts the process
        # (SIGABRT, "terminate called without an active exception"; about 1 job in 15, a core
        # dump showed ProcessGroupGloo::AsyncWork::~AsyncWork in take_gil). The result is out:
        # end without finalizing, as the test harness's forkserver ranks do.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    created = not args.dir.exists()
    args.dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        runs = run_all(args)
    finally:
        cleanup(args.dir, created)
    print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    summary = summarize(runs, args)
    text = markdown(summary, args, argv)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"argv": argv, "runs": runs, "summary": summary}, indent=1))
    failed = any("error" in r or not r.get("bitwise_ok", True) for r in runs)
    return 1 if failed else 0


def cleanup(root: Path, created: bool) -> None:
    """Remove what this driver (and the ceiling worker) left under ``root``."""
    from benchmarks.save_load import cleanup as save_load_cleanup

    for p in root.glob(PREFIX + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    save_load_cleanup(root, created)


if __name__ == "__main__":
    sys.exit(main())
